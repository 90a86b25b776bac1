// NVFP4 -> dense (bf16 / fp16 / fp32) dequantization, for the large-M path (dequantize one layer,
// cuBLAS, free). Memory-bound: 0.5625 B read and 2 B written per bf16 weight, so the goal is copy
// bandwidth: every thread handles whole 16-element scale blocks with vector loads and stores.
//
// The arithmetic is the format's reference formula exactly: e2m1 (exact in fp32) times
// (scale / global_scale) rounded once in fp32, then one rounding to the output dtype, so the
// result is bit-identical to verl_qerl.kernels.reference.dequantize_ref.
#include <cuda_fp8.h>

#include "nvfp4_common.cuh"
#include "qerl_nvfp4.h"

namespace qerl {
namespace {

constexpr int kThreads = 256;

// 4-bit code -> exact e2m1 value in fp32 via its bits (e1 e0 m at 24..22, sign at 31).
__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
  const uint32_t bits = ((code & 8u) << 28) | ((code & 7u) << 22);
  return __uint_as_float(bits) * 0x1p126f;
}

template <typename OutT>
__device__ __forceinline__ void store16(OutT* dst, const float v[16]);

template <>
__device__ __forceinline__ void store16<__nv_bfloat16>(__nv_bfloat16* dst, const float v[16]) {
  uint4 o[2];
  uint32_t* w = reinterpret_cast<uint32_t*>(o);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    __nv_bfloat162 p = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    w[i] = *reinterpret_cast<uint32_t*>(&p);
  }
  reinterpret_cast<uint4*>(dst)[0] = o[0];
  reinterpret_cast<uint4*>(dst)[1] = o[1];
}

template <>
__device__ __forceinline__ void store16<__half>(__half* dst, const float v[16]) {
  uint4 o[2];
  uint32_t* w = reinterpret_cast<uint32_t*>(o);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    __half2 p = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
    w[i] = *reinterpret_cast<uint32_t*>(&p);
  }
  reinterpret_cast<uint4*>(dst)[0] = o[0];
  reinterpret_cast<uint4*>(dst)[1] = o[1];
}

template <>
__device__ __forceinline__ void store16<float>(float* dst, const float v[16]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
    reinterpret_cast<float4*>(dst)[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
}

// compressed-tensors layout: block i = 8 packed bytes + 1 scale byte -> 16 outputs at 16 * i.
template <typename OutT>
__global__ void __launch_bounds__(kThreads)
    dequant_ct_kernel(const uint2* __restrict__ packed, const uint8_t* __restrict__ scale,
                      const float* __restrict__ gscale, OutT* __restrict__ out, long long nblocks) {
  const long long i = blockIdx.x * (long long)kThreads + threadIdx.x;
  if (i >= nblocks) return;
  const uint2 p = __ldcs(packed + i);  // streamed once: evict-first
  __nv_fp8_e4m3 s8;
  s8.__x = __ldcs(reinterpret_cast<const unsigned char*>(scale) + i);
  const float eff = __fdiv_rn(static_cast<float>(s8), __ldg(gscale));
  float v[16];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    v[j] = e2m1_to_float((p.x >> (4 * j)) & 0xFu) * eff;
    v[8 + j] = e2m1_to_float((p.y >> (4 * j)) & 0xFu) * eff;
  }
  store16<OutT>(out + i * 16, v);
}

// Repacked layout: one CTA = one (128-row tile, 128-wide K stage) block, 8 warps = the 8 row
// blocks. Each lane decodes its 2 x 32 values into a padded shared tile, then the CTA writes the
// tile out row by row with 16-byte stores, so every DRAM sector is written whole (scattered
// 4-byte stores made partial-sector writes and ran at ~0.5 TB/s).
template <typename OutT>
struct RepackedTile {
  static constexpr int ROW_BYTES = 128 * int(sizeof(OutT)) + 16;  // +16: no bank conflicts
  static constexpr int SMEM = 128 * ROW_BYTES;
};

