// How fast can the CTAs of a thread-block cluster move FP32 partial sums between their shared memories on Hopper,
// with every SM doing it at once -- by pulling (each CTA loads its share of the others' sums, 16-byte
// `ld.shared::cluster`, what cluster_splitk::reduce_store does today) or by pushing (each CTA sends every other rank its
// share, as 16-byte `st.async` or as one `cp.async.bulk.shared::cluster` per share, completing on the receiver's
// mbarrier)?
//
// Why (benchmarks/NOTES.md, "Open leads after the twenty-third round", lead 4): the cluster split-K's sums cost ~5 us
// of a 19-23 us narrow GEMM at M = 256 (7B qkv / o), read at ~26 GB/s per SM. If pushing moves the same bytes at
// >= 2x that rate, rewriting the reduction is worth ~2 us per narrow GEMM; if not, the SM-to-SM network is the bound
// and the lead is closed. A standalone probe (no torch), one bare GPU call:
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -DQERL_HAVE_SM90A=1 -I cuda \
//        benchmarks/dsmem_probe.cu -o /tmp/dsmem_probe && /tmp/dsmem_probe > $OUT/dsmem-probe.tsv
//
// (benchmarks/dsmem_probe.py does that and writes the results JSON.) Each CTA holds s shares of `slice` floats of its
// own "partial" (96 KB: the wide kernel's 128-row x 192-token tile; its 256-token tile is 128 KB) and a receive area
// for (s - 1) shares. One round = every CTA moves (s - 1) shares of kSliceFloats floats, then a cluster
// barrier; `reps` rounds run inside one launch, timed with CUDA events, after a warm-up launch. A "barrier only" mode
// gives the rounds' fixed cost. Every mode checks the data it moved against the sender's pattern (the pull mode as
// it loads, the push modes after the last round) and counts mismatches: a wrong figure is not printed as a rate.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include <cstdlib>
#include <vector>

#include "tma_sm90.cuh"
#include "wgmma_sm90.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kTileBytes = 96 * 1024;  // one CTA's partial (all s shares)
constexpr int kMaxRanks = 8;           // the largest cluster probed (the portable limit, cluster_splitk::kMaxCtas)

enum Mode : int { kBarrierOnly = 0, kPull = 1, kPushStAsync = 2, kPushBulk = 3 };
const char* const kModeNames[] = {"barrier_only", "pull_ld_v4", "push_st_async", "push_bulk"};

__host__ __device__ inline float pattern(int cluster, int rank, int i) {
  return float((i * 7 + rank * 131 + cluster * 17) % 1021) * 0.25f;
}

#ifdef QERL_WGMMA_DEVICE
__device__ __forceinline__ void st_async_v4(uint32_t remote, float4 v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n"
               ::"r"(remote), "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
               "r"(__float_as_uint(v.w)), "r"(remote_bar)
               : "memory");
}

__device__ __forceinline__ void bulk_to_cluster(uint32_t remote_dst, uint32_t local_src, uint32_t bytes,
                                                uint32_t remote_bar) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(remote_dst), "r"(local_src), "r"(bytes), "r"(remote_bar)
               : "memory");
}
#endif

