// Device helpers shared by the NVFP4 kernels: the E2M1 / scale decoders of the repacked layout.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace qerl {

// Bits of a bf16x2 register that one decoded word fills: magnitude (e1 e0 m) at 8..6, sign 15.
constexpr uint32_t kMask = 0x81C081C0u;
constexpr uint32_t kMaskA3Lo = 0x80C080C0u;
constexpr uint32_t kMaskA3Hi = 0x01000100u;

__device__ __forceinline__ uint32_t rotl(uint32_t v, int s) { return __funnelshift_l(v, v, s); }

// One 32-bit word of the repacked layout -> the four bf16x2 registers of an m16n8k16 A fragment,
// still in the "raw" domain: each bf16 is e2m1(code) * 2^-126 (subnormal for |code| = 0.5).
__device__ __forceinline__ void decode_raw(uint32_t w, uint32_t r[4]) {
  r[0] = w & kMask;
  r[1] = rotl(w, 4) & kMask;
  r[2] = rotl(w, 10) & kMask;
  r[3] = (rotl(w, 6) & kMaskA3Lo) | (rotl(w, 14) & kMaskA3Hi);
}

// Scale byte `idx` (0..3) of `word` -> bf16x2 {S, S} with S = scale * 2^119 (exact).
__device__ __forceinline__ uint32_t scale_pair(uint32_t word, int idx) {
  const uint32_t v = __byte_perm(word, 0u, 0x4040u | (uint32_t(idx) << 8) | uint32_t(idx));
  return v * 16u + 0x70007000u;
}

// Scale bytes idx and idx+1 of `word` -> bf16x2 {S(idx), S(idx+1)}, each scale * 2^119 (exact).
__device__ __forceinline__ uint32_t scale_two(uint32_t word, int idx) {
  const uint32_t v = __byte_perm(word, 0u, 0x4040u | (uint32_t(idx + 1) << 8) | uint32_t(idx));
  return v * 16u + 0x70007000u;
}

// a * {lo(s), lo(s)} and a * {hi(s), hi(s)}: the half broadcast is an operand selector of HMUL2.
__device__ __forceinline__ uint32_t bf16x2_mul_lo(uint32_t a, uint32_t s) {
  const __nv_bfloat162 sv = *reinterpret_cast<const __nv_bfloat162*>(&s);
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), __low2bfloat162(sv));
  return *reinterpret_cast<uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t bf16x2_mul_hi(uint32_t a, uint32_t s) {
  const __nv_bfloat162 sv = *reinterpret_cast<const __nv_bfloat162*>(&s);
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), __high2bfloat162(sv));
  return *reinterpret_cast<uint32_t*>(&r);
}

// Scale byte -> float32 scale (exact); 0 -> 0.
__device__ __forceinline__ float scale_from_byte(uint32_t b) {
  const float s = __uint_as_float(((b << 4) | 0x7000u) << 16) * 0x1p-119f;
  return b == 0u ? 0.0f : s;
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                             *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// Upper or lower bf16 of a raw register -> the exact e2m1 value in float32.
__device__ __forceinline__ float raw_half_to_float(uint32_t r, int half) {
  const uint32_t bits = half ? (r & 0xFFFF0000u) : (r << 16);
  return __uint_as_float(bits) * 0x1p126f;
}

template <typename T>
struct OutPair;
template <>
struct OutPair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  __device__ __forceinline__ static type make(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <>
struct OutPair<__half> {
  using type = __half2;
  __device__ __forceinline__ static type make(float a, float b) { return __floats2half2_rn(a, b); }
};
template <>
struct OutPair<float> {
  using type = float2;
  __device__ __forceinline__ static type make(float a, float b) { return make_float2(a, b); }
};

}  // namespace qerl
