// Persistent stream-K over 256-row output tiles: the one definition of the work split, the launch shape, the
// partial-tile workspace and the deterministic fix-up shared by the stream-K mma.sync kernel
// (nvfp4_gemm_streamk.cu) and both Hopper wgmma kernels (nvfp4_gemm_wgmma.cu, nvfp4_gemm_wgmma_ss.cu).
//
// The split: a GEMM's output tiles (kTileRows weight rows x block_m tokens) times the K stages of a tile (kStageK
// each) are the `units`; they are cut into equal contiguous ranges of units_per_cta, one per CTA, so that every SM
// gets the same number of stages whatever the tile count (no partial last wave). A CTA walks the tile segments of
// its range. A segment that is a whole tile stores its output directly; a partial one writes FP32 partials to
// workspace slot (CTA, 0 = the first tile of its range / 1 = its last tile): a range is contiguous, so only its
// first and last tiles can be partial, and the workspace is 2 x CTAs x block_m x kTileRows floats. The last segment
// of a tile to arrive (atomic counter, re-zeroed by it) sums every partial of the tile in CTA order -- the same
// order whichever CTA arrives last, so the results are bit-identical run to run -- and runs the epilogue.
// (The register-A wgmma kernels count arrivals first instead, fix_up_arrive_first: where two CTAs share a tile the
// second adds the first's partial to its own sums and writes none.)
//
// What stays in each kernel: the order of the tiles (m-major or n-major), the pipeline, the register layout of the
// accumulators (so where in a slot each thread's partials go) and the epilogue.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "anatomy_stamps.cuh"
#include "nvfp4_common.cuh"
#include "qerl_nvfp4.h"

namespace qerl {
namespace streamk {

constexpr int kTileRows = 2 * QERL_GEMM_BN;  // weight rows per output tile: two 128-row tiles of the repacked layout
constexpr int kStageK = QERL_GEMM_BK;         // K per unit of work (one pipeline stage of one tile)

// ---- host: the schedule (asked by the launch and by the workspace size: one answer for both)

struct Schedule {
  int units = 0;          // output tiles x K stages per tile
  int units_per_cta = 0;  // every CTA's range length (the last range may be shorter)
  int ctas = 0;           // CTAs with a non-empty range: the launch's grid
};

// Equal contiguous ranges over at most `grid` CTAs, each at least min(stages per tile, min_units_per_cta) units long
// (1: plain stream-K; more keeps a small GEMM from being cut into slivers whose pipeline fill and fix-up dominate).
// No schedule (ctas = 0) for an empty or oversized problem (more than 2^30 units).
// tile_rows: weight rows per output tile (kTileRows, or 128 for the wide-token wgmma kernel, whose tile is one
// 128-row tile of the repacked layout x 256 tokens).
inline Schedule make_schedule(int M, int N, int K, int grid, int block_m, int min_units_per_cta = 1,
                              int tile_rows = kTileRows) {
  Schedule s;
  const long long stages = K / kStageK;
  const long long units =
      (long long)((N + tile_rows - 1) / tile_rows) * ((M + block_m - 1) / block_m) * stages;
  if (units <= 0 || grid <= 0 || units > (1LL << 30)) return s;
  s.units = int(units);
  const long long floor_units = stages < min_units_per_cta ? stages : min_units_per_cta;
  long long per = (units + grid - 1) / grid;
  if (per < floor_units) per = floor_units;
  s.units_per_cta = int(per);
  s.ctas = int((units + per - 1) / per);
  return s;
}

// Output tiles (tile_rows weight rows x block_m tokens): also the number of counters a launch uses.
inline int output_tiles(int M, int N, int block_m, int tile_rows = kTileRows) {
  return ((N + tile_rows - 1) / tile_rows) * ((M + block_m - 1) / block_m);
}

// Floats of partial-tile workspace one launch needs: 2 slots per CTA, 0 when every range starts and ends on a tile
// boundary (all segments are whole tiles, nothing is written).
inline size_t workspace_floats(int M, int N, int K, int grid, int block_m, int min_units_per_cta = 1,
                               int tile_rows = kTileRows) {
  const Schedule s = make_schedule(M, N, K, grid, block_m, min_units_per_cta, tile_rows);
  if (s.ctas <= 0) return 0;
  if (s.units_per_cta % (K / kStageK) == 0) return 0;
  return size_t(2) * size_t(s.ctas) * size_t(block_m) * size_t(tile_rows);
}

// The argument checks of every stream-K launcher (qerl_nvfp4.h's contract): shapes the kernels handle, counters,
// and a workspace wherever the schedule writes partials (`workspace_needed` floats of it).
inline cudaError_t check_launch_args(int M, int N, int K, int grid, const int* counters, const float* workspace,
                                     size_t workspace_needed) {
  if (M <= 0 || N <= 0 || K <= 0 || K % kStageK != 0 || N % 16 != 0 || grid < 1) return cudaErrorInvalidValue;
  if (counters == nullptr) return cudaErrorInvalidValue;
  if (workspace_needed > 0 && workspace == nullptr) return cudaErrorInvalidValue;
  return cudaSuccess;
}

// ---- host: one kernel's launch (every stream-K kernel takes the same arguments)

using KernelFn = void (*)(const __nv_bfloat16*, const uint4*, const uint4*, const float*, const __nv_bfloat16*,
                          __nv_bfloat16*, float*, int*, int, int, int, int);

// Where a kernel's device code exists: every architecture the file is built for, or sm_90a only (the wgmma kernels:
// their host side knows it from QERL_HAVE_SM90A, which the build sets next to -gencode arch=compute_90a).
enum class Target { kAnyArch, kSm90aOnly };

#ifdef QERL_HAVE_SM90A
constexpr bool kBuiltForSm90a = true;
#else
constexpr bool kBuiltForSm90a = false;
#endif

// kKernel launched with kThreads threads and kSmemBytes of dynamic shared memory per CTA, one block size
// (block_m tokens per tile, kTileRows_ weight rows), ranges of at least kMinUnitsPerCta units (see make_schedule).
template <KernelFn kKernel, int kBlockM_, int kThreads, int kSmemBytes, Target kTarget, int kMinUnitsPerCta_ = 1,
          int kTileRows_ = kTileRows>
struct Launcher {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kMinUnitsPerCta = kMinUnitsPerCta_;
  static constexpr int kRows = kTileRows_;