// smem: [own: s shares of `slice` floats][recv: (s - 1) shares][mbarrier]
__global__ void __launch_bounds__(kThreads, 1) probe(int mode, int reps, int slice, float* sink, int* bad) {
#ifdef QERL_WGMMA_DEVICE
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x;
  const int s = qerl::cluster_nctarank();
  const int rank = qerl::cluster_ctarank();
  const int cl = qerl::cluster_id_x();
  float* own = reinterpret_cast<float*>(smem);
  float* recv = own + size_t(s) * slice;
  const uint32_t own_addr = qerl::smem_u32(own);
  const uint32_t recv_addr = qerl::smem_u32(recv);
  const uint32_t bar = qerl::smem_u32(recv + size_t(s - 1) * slice);
  for (int i = tid; i < s * slice; i += kThreads) own[i] = pattern(cl, rank, i);
  if (tid == 0) {
    qerl::tma::mbar_init(bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // own[] is read by the copy engine (bulk mode)
  qerl::cluster_sync();
  float acc = 0.0f;
  int wrong = 0;
  const uint32_t share_bytes = uint32_t(slice) * 4u;
  for (int r = 0; r < reps; ++r) {
    if (mode == kPull) {
      // rank's share of every other CTA's partial (floats [rank * slice, (rank + 1) * slice) of CTA q), loaded as
      // cluster_splitk::reduce_store loads its sums: kBatch vectors x every source in flight before any is used
      constexpr int kBatch = 4;
      uint32_t src[kMaxRanks];
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q) src[q] = qerl::mapa_cluster(own_addr, q < s ? q : 0) + uint32_t(rank) * share_bytes;
      const int nvec = slice / 4;
      for (int v0 = tid; v0 < nvec; v0 += kBatch * kThreads) {
        float4 x[kBatch][kMaxRanks];
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
#pragma unroll
          for (int q = 0; q < kMaxRanks; ++q) {
            const int v = v0 + b * kThreads;
            if (q < s && q != rank && v < nvec)  // (only real loads: the rate counts exactly the bytes moved)
              asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                           : "=f"(x[b][q].x), "=f"(x[b][q].y), "=f"(x[b][q].z), "=f"(x[b][q].w)
                           : "r"(src[q] + uint32_t(v) * 16u)
                           : "memory");
          }
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
#pragma unroll
          for (int q = 0; q < kMaxRanks; ++q) {
            const int v = v0 + b * kThreads;
            if (!(q < s && q != rank && v < nvec)) continue;
            acc += x[b][q].x + x[b][q].y + x[b][q].z + x[b][q].w;
            if (r == 0) {
              const int i = rank * slice + 4 * v;
              wrong += (x[b][q].x != pattern(cl, q, i)) + (x[b][q].y != pattern(cl, q, i + 1)) +
                       (x[b][q].z != pattern(cl, q, i + 2)) + (x[b][q].w != pattern(cl, q, i + 3));
            }
          }
      }
    } else if (mode == kPushStAsync || mode == kPushBulk) {
      // every other rank q gets share q of this CTA's partial, in its receive slot (rank < q ? rank : rank - 1)
      if (tid == 0) qerl::tma::mbar_expect_tx(bar, uint32_t(s - 1) * share_bytes);
      for (int q = 0; q < s; ++q) {
        if (q == rank) continue;
        const int slot = rank < q ? rank : rank - 1;
        const uint32_t dst = qerl::mapa_cluster(recv_addr, q) + uint32_t(slot) * share_bytes;
        const uint32_t qbar = qerl::mapa_cluster(bar, q);
        if (mode == kPushBulk) {
          if (tid == 0) bulk_to_cluster(dst, own_addr + uint32_t(q) * share_bytes, share_bytes, qbar);
        } else {
          const float4* src = reinterpret_cast<const float4*>(own + size_t(q) * slice);
          for (int v = tid; v < slice / 4; v += kThreads) st_async_v4(dst + uint32_t(v) * 16u, src[v], qbar);
        }
      }
      qerl::tma::mbar_wait(bar, uint32_t(r & 1));  // this CTA's (s - 1) shares have landed
    }
    qerl::cluster_sync();  // a round ends on every rank before the next one's bytes can arrive
  }
  if (mode == kPushStAsync || mode == kPushBulk) {
    for (int q = 0; q < s; ++q) {
      if (q == rank) continue;
      const int slot = q < rank ? q : q - 1;  // what q sent us sits in slot (q < rank ? q : q - 1)
      for (int i = tid; i < slice; i += kThreads) wrong += recv[size_t(slot) * slice + i] != pattern(cl, q, rank * slice + i);
    }
  }
  if (wrong) atomicAdd(bad, wrong);
  if (acc == 12345.678f) sink[blockIdx.x] = acc;  // keeps the loads
#else
  __trap();
#endif
}

#define CK(x)                                                                           \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 200;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("# device\t%s\tSMs\t%d\n", prop.name, prop.multiProcessorCount);
  printf("mode\tcluster\tclusters\tctas\tshare_bytes\trounds\tus_per_round\tGBps_per_sm\tTBps_total\tbad\n");
  float* sink;
  int* bad;
  CK(cudaMalloc(&sink, 4096 * sizeof(float)));
  CK(cudaMalloc(&bad, sizeof(int)));
  cudaEvent_t t0, t1;
  CK(cudaEventCreate(&t0));
  CK(cudaEventCreate(&t1));
  for (const int s : {2, 3, 4, 8}) {
    const int slice = kTileBytes / 4 / s / 64 * 64;  // floats per share (a multiple of 64: 16-byte aligned vectors)
    const size_t smem = size_t(s) * slice * 4 + size_t(s - 1) * slice * 4 + 16;
    CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = unsigned(s);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    cfg.gridDim = dim3(unsigned(s));
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, probe, &cfg) != cudaSuccess || clusters <= 0) {
      (void)cudaGetLastError();
      printf("# cluster size %d: no cluster of it fits this device, skipped\n", s);
      continue;
    }
    cfg.gridDim = dim3(unsigned(s * clusters));  // every resident cluster at once: the whole GPU moving bytes
    for (int mode = kBarrierOnly; mode <= kPushBulk; ++mode) {
      CK(cudaMemset(bad, 0, sizeof(int)));
      CK(cudaLaunchKernelEx(&cfg, probe, mode, 2, slice, sink, bad));  // warm-up
      CK(cudaDeviceSynchronize());
      CK(cudaEventRecord(t0));
      CK(cudaLaunchKernelEx(&cfg, probe, mode, reps, slice, sink, bad));
      CK(cudaEventRecord(t1));
      CK(cudaEventSynchronize(t1));
      float ms = 0.f;
      CK(cudaEventElapsedTime(&ms, t0, t1));
      int nbad = 0;
      CK(cudaMemcpy(&nbad, bad, sizeof(int), cudaMemcpyDeviceToHost));
      const double us = 1e3 * ms / reps;
      const double bytes_per_cta = mode == kBarrierOnly ? 0.0 : double(s - 1) * slice * 4;
      const double gbps = us > 0 ? bytes_per_cta / (us * 1e-6) / 1e9 : 0.0;
      printf("%s\t%d\t%d\t%d\t%d\t%d\t%.3f\t%.1f\t%.3f\t%d\n", kModeNames[mode], s, clusters, s * clusters,
             slice * 4, reps, us, gbps, gbps * s * clusters / 1e3, nbad);
    }
  }
  return 0;
}
