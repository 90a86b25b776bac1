// The LoRA expand as one CUDA kernel launched from C++: y = out + mask * (shrunk @ B^T), slice-aware.
//
// Why here and not only in Triton (verl_qerl/kernels/lora_expand.py): where no GEMM epilogue takes the expand
// (tiles of more than 8 tokens: the prefill, decode at B >= 16), qerl::nvfp4_lora_linear ran it through the
// dispatcher as a Python op that launched a Triton kernel, ~96 us of host time per layer (the profile of a 256-token
// 7B prefill: 10.8 ms of 57 ms, benchmarks/NOTES.md "Eighth round"), where a launch from C++ is a few us. Numbers:
// the same products as the split-K epilogue (cuda/lora_epilogue.cuh), each output column reading only its slice's
// rank values of B, summed in rank order in FP32, then out + mask * sum in FP32 and one rounding.
//
// Work split: a CTA owns kThreads * 2 adjacent columns and TOK tokens; it stages its tokens' shrink rows (as float)
// and mask in shared memory, then each thread loops over its slice's ranks once, reading one B value per column per
// rank and accumulating TOK x 2 sums in registers. Memory-bound at prefill sizes (out read and written once).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "qerl_nvfp4.h"

namespace qerl {
namespace {

constexpr int kExpandThreads = 128;  // 256 columns per CTA

template <typename T>
__device__ __forceinline__ float to_f(T v) {
  if constexpr (__is_same(T, __nv_bfloat16))
    return __bfloat162float(v);
  else
    return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T from_f(float v) {
  if constexpr (__is_same(T, __nv_bfloat16))
    return __float2bfloat16_rn(v);
  else
    return __float2half_rn(v);
}

// The first B column of column n's slice (constant indices only: the parameter struct stays out of local memory).
__device__ __forceinline__ int slice_offset(int n, const QerlLoraExpand& p) {
  int s = 0;
#pragma unroll
  for (int i = 0; i + 1 < QERL_LORA_EXPAND_MAX_SLICES; ++i) s += (i + 1 < p.n_slices && n >= p.slice_end[i]);
  return s * p.rank;
}

template <typename T, int TOK>
__global__ void __launch_bounds__(kExpandThreads) lora_expand_kernel(QerlLoraExpand p) {
  extern __shared__ float s_shrunk[];  // [TOK][R]
  __shared__ float s_mask[TOK];
  const T* out = static_cast<const T*>(p.out);
  T* y = static_cast<T*>(p.y);
  const T* shrunk = static_cast<const T*>(p.shrunk);
  const T* b = static_cast<const T*>(p.lora_b);
  const T* mask = static_cast<const T*>(p.mask);
  const int R = p.n_slices * p.rank;
  const int t0 = blockIdx.y * TOK;
  const int nt = min(TOK, p.T - t0);
  for (int i = threadIdx.x; i < nt * R; i += kExpandThreads) {
    const int t = i / R;
    s_shrunk[i] = to_f(shrunk[size_t(t0 + t) * p.ld_shrunk + (i - t * R)]);
  }
  if (threadIdx.x < TOK) s_mask[threadIdx.x] = threadIdx.x < nt ? to_f(mask[size_t(t0 + threadIdx.x) * p.mask_stride]) : 0.f;
  __syncthreads();
  const int n0 = 2 * (blockIdx.x * kExpandThreads + threadIdx.x);
  if (n0 >= p.N) return;
  const bool two = n0 + 1 < p.N;
  const int off0 = slice_offset(n0, p);
  const int off1 = two ? slice_offset(n0 + 1, p) : off0;
  const T* b0 = b + size_t(n0) * p.ld_b + off0;
  const T* b1 = b + size_t(two ? n0 + 1 : n0) * p.ld_b + off1;
  float acc0[TOK], acc1[TOK];
#pragma unroll
  for (int t = 0; t < TOK; ++t) acc0[t] = acc1[t] = 0.f;
  for (int j = 0; j < p.rank; ++j) {
    const float w0 = to_f(b0[j]);
    const float w1 = two ? to_f(b1[j]) : 0.f;
#pragma unroll
    for (int t = 0; t < TOK; ++t) {
      acc0[t] = fmaf(s_shrunk[t * R + off0 + j], w0, acc0[t]);
      acc1[t] = fmaf(s_shrunk[t * R + off1 + j], w1, acc1[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < TOK; ++t) {
    if (t >= nt) break;
    const float m = s_mask[t];
    const size_t ro = size_t(t0 + t) * p.ld_out, ry = size_t(t0 + t) * p.ld_y;
    if (m == 0.f && p.out == p.y) continue;  // in place: a token without the adapter keeps its row
    y[ry + n0] = from_f<T>(to_f(out[ro + n0]) + m * acc0[t]);
    if (two) y[ry + n0 + 1] = from_f<T>(to_f(out[ro + n0 + 1]) + m * acc1[t]);
  }
}

template <typename T, int TOK>
cudaError_t launch_expand(const QerlLoraExpand& p, cudaStream_t stream) {
  const dim3 grid((p.N + 2 * kExpandThreads - 1) / (2 * kExpandThreads), (p.T + TOK - 1) / TOK);
  const size_t smem = size_t(TOK) * p.n_slices * p.rank * sizeof(float);
  lora_expand_kernel<T, TOK><<<grid, kExpandThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace
}  // namespace qerl

extern "C" int qerl_lora_expand_supported(const QerlLoraExpand* p) {
  if (p == nullptr || p->out == nullptr || p->y == nullptr || p->shrunk == nullptr || p->lora_b == nullptr ||
      p->mask == nullptr)
    return 0;
  if (p->dtype != QERL_BF16 && p->dtype != QERL_F16) return 0;
  if (p->T < 0 || p->N < 0 || p->rank < 1 || p->n_slices < 1 || p->n_slices > QERL_LORA_EXPAND_MAX_SLICES) return 0;
  if (p->n_slices * p->rank > QERL_LORA_EXPAND_MAX_RANKS) return 0;
  for (int s = 0; s < p->n_slices; ++s)
    if ((s > 0 && p->slice_end[s] < p->slice_end[s - 1]) || p->slice_end[s] < 0) return 0;
  return p->n_slices == 1 || p->slice_end[p->n_slices - 1] >= p->N;
}

extern "C" cudaError_t qerl_lora_expand_launch(const QerlLoraExpand* p, cudaStream_t stream) {
  if (!qerl_lora_expand_supported(p)) return cudaErrorInvalidValue;
  if (p->T == 0 || p->N == 0) return cudaSuccess;
  const bool few = p->T <= 8;
  if (p->dtype == QERL_BF16)
    return few ? qerl::launch_expand<__nv_bfloat16, 8>(*p, stream) : qerl::launch_expand<__nv_bfloat16, 32>(*p, stream);
  return few ? qerl::launch_expand<__half, 8>(*p, stream) : qerl::launch_expand<__half, 32>(*p, stream);
}