  // Raises the kernel's dynamic shared memory limit on the current device, once per device.
  // cudaErrorNotSupported where the kernel cannot run: not built for it, or the device grants too little shared
  // memory per CTA (e.g. sm_89's 99 KB; callers then run another kernel).
  static cudaError_t prepare() {
    if (kTarget == Target::kSm90aOnly && !kBuiltForSm90a) return cudaErrorNotSupported;
    static bool done[64] = {};  // per device; benign race: the attribute calls are idempotent
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    if (dev < 0 || dev >= 64 || !done[dev]) {
      int optin = 0;
      if constexpr (kTarget == Target::kSm90aOnly) {
        int major = 0, minor = 0;
        if ((e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev)) != cudaSuccess) return e;
        if ((e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev)) != cudaSuccess) return e;
        if (major != 9 || minor != 0) return cudaErrorNotSupported;  // sm_90a code runs on sm_90 only
      }
      if ((e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess) return e;
      if (optin < kSmemBytes) return cudaErrorNotSupported;
      e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
      if (e != cudaSuccess) return e;
      if (dev >= 0 && dev < 64) done[dev] = true;
    }
    return cudaSuccess;
  }

  // One launch over the CTAs with a non-empty range (grid = CTAs requested).
  static cudaError_t launch(const void* x, const void* qweight, const void* qscale, const float* gscale,
                            const void* bias, void* out, float* ws, int* counters, int M, int N, int K, int grid,
                            cudaStream_t stream) {
    cudaError_t e = prepare();
    if (e != cudaSuccess) return e;
    const Schedule s = make_schedule(M, N, K, grid, kBlockM, kMinUnitsPerCta, kRows);
    if (s.ctas <= 0) return cudaErrorInvalidValue;
    kKernel<<<s.ctas, kThreads, kSmemBytes, stream>>>(
        static_cast<const __nv_bfloat16*>(x), static_cast<const uint4*>(qweight), static_cast<const uint4*>(qscale),
        gscale, static_cast<const __nv_bfloat16*>(bias), static_cast<__nv_bfloat16*>(out), ws, counters, M, N, K,
        s.units_per_cta);
    return cudaGetLastError();
  }

