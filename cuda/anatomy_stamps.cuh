// Per-CTA phase stamps of the register-A wgmma kernels (cuda/nvfp4_gemm_wgmma.cu, cuda/nvfp4_gemm_wgmma_wide.cu), for
// benchmarks/kernel_anatomy.py --stamps. Why: the few-tile GEMMs (7B qkv / o at M = 64-256, down at 256) spend 10-20
// us per call outside their MMAs (tensor pipe 33 % busy against cuBLAS's 50-59 % on the same GEMM), and only a
// timeline per CTA says whether that is the launch, the first copies, the stage loop's waits or the segment ends.
// Compiled in only with -DQERL_ANATOMY_STAMPS (the JIT build's QERL_ANATOMY_STAMPS=1, under its own extension name):
// without it every macro below is empty and the kernels' code is the measured one.
//   Thread 0 keeps its phase times in shared memory (no registers across the stage loop: the 255-register kernels
// would spill) and writes one row per CTA at the end: g_stamps[blockIdx.x] = {globaltimer at entry, at exit, SM
// cycles entry -> exit, cycles to the first stage's data, cycles in stage loops, of which waiting for data, cycles
// in segment ends (partials, fix-up, cluster sums, store), segments, SM id, five points inside the ends}.
#pragma once

#ifdef QERL_ANATOMY_STAMPS
#include <stdint.h>

namespace qerl {
namespace anatomy {

constexpr int kMaxCtas = 2048;
constexpr int kFields = 14;
// kSub0..4: cycles from a segment end's start to points inside it, summed over segments (cluster sums: the local
// writes, the first cluster barrier, the distributed reads; stream-K: the partial's store, the arrival, the fix-up
// sums; the staged bf16 store: its shared-memory writes, its global stores)
enum Field {
  kEntryNs, kExitNs, kCycles, kFirstData, kLoop, kLoopWait, kEnds, kSegments, kSm, kSub0, kSub1, kSub2, kSub3, kSub4
};
// shared-memory scratch of thread 0: the fields above while running, plus three marks
enum Mark { kEntryClock = kFields, kMark, kSeen, kScratch };

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned long long cycles() { return static_cast<unsigned long long>(clock64()); }

}  // namespace anatomy
}  // namespace qerl

// One table per translation unit (no relocatable device code: each kernel file has its own and a host reader), and
// thread 0's scratch, at file scope so that the segment-end helpers (cuda/cluster_splitk.cuh,
// cuda/wgmma_rs_epilogue.cuh) can mark their steps too.
namespace {
__device__ unsigned long long g_qerl_stamps[qerl::anatomy::kMaxCtas][qerl::anatomy::kFields];
__shared__ unsigned long long qerl_an[qerl::anatomy::kScratch + 1];
}  // namespace

#define QERL_ANATOMY_TABLE(reader)                                                                              \
  extern "C" cudaError_t reader(unsigned long long* host, int ctas, int reset) {                                \
    const size_t bytes = size_t(ctas) * qerl::anatomy::kFields * sizeof(unsigned long long);                    \
    if (ctas <= 0 || ctas > qerl::anatomy::kMaxCtas) return cudaErrorInvalidValue;                              \
    if (reset) {                                                                                                \
      static unsigned long long zeros[qerl::anatomy::kMaxCtas][qerl::anatomy::kFields];                        \
      return cudaMemcpyToSymbol(g_qerl_stamps, zeros, sizeof(zeros));                                          \
    }                                                                                                           \
    return cudaMemcpyFromSymbol(host, g_qerl_stamps, bytes);                                                   \
  }

#define QERL_AN_T0 if (threadIdx.x == 0)
#define QERL_AN_ENTRY                                                                                           \
  QERL_AN_T0 {                                                                                                  \
    for (int f = 0; f <= qerl::anatomy::kScratch; ++f) qerl_an[f] = 0;                                          \
    qerl_an[qerl::anatomy::kEntryNs] = qerl::anatomy::global_ns();                                              \
    qerl_an[qerl::anatomy::kEntryClock] = qerl::anatomy::cycles();                                              \
  }
#define QERL_AN_SEGMENT_BEGIN QERL_AN_T0 qerl_an[qerl::anatomy::kMark] = qerl::anatomy::cycles();
#define QERL_AN_WAIT_BEGIN QERL_AN_T0 qerl_an[qerl::anatomy::kScratch] = qerl::anatomy::cycles();
#define QERL_AN_WAIT_END                                                                                        \
  QERL_AN_T0 {                                                                                                  \
    const unsigned long long t = qerl::anatomy::cycles();                                                       \
    qerl_an[qerl::anatomy::kLoopWait] += t - qerl_an[qerl::anatomy::kScratch];                                  \
    if (!qerl_an[qerl::anatomy::kSeen]) {                                                                       \
      qerl_an[qerl::anatomy::kFirstData] = t - qerl_an[qerl::anatomy::kEntryClock];                             \
      qerl_an[qerl::anatomy::kSeen] = 1;                                                                        \
    }                                                                                                           \
  }
#define QERL_AN_LOOP_END                                                                                        \
  QERL_AN_T0 {                                                                                                  \
    const unsigned long long t = qerl::anatomy::cycles();                                                       \
    qerl_an[qerl::anatomy::kLoop] += t - qerl_an[qerl::anatomy::kMark];                                         \
    qerl_an[qerl::anatomy::kMark] = t;                                                                          \
  }
#define QERL_AN_SUB(i) \
  QERL_AN_T0 qerl_an[qerl::anatomy::kSub0 + (i)] += qerl::anatomy::cycles() - qerl_an[qerl::anatomy::kMark];
#define QERL_AN_SEGMENT_END                                                                                     \
  QERL_AN_T0 {                                                                                                  \
    qerl_an[qerl::anatomy::kEnds] += qerl::anatomy::cycles() - qerl_an[qerl::anatomy::kMark];                   \
    qerl_an[qerl::anatomy::kSegments] += 1;                                                                     \
  }
#define QERL_AN_EXIT                                                                                            \
  QERL_AN_T0 {                                                                                                  \
    unsigned int sm;                                                                                            \
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));                                                             \
    qerl_an[qerl::anatomy::kCycles] = qerl::anatomy::cycles() - qerl_an[qerl::anatomy::kEntryClock];            \
    qerl_an[qerl::anatomy::kExitNs] = qerl::anatomy::global_ns();                                               \
    qerl_an[qerl::anatomy::kSm] = sm;                                                                           \
    if (blockIdx.x < qerl::anatomy::kMaxCtas)                                                                   \
      for (int f = 0; f < qerl::anatomy::kFields; ++f) g_qerl_stamps[blockIdx.x][f] = qerl_an[f];              \
  }
#else
#define QERL_ANATOMY_TABLE(reader)
#define QERL_AN_ENTRY
#define QERL_AN_SEGMENT_BEGIN
#define QERL_AN_WAIT_BEGIN
#define QERL_AN_WAIT_END
#define QERL_AN_LOOP_END
#define QERL_AN_SUB(i)
#define QERL_AN_SEGMENT_END
#define QERL_AN_EXIT
#endif
