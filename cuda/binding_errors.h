// The torch binding's error messages (cuda/qerl_torch.cpp, cuda/gemm_route.cpp): QCHECK(cond, parts...) raises
// the parts joined as one std::string.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <type_traits>

namespace qerl_binding {

// Error messages are built with std::string only: formatting through std::ostream (what
// TORCH_CHECK does with several arguments) crashed inside this JIT-built library on the GPU
// machine (libstdc++ ostream instantiations; cuda-gdb backtrace in benchmarks/NOTES.md), so every
// refusal segfaulted instead of raising. TORCH_CHECK with one std::string does no formatting.
inline void app(std::string& s, const char* v) { s += v; }
inline void app(std::string& s, const std::string& v) { s += v; }
template <typename T, typename = std::enable_if_t<std::is_integral_v<T> || std::is_enum_v<T>>>
inline void app(std::string& s, T v) {
  s += std::to_string(static_cast<long long>(v));
}
inline void app(std::string& s, at::ScalarType t) { s += c10::toString(t); }
inline void app(std::string& s, const at::Device& d) { s += d.str(); }
inline void app(std::string& s, at::IntArrayRef a) {
  s += "[";
  for (size_t i = 0; i < a.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(static_cast<long long>(a[i]));
  }
  s += "]";
}
template <typename... A>
std::string msg(const A&... a) {
  std::string s;
  (app(s, a), ...);
  return s;
}
#define QCHECK(cond, ...) TORCH_CHECK((cond), ::qerl_binding::msg(__VA_ARGS__))

}  // namespace qerl_binding