  // Resident CTAs per SM (0 where the kernel cannot run on the current device).
  static int ctas_per_sm() {
    if (prepare() != cudaSuccess) return 0;
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, kThreads, kSmemBytes) != cudaSuccess) return 0;
    return n;
  }
};

// The C entry points of one kernel (qerl_nvfp4.h: launch, workspace floats, tiles, CTAs per SM) over its two block
// sizes, Small and Large (Launchers of the same kernel template): one schedule answers the launch and the workspace.
template <class Small, class Large>
struct EntryPoints {
  static_assert(Small::kMinUnitsPerCta == Large::kMinUnitsPerCta, "one schedule rule per kernel");

  static bool has_block(int block_m) { return block_m == Small::kBlockM || block_m == Large::kBlockM; }

  static size_t workspace_floats(int M, int N, int K, int grid, int block_m) {
    if (!has_block(block_m)) return 0;
    return streamk::workspace_floats(M, N, K, grid, block_m, Small::kMinUnitsPerCta);
  }

  static int tiles(int M, int N, int block_m) { return has_block(block_m) ? output_tiles(M, N, block_m) : 0; }

  static int ctas_per_sm(int block_m) {
    if (block_m == Small::kBlockM) return Small::ctas_per_sm();
    if (block_m == Large::kBlockM) return Large::ctas_per_sm();
    return 0;
  }

  static cudaError_t launch(const void* x, const void* qweight, const void* qscale, const float* gscale,
                            const void* bias, void* out, float* ws, int* counters, int M, int N, int K, int grid,
                            int block_m, cudaStream_t stream) {
    const cudaError_t e =
        check_launch_args(M, N, K, grid, counters, ws, workspace_floats(M, N, K, grid, block_m));
    if (e != cudaSuccess) return e;
    if (block_m == Small::kBlockM)
      return Small::launch(x, qweight, qscale, gscale, bias, out, ws, counters, M, N, K, grid, stream);
    if (block_m == Large::kBlockM)
      return Large::launch(x, qweight, qscale, gscale, bias, out, ws, counters, M, N, K, grid, stream);
    return cudaErrorInvalidValue;
  }
};

// ---- device: one CTA's view of the schedule

// A tile's stages [kb, ke) within the current CTA's range.
struct Segment {
  int tile;  // output tile, in the kernel's tile order
  int kb;    // first K stage
  int ke;    // one past the last K stage
  __device__ __forceinline__ int count() const { return ke - kb; }
};

// This CTA's range [begin, end) of units (the launch's units_per_cta each, in blockIdx.x order), the segments in it,
// and who shares a tile: CTAs first_cta(tile) .. last_cta(tile), one only where the segment is the whole tile.
struct CtaRange {
  int stages;         // K stages per tile
  int units_per_cta;  // the launch's range length
  int begin;
  int end;

  // units: the launch's tiles x stages_per_tile
  __device__ __forceinline__ CtaRange(int units, int stages_per_tile, int units_per_cta_)
      : stages(stages_per_tile), units_per_cta(units_per_cta_), begin(blockIdx.x * units_per_cta_),
        end(min(begin + units_per_cta_, units)) {}

  // The segment holding unit u; the next one starts at after(segment).
  __device__ __forceinline__ Segment segment_at(int u) const {
    const int tile = u / stages;
    return {tile, u - tile * stages, min(stages, end - tile * stages)};
  }
  __device__ __forceinline__ int after(const Segment& s) const { return s.tile * stages + s.ke; }