template <typename OutT>
__global__ void __launch_bounds__(kThreads)
    dequant_repacked_kernel(const uint4* __restrict__ qw, const uint2* __restrict__ qs,
                            const float* __restrict__ gscale, OutT* __restrict__ out, int N, int K) {
  using Pair = typename OutPair<OutT>::type;
  using T = RepackedTile<OutT>;
  extern __shared__ __align__(16) uint8_t tile[];
  const int stage = blockIdx.x, ntile = blockIdx.y, stages = gridDim.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = lane >> 2, c = lane & 3;
  const float g = __ldg(gscale);
  const size_t blk0 = (size_t(ntile) * stages + stage) * 16;  // 16 tiles (8 row blocks x 2) per stage
#pragma unroll
  for (int t2 = 0; t2 < 2; ++t2) {
    const size_t t = blk0 + warp * 2 + t2;
    const uint4 w = __ldcs(qw + t * 32 + lane);
    const uint2 sb = __ldcs(qs + t * 8 + r);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t word = j == 0 ? w.x : (j == 1 ? w.y : (j == 2 ? w.z : w.w));
      const uint32_t sword = j < 2 ? sb.x : sb.y;
      const float eff_lo = __fdiv_rn(scale_from_byte((sword >> (8 * ((j & 1) * 2))) & 0xFFu), g);
      const float eff_hi = __fdiv_rn(scale_from_byte((sword >> (8 * ((j & 1) * 2 + 1))) & 0xFFu), g);
      uint32_t raw[4];
      decode_raw(word, raw);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = warp * 16 + r + 8 * (e & 1);
        const int col = t2 * 64 + 16 * j + 2 * c + 8 * (e >> 1);
        const float eff = (e & 1) ? eff_hi : eff_lo;
        *reinterpret_cast<Pair*>(tile + row * T::ROW_BYTES + col * int(sizeof(OutT))) =
            OutPair<OutT>::make(raw_half_to_float(raw[e], 0) * eff, raw_half_to_float(raw[e], 1) * eff);
      }
    }
  }
  __syncthreads();
  constexpr int CHUNKS = 128 * int(sizeof(OutT)) / 16;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < 128 * CHUNKS; i += kThreads) {
    const int row = i / CHUNKS, ch = i % CHUNKS;
    const int n = ntile * 128 + row;
    if (n < N) {
      const uint4 v = *reinterpret_cast<const uint4*>(tile + row * T::ROW_BYTES + ch * 16);
      *reinterpret_cast<uint4*>(reinterpret_cast<uint8_t*>(out + size_t(n) * K + size_t(stage) * 128) + ch * 16) = v;
    }
  }
}

template <typename OutT>
cudaError_t launch_ct(const uint8_t* packed, const uint8_t* scale, const float* g, void* out, int N, int K,
                      cudaStream_t stream) {
  const long long nblocks = (long long)N * (K / 16);
  if (nblocks == 0) return cudaSuccess;
  const unsigned grid = unsigned((nblocks + kThreads - 1) / kThreads);
  dequant_ct_kernel<OutT><<<grid, kThreads, 0, stream>>>(reinterpret_cast<const uint2*>(packed), scale, g,
                                                        static_cast<OutT*>(out), nblocks);
  return cudaGetLastError();
}

template <typename OutT>
cudaError_t launch_repacked(const uint8_t* qw, const uint8_t* qs, const float* g, void* out, int N, int K,
                            cudaStream_t stream) {
  if (N == 0 || K == 0) return cudaSuccess;
  const int smem = RepackedTile<OutT>::SMEM;
  static bool attr_set[64] = {};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (smem > 48 * 1024 && (dev < 0 || dev >= 64 || !attr_set[dev])) {
    e = cudaFuncSetAttribute(dequant_repacked_kernel<OutT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    if (dev >= 0 && dev < 64) attr_set[dev] = true;
  }
  dim3 grid(unsigned(K / 128), unsigned((N + 127) / 128));
  dequant_repacked_kernel<OutT><<<grid, kThreads, smem, stream>>>(
      reinterpret_cast<const uint4*>(qw), reinterpret_cast<const uint2*>(qs), g, static_cast<OutT*>(out), N, K);
  return cudaGetLastError();
}

}  // namespace
}  // namespace qerl

extern "C" cudaError_t qerl_nvfp4_dequant_launch(const uint8_t* packed, const uint8_t* scale,
                                                 const float* global_scale, void* out, int N, int K,
                                                 int out_dtype, cudaStream_t stream) {
  if (N < 0 || K < 0 || K % 16 != 0) return cudaErrorInvalidValue;
  switch (out_dtype) {
    case QERL_BF16:
      return qerl::launch_ct<__nv_bfloat16>(packed, scale, global_scale, out, N, K, stream);
    case QERL_F16:
      return qerl::launch_ct<__half>(packed, scale, global_scale, out, N, K, stream);
    case QERL_F32:
      return qerl::launch_ct<float>(packed, scale, global_scale, out, N, K, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

extern "C" cudaError_t qerl_nvfp4_dequant_repacked_launch(const uint8_t* qweight, const uint8_t* qscale,
                                                          const float* global_scale, void* out, int N, int K,
                                                          int out_dtype, cudaStream_t stream) {
  if (N < 0 || K < 0 || K % 128 != 0 || N % 16 != 0) return cudaErrorInvalidValue;
  switch (out_dtype) {
    case QERL_BF16:
      return qerl::launch_repacked<__nv_bfloat16>(qweight, qscale, global_scale, out, N, K, stream);
    case QERL_F16:
      return qerl::launch_repacked<__half>(qweight, qscale, global_scale, out, N, K, stream);
    case QERL_F32:
      return qerl::launch_repacked<float>(qweight, qscale, global_scale, out, N, K, stream);
    default:
      return cudaErrorInvalidValue;
  }
}
