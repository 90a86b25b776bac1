// Stand-alone racecheck probe for the barrier pattern of the split-K kernel's LoRA epilogue
// (cuda/nvfp4_gemm.cu + cuda/lora_epilogue.cuh), without the GEMM: does compute-sanitizer racecheck report a
// hazard on a write that PTX orders before a read by a CTA-wide barrier, when the writing warps passed a named
// barrier of their own (bar.sync 1, 128) in between?
//
// 256 threads. Warps 4..7 stage a row in shared memory, pass a barrier among themselves, then each writes one float
// of `lt` (as lora_tile does); all 256 threads pass __syncthreads(); warps 4..7 exit and warps 0..3 read `lt` (as
// store_bf16_lora does). Per PTX the read is ordered after the write in every mode below; the output is checked.
//
// mode 0: as the kernel: warps 4..7 use `bar.sync 1, 128`
// mode 1: mode 0, and warps 4..7 spin before their named barrier (warps 0..3 already wait at barrier 0)
// mode 2: mode 0, and warps 0..3 spin before barrier 0 (the writes are done before they arrive)
// mode 3: control: no named barrier, the staging barrier is a __syncthreads() of all 256 threads
// mode 4: warps 0..3 `bar.arrive 1, 256` (no wait), warps 4..7 `bar.sync 1, 256`
//
// Build and run (GPU):  nvcc -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -o /tmp/nbr named_barrier_repro.cu
//   for m in 0 1 2 3 4; do compute-sanitizer --tool racecheck /tmp/nbr $m; done
#include <cstdio>
#include <cstdlib>

__device__ __forceinline__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

__global__ void __launch_bounds__(256) probe(const float* __restrict__ src, float* __restrict__ out, int mode) {
  __shared__ float stage[128];
  __shared__ float lt[128];
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  if (warp >= 4) {
    const int c = tid - 128;
    stage[c] = src[blockIdx.x * 128 + c];
    if (mode == 1) spin(200000);
    if (mode == 3) {
      __syncthreads();
    } else if (mode == 4) {
      asm volatile("bar.sync 1, 256;\n" ::: "memory");
    } else {
      asm volatile("bar.sync 1, 128;\n" ::: "memory");
    }
    lt[c] = stage[(c + 1) % 128] * 2.0f;  // a value staged by another warp
  } else {
    if (mode == 3) __syncthreads();
    if (mode == 4) asm volatile("bar.arrive 1, 256;\n" ::: "memory");
    if (mode == 2) spin(200000);
  }
  __syncthreads();
  if (warp >= 4) return;
  out[blockIdx.x * 128 + (127 - tid)] = lt[127 - tid] + 1.0f;  // another warp's column
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? atoi(argv[1]) : 0;
  const int blocks = 264;
  const int n = blocks * 128;
  float *src = nullptr, *out = nullptr;
  cudaMallocManaged(&src, n * sizeof(float));
  cudaMallocManaged(&out, n * sizeof(float));
  for (int i = 0; i < n; ++i) src[i] = float(i % 1000);
  probe<<<blocks, 256>>>(src, out, mode);
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("mode %d: CUDA error %s\n", mode, cudaGetErrorString(e));
    return 1;
  }
  int bad = 0;
  for (int b = 0; b < blocks; ++b)
    for (int c = 0; c < 128; ++c)
      bad += out[b * 128 + c] != src[b * 128 + (c + 1) % 128] * 2.0f + 1.0f;
  printf("mode %d: %d wrong outputs of %d\n", mode, bad, n);
  return bad != 0;
}