  // K-aligned order (kernels whose activations can outgrow L2): a range that starts inside a tile and runs on into
  // the next runs that first tile's tail last. Every CTA then meets stage k of its tiles at the same time (its first
  // whole tile or head starts at k = 0), up to one shift of (-units_per_cta mod stages) for the tails, so the CTAs
  // that read one activation slice read it together, not ~stages / tiles-per-token-tile stages apart (a 39 MB
  // activation set then streams from DRAM once or twice instead of once per N tile: NOTES "Eighteenth round").
  // The partial slots, the fix-up and its sum order depend on the tile, not on when a segment runs.
  //   for (int u = range.aligned_begin(); u >= 0; u = range.aligned_next(u_after)) { seg = segment_at(u); ... }
  __device__ __forceinline__ int aligned_begin() const {
    if (begin >= end) return -1;  // (no launch makes an empty range; kept safe)
    const int next_tile = (begin / stages + 1) * stages;
    return begin % stages != 0 && next_tile < end ? next_tile : begin;
  }
  // The unit after a segment that ended at `u_after` (after(segment)) in the aligned order; -1: the range is done.
  __device__ __forceinline__ int aligned_next(int u_after) const {
    const int first = aligned_begin();
    if (u_after == end) return first != begin ? begin : -1;  // the postponed tail, or done
    return u_after == first ? -1 : u_after;                   // the postponed tail ended where the rest began
  }
  // The first unit / the unit after a segment ending at `u_after`, in the aligned order or in unit order; -1: done.
  __device__ __forceinline__ int first_unit(bool k_aligned) const {
    return k_aligned ? aligned_begin() : (begin < end ? begin : -1);
  }
  __device__ __forceinline__ int next_unit(int u_after, bool k_aligned) const {
    return k_aligned ? aligned_next(u_after) : (u_after < end ? u_after : -1);
  }

  __device__ __forceinline__ int first_cta(int tile) const { return (tile * stages) / units_per_cta; }
  __device__ __forceinline__ int last_cta(int tile) const { return (tile * stages + stages - 1) / units_per_cta; }
  // The tile of unit `begin`: the only tile whose partial goes to slot 0 of this CTA.
  __device__ __forceinline__ int first_tile() const { return begin / stages; }
  // Workspace slot of `tile`'s partial: 0 where the tile is the first of the writing CTA's range, else 1. As this CTA
  // sees it (my_slot; given first_tile() where the kernel computed it once up front, else computed here: the
  // register-tight wgmma SS kernel keeps nothing live across its main loop), and for any CTA of the tile (slot_of:
  // the fix-up reading every partial back).
  __device__ __forceinline__ int my_slot(int tile, int first) const { return tile == first ? 0 : 1; }
  __device__ __forceinline__ int my_slot(int tile) const { return my_slot(tile, first_tile()); }
  __device__ __forceinline__ int slot_of(int tile, int cta) const {
    return tile == (cta * units_per_cta) / stages ? 0 : 1;
  }
};

// Start of CTA `cta`'s partial slot `slot` (kSlotFloats = block_m x kTileRows floats each) as float4; the offset is
// formed in size_t, never in 32-bit int.
template <int kSlotFloats>
__device__ __forceinline__ float4* partial_slot(float* ws, size_t cta, int slot) {
  return reinterpret_cast<float4*>(ws + (cta * 2 + slot) * kSlotFloats);
}

// Calls add(part) with the start of every partial slot of `tile`, CTA first .. last in that order: the order of the
// fix-up's sum is fixed whichever CTA arrives last (bit-identical results run to run).
template <int kSlotFloats, class Add>
__device__ __forceinline__ void for_each_partial(const CtaRange& range, float* ws, int tile, int first, int last,
                                                 Add&& add) {
#pragma unroll 1
  for (int c = first; c <= last; ++c) add(partial_slot<kSlotFloats>(ws, c, range.slot_of(tile, c)));
}

// The fix-up of a segment that is not a whole tile, run by the threads that hold the tile's accumulators:
// store_mine() writes this CTA's partials, then its arrival is counted (`sync` is the barrier over those threads,
// `leader` one of them, `flag` a __shared__ int). The last CTA to arrive runs sum_all() -- which reads every partial
// of the tile back through for_each_partial -- re-zeroes the tile's counter and returns true: it stores the tile.
// Every other CTA returns false.
template <class Sync, class StoreMine, class SumAll>
__device__ __forceinline__ bool fix_up_split_tile(int* counters, int tile, int first, int last, bool leader,
                                                  int& flag, Sync&& sync, StoreMine&& store_mine, SumAll&& sum_all) {
  store_mine();
  QERL_AN_SUB(0)
  const bool last_arrival = arrive_last(counters, tile, last - first + 1, leader, flag, sync);
  QERL_AN_SUB(1)
  if (last_arrival) {  // arrive_last acquired the other CTAs' partials
    sum_all();
    QERL_AN_SUB(2)
    if (leader) counters[tile] = 0;  // every segment has arrived: ready for the next launch
  }
  return last_arrival;
}

// The fix-up of a split tile counted at arrival (the register-A wgmma kernels' finish_tile): a segment that does not
// arrive last writes its partials (store_mine) and publishes them; the last to arrive waits until the `n - 1` others
// have published, then sum_parts() makes its sums and it returns true (it stores the tile). The sums follow one fixed
// order of the n segments (the caller's; `pos` is this CTA's place in it, 0-based), so the result does not depend on
// who arrives last: where the last is first or second in the order it writes nothing and sum_parts adds the others'
// partials, in order, to its own accumulators (p0 + p1 and p1 + p0 are the same bits); further back it writes its own
// partial too and sum_parts adds all n from zero in the order. Against fix_up_split_tile a two-segment tile's end
// moves one partial instead of three, and the first segment's write is off the critical path where it ends early
// (NOTES "Twentieth round"). The last arrival waits only for CTAs that have
// arrived, so are running and publish without waiting on anything: never for a CTA that may not have started.
// Counter: +1 per arrival (low 16 bits), +2^16 per published partial; the last re-zeroes it (n <= K / 128 stays far
// below 2^15 for any real layer). `sync`, `leader`, `flag`
// as in fix_up_split_tile; the caller's barrier after the tile's end protects `flag` from the next segment.
template <class Sync, class StoreMine, class SumParts>
__device__ __forceinline__ bool fix_up_arrive_first(int* counters, int tile, int n, int pos, bool leader, int& flag,
                                                    Sync&& sync, StoreMine&& store_mine, SumParts&& sum_parts) {
  if (leader) {
    int prev;
    asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], 1;" : "=r"(prev) : "l"(counters + tile) : "memory");
    flag = (prev & 0xFFFF) == n - 1;
  }
  sync();
  const bool last = flag != 0;
  if (!last || pos >= 2) store_mine();
  QERL_AN_SUB(0)
  if (!last) {
    sync();  // every thread's partials are written before the leader publishes them
    if (leader) asm volatile("red.release.gpu.global.add.s32 [%0], 65536;" ::"l"(counters + tile) : "memory");
    return false;
  }
  if (leader) {
    const int done = ((n - 1) << 16) | n;
    int v;
    do {
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(counters + tile) : "memory");
    } while (v != done);
  }
  sync();  // the partials the leader acquired (and this CTA's own, n > 2) are visible to every thread (read via L2)
  QERL_AN_SUB(1)
  sum_parts();
  QERL_AN_SUB(2)
  if (leader) counters[tile] = 0;  // every segment has arrived: ready for the next launch
  return true;
}

// The end of a segment, for the threads that hold the tile's accumulators: where this CTA's segment is the whole
// tile there is nothing to combine and it stores the tile (true); otherwise fix_up_split_tile with the CTAs sharing
// the tile, first_cta(tile) .. last_cta(tile), passed to sum_all(first, last) for its for_each_partial. Returns
// whether this CTA stores the tile.
template <class Sync, class StoreMine, class SumAll>
__device__ __forceinline__ bool finish_segment(const CtaRange& range, int* counters, int tile, bool leader, int& flag,
                                               Sync&& sync, StoreMine&& store_mine, SumAll&& sum_all) {
  const int first = range.first_cta(tile);
  const int last = range.last_cta(tile);
  bool stores = true;
  if (first != last)
    stores = fix_up_split_tile(counters, tile, first, last, leader, flag, sync, store_mine,
                               [&] { sum_all(first, last); });
  return stores;
}

}  // namespace streamk
}  // namespace qerl
