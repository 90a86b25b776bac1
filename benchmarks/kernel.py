"""NVFP4 kernel benchmark on the GPU machine: BF16 cuBLAS vs bitsandbytes NF4 vs ours, per decoder layer.

For Qwen2.5-7B and -32B decoder-layer GEMMs (qkv, o, gate_up, down) and M in
{1, 4, 16, 64, 256, 1024, 4096} (``--models all`` adds 1.5B / 3B / 14B shapes that calibrate the stream-K
rule), times in one run:

* ``bf16``   -- ``F.linear`` on a BF16 weight (cuBLAS);
* ``nf4``    -- ``bitsandbytes.matmul_4bit`` (QLoRA's NF4, blocksize 64), if bitsandbytes imports;
* ``ours``   -- ``qerl::nvfp4_gemm`` through its dispatch (the production path: the calibration table or by M,
  then split-K or stream-K by shape; each row's ``ours_runs`` names what ran);
* ``kernel_splitk`` / ``dequant_cublas`` -- the two paths forced (the split-K fused GEMM; dequantize + cuBLAS), to
  tune the dispatch threshold;
* ``kernel_streamk`` -- with ``--variants splitk,streamk``: the stream-K fused kernel (which the dispatch picks by
  shape) forced, where it applies (M >= 17), next to ``kernel_splitk``, with the per-GEMM and per-layer ratio
  ``streamk/splitk`` = split-K time / stream-K time (> 1: stream-K faster);
* ``kernel_wgmma_rs`` / ``kernel_wgmma_ss`` -- with ``--variants splitk,streamk,wgmma_rs,wgmma_ss``: the Hopper
  wgmma kernels (cuda/nvfp4_gemm_wgmma.cu, cuda/nvfp4_gemm_wgmma_ss.cu) forced at every M <= 1024 on sm_90;
  the run also writes ``gemm_dispatch-<gpu>.json``, the fastest
  measured kernel per GEMM shape and M, which auto mode reads as its calibration (verl_qerl/kernels/dispatch.py;
  copy it to verl_qerl/kernels/gemm_dispatch_h200.json to ship it);
* ``marlin`` -- vLLM's own Marlin FP4 GEMM (W4A16, ``torch.ops._C.marlin_gemm`` with the
  ``float4_e2m1f`` type), through vLLM's public helpers ``prepare_fp4_layer_for_marlin`` and
  ``apply_fp4_marlin_linear`` (``vllm/model_executor/layers/quantization/utils/marlin_utils_fp4.py``,
  the calls vLLM's ``MarlinNvFp4LinearKernel`` makes), fed the same NVFP4 weights as ``ours`` and
  checked against the float64 reference before it is timed. Skipped, with the reason in the JSON
  (``"marlin": {"skipped": ...}``), where vLLM, its compiled ``_C`` ops or the helpers do not import
  or the GPU's capability is below Marlin FP4's.

Timing follows shared/bench/anchors.py (rotating ROT weight sets so L2 does not serve the weight,
CUDA-event medians) in two modes: ``eager`` (events around one call, launch overhead included, as
the anchors) and ``graph`` (a CUDA graph of ROT calls replayed; per-call time = replay / ROT, which
is how vLLM runs decode steps). Targets are checked on the graph times; both are printed and saved.

Kernel names are by role (cuda/gemm_modes.h); ``--variants`` also takes the former ``v5`` / ``wgmma`` (with a
warning). Result files written before the names by role have ``kernel`` (split-K), ``dqmm``, ``kernel_wgmma`` and
``<v>/v5`` keys instead.

Writes ``benchmarks/results/kernel-<gpu>.json`` (``<gpu>`` from the device name: h100, h200, ...; into
``--out``/``$OUT`` when that is a folder) and prints the ratio table last.

    python benchmarks/kernel.py                 # full run
    python benchmarks/kernel.py --quick         # fewer shapes/iterations (smoke test)
    python benchmarks/kernel.py --sanitize      # tiny correctness run for compute-sanitizer
    python benchmarks/kernel.py --no-marlin     # without the vLLM Marlin column
    python benchmarks/kernel.py --variants splitk,streamk --models qwen2.5-7b --ms 16,64,128  # split-K vs stream-K
    python benchmarks/kernel.py --profile --variants splitk,streamk --profile-m 64  # both kernels, under ncu
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import importlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from results_format import target_met, target_status  # benchmarks/: this script's own folder

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from verl_qerl import kernels  # noqa: E402
from verl_qerl.kernels import dispatch, reference  # noqa: E402

DEV = "cuda"
MODELS = {
    "qwen2.5-7b": dict(h=3584, i=18944, q=3584, kv=512),
    "qwen2.5-32b": dict(h=5120, i=27648, q=5120, kv=1024),
    # calibration shapes for the auto stream-K rule (their gate_up tile counts fall between 7B's qkv and
    # gate_up); timed with --models, not part of the default table or its targets
    "qwen2.5-1.5b": dict(h=1536, i=8960, q=1536, kv=256),
    "qwen2.5-3b": dict(h=2048, i=11008, q=2048, kv=256),
    "qwen2.5-14b": dict(h=5120, i=13824, q=5120, kv=1024),
}
#: the issue's table (and the only models whose rows become targets)
DEFAULT_MODELS = ("qwen2.5-7b", "qwen2.5-32b")
MS = [1, 4, 16, 64, 128, 256, 1024, 4096]
ROT = 4
TARGETS = [  # (M predicate, target ratio vs bf16), issue 18's per-layer targets on the H200
    (lambda m: m <= 16, 2.5),
    (lambda m: m == 64, 2.0),
    (lambda m: m == 128, 1.5),
    (lambda m: m == 256, 1.0),
    (lambda m: m >= 1024, 0.95),
]
MARLIN_TARGET = 1.0  # ours per-layer speedup vs vLLM's Marlin FP4, every M (issue 3 stretch)
MARLIN_TOL = 1e-2  # relative norm error vs the float64 reference, checked before Marlin is timed
#: ``is_fp4_marlin_supported()``'s threshold in vLLM 0.24 (``has_device_capability(75)``); checked here
#: first so an old GPU is skipped before vLLM is imported, and vLLM's own check is asked as well.
MARLIN_MIN_CAPABILITY = (7, 5)
MARLIN_MODULE = "vllm.model_executor.layers.quantization.utils.marlin_utils_fp4"
MARLIN_FUNCS = ("prepare_fp4_layer_for_marlin", "apply_fp4_marlin_linear", "is_fp4_marlin_supported")
#: fused-kernel variant -> the ``qerl::nvfp4_gemm`` mode that forces it (cuda/gemm_modes.h)
VARIANT_KERNEL_MODES = kernels.GEMM_KERNEL_FORCED_MODES
#: the variant every other one is compared with (always timed, first)
BASELINE = "splitk"
#: benchmark-only variants: a kernel the op also runs, with its tile choice moved (variant -> the kernel it times).
#: ``wgmma_rs_t128``: the register-A wgmma kernel held at 128-token tiles where the op runs 256-token ones (M >= 129),
#: so both tile widths are timed side by side in one run.
TILE_VARIANTS = {"wgmma_rs_t128": "wgmma_rs"}
#: the M from which ``wgmma_rs_t128`` keeps the 128-token tiles (far above any benchmarked M)
NARROW_WIDE_MIN_M = 1 << 40


def parse_variants(text: str | None) -> list[str]:
    """``--variants`` ("splitk,streamk") -> ordered, de-duplicated variant names; split-K always first (the
    baseline the ratios divide by). Former names (v5, wgmma) are accepted with a warning; unknown names raise
    ValueError naming them and the known ones."""
    names = [kernels.canonical_kernel_name(v, "--variants") for v in (text or BASELINE).split(",") if v.strip()]
    known = set(VARIANT_KERNEL_MODES) | set(TILE_VARIANTS)
    bad = [v for v in names if v not in known]
    if bad:
        raise ValueError(f"--variants: unknown kernel variant(s) {bad}; known: {sorted(known)}")
    return [BASELINE] + [v for v in dict.fromkeys(names) if v != BASELINE]


def variant_applies(ext, variant: str, m: int, n: int, k: int) -> bool:  # noqa: ANN001 - the extension module
    """Whether timing ``variant`` at (M, N, K) measures anything but split-K again: the extension says which fused
    kernel the variant's forced mode runs on this device (stream-K: block_m 32 / 64 where the device grants its
    ring, split-K elsewhere); the fused kernels are not timed above M = 1024."""
    if variant == BASELINE:
        return True
    if variant in TILE_VARIANTS:  # only where the tile choice differs from the kernel's own variant
        kernel = TILE_VARIANTS[variant]
        return m >= 129 and variant_applies(ext, kernel, m, n, k)
    return m <= 1024 and ext.gemm_choice(m, n, k, int(VARIANT_KERNEL_MODES[variant])) == variant


def narrow_wgmma_tiles(ext, fn):  # noqa: ANN001, ANN201 - the extension module, a timed callable
    """``fn`` run with the register-A wgmma kernel held at 128-token tiles (the op reads the knob at each call,
    so a CUDA graph captured through this keeps them)."""
    def run(r):  # noqa: ANN001, ANN202
        prev = ext.set_wgmma_wide_min_m(NARROW_WIDE_MIN_M)
        try:
            return fn(r)
        finally:
            ext.set_wgmma_wide_min_m(prev)
    return run


def profile_modes(variants: list[str] | None, env_variant: str) -> list[tuple[str, int]]:
    """(variant, op mode) pairs ``--profile`` launches per shape: the ``--variants`` given (forced), else the one
    ``$QERL_GEMM_KERNEL`` selects (forced; ``auto``, the default: the op's own choice)."""
    names = variants if variants else [env_variant]
    tiles = [v for v in names if v in TILE_VARIANTS]
    if tiles:
        raise ValueError(f"--profile: {tiles} are timing-only variants; profile {sorted(set(TILE_VARIANTS.values()))} "
                         "and move its tile width with the extension's set_wgmma_wide_min_m")
    return [(v, int(VARIANT_KERNEL_MODES.get(v, kernels.GEMM_KERNEL_MODES[v]))) for v in names]


def add_variant_ratios(row: dict, variants: list[str]) -> dict:
    """``row["<v>/splitk"]`` = kernel_splitk_graph_ms / kernel_<v>_graph_ms (the variant's speedup over split-K,
    CUDA-graph timing; > 1 means the variant is faster), where both are present."""
    base = row.get(f"kernel_{BASELINE}_graph_ms")
    for v in variants:
        if v != BASELINE and base and row.get(f"kernel_{v}_graph_ms"):
            row[f"{v}/{BASELINE}"] = round(base / row[f"kernel_{v}_graph_ms"], 3)
    return row


def variant_lines(rows: list[dict], variants: list[str]) -> list[str]:
    """Printed comparison of the fused-kernel variants: per GEMM and per layer, graph ms and ratio to split-K."""
    others = [v for v in variants if v != BASELINE]
    if not others:
        return []
    head = f"{'model':12s} {'layer':8s} {'M':>5s} | {BASELINE + ' g':>8s}"
    for v in others:
        head += f" {v + ' g':>10s} {v + '/' + BASELINE:>15s}"
    lines = [f"# fused-kernel variants, CUDA graph ms; <v>/{BASELINE} = {BASELINE} / variant (> 1: variant faster)",
             head]
    for r in rows:
        if not any(r.get(f"kernel_{v}_graph_ms") for v in others):
            continue
        base = r.get(f"kernel_{BASELINE}_graph_ms")
        line = f"{r['model']:12s} {r['layer']:8s} {r['M']:5d} | " + (f"{base:8.4f}" if base else f"{'-':>8s}")
        for v in others:
            t, q = r.get(f"kernel_{v}_graph_ms"), r.get(f"{v}/{BASELINE}")
            line += (f" {t:10.4f}" if t else f" {'-':>10s}") + (f" {q:15.3f}" if q else f" {'-':>15s}")
        lines.append(line)
    return lines


MARLIN_OPS = ("marlin_gemm", "gptq_marlin_repack")


def parse_modes(text: str) -> set[str]:
    """``--sanitize-modes`` ("streamk,wgmma_ss") -> op mode names (cuda/gemm_modes.h); unknown names raise
    ValueError naming them and the known ones."""
    names = {v.strip().lower() for v in text.split(",") if v.strip()}
    bad = sorted(names - set(kernels.GEMM_MODES))
    if bad:
        raise ValueError(f"--sanitize-modes: unknown mode(s) {bad}; known: {sorted(kernels.GEMM_MODES)}")
    return names


def select_models(text: str | None) -> dict:
    """``--models`` -> the MODELS subset, in MODELS order (default: DEFAULT_MODELS; ``all``: every model);
    unknown names raise ValueError naming them."""
    if not text:
        return {k: v for k, v in MODELS.items() if k in DEFAULT_MODELS}
    if text.strip() == "all":
        return dict(MODELS)
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in MODELS]
    if bad:
        raise ValueError(f"--models: unknown model(s) {bad}; known: {sorted(MODELS)}")
    return {k: v for k, v in MODELS.items() if k in names}


def layer_shapes(c: dict[str, int]) -> list[tuple[str, int, int]]:
    h, i = c["h"], c["i"]
    return [("qkv", c["q"] + 2 * c["kv"], h), ("o", h, c["q"]), ("gate_up", 2 * i, h), ("down", h, i)]


def bench_eager(fn, iters: int = 30) -> float:
    """Median ms of one call between two events (anchors.py's method)."""
    for r in range(3):
        fn(r)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for r in range(iters):
        s.record()
        fn(r)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def bench_graph(fn, reps: int = 20) -> float | None:
    """Median ms per call of a CUDA graph holding ROT calls (one per weight set); None if uncapturable."""
    try:
        for r in range(ROT):
            fn(r)
        torch.cuda.synchronize()
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            for r in range(ROT):
                fn(r)
        torch.cuda.current_stream().wait_stream(st)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for r in range(ROT):
                fn(r)
        g.replay()
        torch.cuda.synchronize()
    except Exception as ex:  # noqa: BLE001
        print(f"#   graph capture failed: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
        torch.cuda.synchronize()
        return None
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / ROT)
    del g
    return statistics.median(times)


def ceilings() -> tuple[float, float]:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=DEV).normal_()
    y = torch.empty_like(x)
    t = bench_eager(lambda r: y.copy_(x), 20)
    bw = 2 * x.numel() * 2 / (t / 1e3) / 1e12
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    t2 = bench_eager(lambda r: a @ b, 20)
    tf = 2 * 8192**3 / (t2 / 1e3) / 1e12
    return bw, tf


def random_nvfp4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes and E4M3 scales in [0.5, 2.5] (as anchors.py); not zeros (see METHOD.md)."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEV)
    scale = (torch.rand(n, k // 16, device=DEV) * 2 + 0.5).to(torch.float8_e4m3fn)
    return packed, scale, torch.tensor([100.0], device=DEV)


def _one_line(ex: BaseException, limit: int = 240) -> str:
    msg = " ".join(str(ex).split())
    return f"{type(ex).__name__}: {msg}"[:limit]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _has_c_op(name: str) -> bool:
    try:
        return hasattr(torch.ops._C, name)
    except Exception:  # noqa: BLE001
        return False


def load_marlin(capability: tuple[int, int] | None, importer=importlib.import_module, has_op=_has_c_op):
    """vLLM's Marlin FP4 helpers module, or ``(None, one-line reason)`` why the column is skipped.

    ``capability`` is the GPU's (major, minor) or None without a GPU. ``importer`` and ``has_op``
    are injectable so the skip logic is testable without vLLM or a GPU. Never raises.
    """
    if capability is None:
        return None, "no CUDA GPU"
    if tuple(capability) < MARLIN_MIN_CAPABILITY:
        return None, (f"GPU capability {capability[0]}.{capability[1]} is below Marlin FP4's "
                      f"{MARLIN_MIN_CAPABILITY[0]}.{MARLIN_MIN_CAPABILITY[1]}")
    try:
        importer("vllm")
    except Exception as ex:  # noqa: BLE001 -- any failure means "no vLLM here", not a crash
        return None, f"vllm does not import: {_one_line(ex)}"
    try:
        importer("vllm._custom_ops")  # imports vllm._C_stable_libtorch, which registers torch.ops._C
    except Exception as ex:  # noqa: BLE001
        return None, f"vllm._custom_ops does not import: {_one_line(ex)}"
    missing = [op for op in MARLIN_OPS if not has_op(op)]
    if missing:
        return None, f"vLLM's compiled ops lack torch.ops._C.{', '.join(missing)} (no vllm._C_stable_libtorch?)"
    try:
        mod = importer(MARLIN_MODULE)
    except Exception as ex:  # noqa: BLE001
        return None, f"{MARLIN_MODULE} does not import: {_one_line(ex)}"
    missing = [f for f in MARLIN_FUNCS if not callable(getattr(mod, f, None))]
    if missing:
        return None, f"{MARLIN_MODULE} lacks {', '.join(missing)}"
    try:
        ok = bool(mod.is_fp4_marlin_supported())
    except Exception as ex:  # noqa: BLE001
        return None, f"is_fp4_marlin_supported() failed: {_one_line(ex)}"
    if not ok:
        return None, f"vLLM's is_fp4_marlin_supported() is False on capability {capability[0]}.{capability[1]}"
    return mod, None


def marlin_meta() -> tuple[str, dict]:
    """(vLLM version, what the Marlin column calls) for the JSON; only after :func:`load_marlin` succeeded."""
    try:
        import vllm
        from vllm.scalar_type import scalar_types

        version, type_id = vllm.__version__, scalar_types.float4_e2m1f.id
    except Exception as ex:  # noqa: BLE001 -- metadata only
        version, type_id = f"unknown ({_one_line(ex)})", None
    return version, {
        "source": f"vllm {version} {MARLIN_MODULE}: prepare_fp4_layer_for_marlin(layer) once per weight set, "
                  "apply_fp4_marlin_linear(...) per call (-> torch.ops._C.gptq_marlin_repack, torch.ops._C.marlin_gemm "
                  "with scalar_types.float4_e2m1f)",
        "float4_e2m1f_id": type_id,
        "VLLM_MARLIN_USE_ATOMIC_ADD": os.environ.get("VLLM_MARLIN_USE_ATOMIC_ADD", "unset"),
        "check": f"every weight set and M: relative norm error vs x @ dequantize_f64(W).T <= {MARLIN_TOL}, else the "
                 "shape is not timed",
    }


def marlin_layer(mod, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor, n: int, k: int):
    """One NVFP4 weight (our compressed-tensors tensors) through vLLM's own Marlin preparation.

    The layer carries what vLLM's compressed-tensors NVFP4 W4A16 scheme hands to
    ``MarlinNvFp4LinearKernel.process_weights_after_loading``: ``weight`` packed E2M1 uint8 [N, K/2],
    ``weight_scale`` E4M3 [N, K/16] and ``weight_global_scale`` as a *multiplier* (the scheme stores
    ``1 / weight_global_scale``; our global scale is compressed-tensors' divisor).
    """
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(packed.clone(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale.clone(), requires_grad=False)
    gmul = 1.0 / gs.to(torch.float32).reshape(-1).max()
    layer.weight_global_scale = torch.nn.Parameter(gmul, requires_grad=False)
    layer.output_size_per_partition = n
    layer.input_size_per_partition = k
    layer.params_dtype = torch.bfloat16
    mod.prepare_fp4_layer_for_marlin(layer)
    return layer


def marlin_apply(mod, layer, n: int, k: int):
    """``x -> apply_fp4_marlin_linear(...)`` with the arguments ``MarlinNvFp4LinearKernel.apply_weights`` passes."""
    return lambda x: mod.apply_fp4_marlin_linear(
        input=x, weight=layer.weight, weight_scale=layer.weight_scale,
        weight_global_scale=layer.weight_global_scale, workspace=layer.workspace, size_n=n, size_k=k)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius-norm error of ``out`` vs the float64 ``ref`` (inf for a shape mismatch or NaN)."""
    if tuple(out.shape) != tuple(ref.shape):
        return float("inf")
    err = float((out.to(torch.float64) - ref).norm() / ref.norm())
    return err if err == err else float("inf")


def check_against_f64(apply_fns, q4, xs: dict[int, torch.Tensor]) -> float:
    """Largest relative error of ``apply_fns[r](x)`` vs ``x @ W_r.T`` in float64, over every weight set r
    (the exact dequantized weight, ``reference.dequantize_f64``) and every activation in ``xs``."""
    worst = 0.0
    for fn, (packed, scale, gs) in zip(apply_fns, q4, strict=True):
        w64 = reference.dequantize_f64(packed, scale, gs)
        for x in xs.values():
            worst = max(worst, rel_err(fn(x), x.to(torch.float64) @ w64.T))
        del w64
    return worst


def sum_layers(recs: list[dict], nlayers: int) -> dict[int, dict[str, float]]:
    """Per M, the sum over the layer's GEMMs of every ``*_ms`` value; a key some GEMM lacks is dropped
    (a sum with a missing layer would mislead)."""
    sums: dict[int, dict[str, float]] = {}
    counts: dict[int, dict[str, int]] = {}
    for rec in recs:
        m = rec["M"]
        for key, v in rec.items():
            if key.endswith("_ms") and v is not None:
                sums.setdefault(m, {})[key] = sums.setdefault(m, {}).get(key, 0.0) + v
                counts.setdefault(m, {})[key] = counts.setdefault(m, {}).get(key, 0) + 1
    return {m: {k: round(v, 5) for k, v in d.items() if counts[m][k] == nlayers} for m, d in sums.items()}


def add_marlin_ratio(row: dict) -> dict:
    """``row["ours/marlin"]`` = marlin_graph_ms / ours_graph_ms (ours' speedup over vLLM's Marlin, CUDA-graph
    timing; > 1 means ours is faster), where both are present."""
    if row.get("marlin_graph_ms") and row.get("ours_graph_ms"):
        row["ours/marlin"] = round(row["marlin_graph_ms"] / row["ours_graph_ms"], 3)
    return row


def build_targets(rows: list[dict]) -> list[dict]:
    """Targets on the per-layer ("sum") rows: speedup vs BF16 cuBLAS per M band, and (where the Marlin
    column was measured) speedup vs vLLM's Marlin FP4 at every M."""
    targets = []
    rows = [r for r in rows if r["model"] in DEFAULT_MODELS]
    for r in rows:
        if r["layer"] != "sum" or not r.get("ours_graph_ms"):
            continue
        for pred, tgt in TARGETS:
            if pred(r["M"]) and r.get("bf16_graph_ms"):
                targets.append({
                    "name": f"{r['model']} M={r['M']} per-layer speedup vs BF16 cuBLAS (CUDA graph timing)",
                    "measured": round(r["bf16_graph_ms"] / r["ours_graph_ms"], 3), "op": ">=", "target": tgt,
                })
    for r in rows:
        if r["layer"] == "sum" and r.get("ours/marlin") is not None:
            targets.append({
                "name": f"{r['model']} M={r['M']} per-layer speedup vs vLLM Marlin FP4 (CUDA graph timing)",
                "measured": r["ours/marlin"], "op": ">=", "target": MARLIN_TARGET,
            })
    return targets


def device_tag(name: str | None) -> str:
    """Short GPU tag for the result file name: 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200'."""
    words = (name or "").lower().replace("nvidia", " ").split()
    tag = "".join(c for c in (words[0] if words else "") if c.isalnum() or c in "-_")
    return tag or "gpu"


def result_path(out_arg: str | None, env_out: str | None, device_name: str | None, default_dir: Path) -> Path:
    """``--out`` (else ``$OUT``, else ``default_dir``); a folder (or a suffix-less path) gets
    ``kernel-<gpu>.json`` so runs on different GPUs write different files."""
    path = Path(out_arg) if out_arg else Path(env_out) if env_out else default_dir
    if path.is_dir() or not path.suffix:
        path = path / f"kernel-{device_tag(device_name)}.json"
    return path


def table_lines(rows: list[dict], device_name: str) -> list[str]:
    """The printed per-layer table (one line per model and M)."""
    lines = [
        f"# {device_name}; per decoder layer (qkv+o+gate_up+down), ms; ratio = bf16 / method (higher is "
        "better); ours/marlin = marlin / ours (CUDA graph)",
        f"{'model':12s} {'M':>5s} | {'bf16 g':>8s} {'ours g':>8s} {'x':>5s} | {'bf16 e':>8s} {'ours e':>8s} "
        f"{'x':>5s} | {'splitk g':>8s} {'dq+cubl g':>9s} {'nf4 g':>8s} {'x nf4':>5s} | {'marlin g':>8s} "
        f"{'o/mar':>5s} | {'fp4 floor':>9s}",
    ]
    for r in rows:
        if r["layer"] != "sum":
            continue

        def f(key: str, r=r) -> str:
            v = r.get(key)
            return f"{v:8.4f}" if v else f"{'-':>8s}"

        def ratio(a: str, b: str, r=r) -> str:
            return f"{r[a] / r[b]:5.2f}" if r.get(a) and r.get(b) else f"{'-':>5s}"

        floor = r.get("floor_fp4_ms")
        lines.append(
            f"{r['model']:12s} {r['M']:5d} | {f('bf16_graph_ms')} {f('ours_graph_ms')} "
            f"{ratio('bf16_graph_ms', 'ours_graph_ms')} | {f('bf16_eager_ms')} {f('ours_eager_ms')} "
            f"{ratio('bf16_eager_ms', 'ours_eager_ms')} | {f('kernel_splitk_graph_ms')} "
            f"{f('dequant_cublas_graph_ms')} "
            f"{f('nf4_graph_ms')} {ratio('bf16_graph_ms', 'nf4_graph_ms')} | {f('marlin_graph_ms')} "
            f"{ratio('marlin_graph_ms', 'ours_graph_ms')} | "
            + (f"{floor:9.4f}" if floor is not None else f"{'-':>9s}"))
    return lines


def sanitize_run(modes: set[str] | None = None, max_nk: int | None = None) -> int:
    """Small shapes through every kernel and split path, checked; meant for compute-sanitizer. ``modes``: only the
    cases of these op modes (names, cuda/gemm_modes.h), ``max_nk``: only weights with N x K <= max_nk (racecheck /
    synccheck are slow)."""
    kernels.load_extension()
    torch.manual_seed(0)
    bad = 0
    # (M, N, K, mode, split-K splits (0: the heuristic))
    for m, n, k, mode, splits in [
            (1, 256, 256, "splitk", 0), (5, 272, 512, "splitk", 2), (16, 128, 384, "splitk", 3),
            (40, 384, 256, "splitk", 0), (70, 128, 256, "splitk", 1), (3, 256, 512, "dequant_cublas", 0),
            (300, 2048, 256, "dequant_cublas", 0),
            # the stream-K kernel: whole tiles, many partials, half tiles, M tails
            (17, 272, 128, "streamk", 0), (33, 400, 640, "streamk", 0), (100, 1040, 768, "streamk", 0),
            (200, 528, 896, "streamk", 0), (64, 4352, 3584, "streamk", 0),
            # the register-A wgmma kernel (stream-K / split-K where it is unavailable): both token tiles,
            # half 256-row tiles, partial segments, M tails
            (1, 272, 128, "wgmma_rs", 0), (64, 1136, 640, "wgmma_rs", 0), (65, 4352, 3584, "wgmma_rs", 0),
            (300, 528, 896, "wgmma_rs", 0), (129, 256, 1024, "wgmma_rs", 0),
            # the wgmma SS kernel: the same, plus a tile split among several CTAs
            (1, 272, 128, "wgmma_ss", 0), (64, 1136, 640, "wgmma_ss", 0), (65, 4352, 3584, "wgmma_ss", 0),
            (300, 528, 896, "wgmma_ss", 0), (129, 256, 1024, "wgmma_ss", 0), (64, 3584, 3584, "wgmma_ss", 0),
            # small weights whose tiles are split among CTAs (two segments per CTA, ring wrap across
            # segments, fix-up), both token tiles: small enough for racecheck / synccheck
            (64, 1024, 1280, "wgmma_ss", 0), (200, 512, 1280, "wgmma_ss", 0)]:
        if (modes is not None and mode not in modes) or (max_nk is not None and n * k > max_nk):
            continue
        packed, scale, gs = random_nvfp4(n, k)
        rw = kernels.repack(packed, scale)
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        b = torch.randn(n, device=DEV).to(torch.bfloat16)
        out = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, b, n, kernels.GEMM_MODES[mode], splits)
        ref = reference.linear_f64(x, packed, scale, gs, b)
        err = float((out.double() - ref).norm() / ref.norm())
        w1 = kernels.dequantize(packed, scale, gs)
        w2 = kernels.dequantize_repacked(rw, gs, n)
        ok = err < 1e-2 and torch.equal(w1, w2)
        bad += not ok
        print(f"sanitize M={m} N={n} K={k} mode={mode} splits={splits}: rel err {err:.2e} "
              f"dequant equal {torch.equal(w1, w2)}")
    torch.cuda.synchronize()
    print("SANITIZE", "OK" if bad == 0 else f"{bad} FAILED")
    return 1 if bad else 0


def tune_splits(models: dict, ms: list[int]) -> dict:
    """Graph-time the fused kernel over split-K penalties on decode shapes; keep the best."""
    ext = kernels.extension()
    penalties = (0.0, 0.004, 0.015, 0.05)
    totals = dict.fromkeys(penalties, 0.0)
    gs = torch.tensor([100.0], device=DEV)
    for cfg in models.values():
        for _, n, k in layer_shapes(cfg):
            ws = [kernels.repack(*random_nvfp4(n, k)[:2]) for _ in range(ROT)]
            for m in ms:
                x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
                for pen in penalties:
                    ext.set_tuning(-1, pen)
                    t = bench_graph(lambda r, x=x, ws=ws, n=n: torch.ops.qerl.nvfp4_gemm(
                        x, ws[r % ROT].qweight, ws[r % ROT].qscale, gs, None, n, kernels.GemmMode.SPLITK), reps=10)
                    totals[pen] += t or 0.0
            del ws
    for pen, tot in totals.items():
        print(f"# split penalty {pen}: decode GEMMs total {tot:.4f} ms", flush=True)
    best = min(totals, key=totals.get)
    ext.set_tuning(-1, best)
    return {"split_penalty": best, "totals_ms": totals}


def prepare_marlin(mod, q4, n: int, k: int, xs: dict[int, torch.Tensor]) -> tuple[list | None, dict]:
    """vLLM-Marlin-prepared copies of the ROT weight sets, checked against the float64 reference at every M;
    ``(apply functions or None, record fields)``. A preparation error or an error above MARLIN_TOL drops
    the Marlin column for this shape (so a wrong layout cannot produce a speed)."""
    try:
        layers = [marlin_layer(mod, p, s, g, n, k) for p, s, g in q4]
        fns = [marlin_apply(mod, lay, n, k) for lay in layers]
        err = check_against_f64(fns, q4, xs)
    except Exception as ex:  # noqa: BLE001
        _sync()
        return None, {"marlin_error": _one_line(ex)}
    _sync()
    info = {"marlin_rel_err": float(f"{err:.3e}")}
    if not err <= MARLIN_TOL:
        info["marlin_error"] = f"relative error {err:.3e} vs float64 reference > {MARLIN_TOL}: not timed"
        return None, info
    return fns, info


def measure_shape(mname: str, lname: str, n: int, k: int, ms: list[int], iters: int, bnb_mods,
                  marlin_mod=None, variants: list[str] | None = None) -> list[dict]:
    """All methods, eager and graph, for one GEMM shape over ms (weights rotate over ROT sets)."""
    ext = kernels.extension()
    w_bf16 = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(ROT)]
    q4 = [random_nvfp4(n, k) for _ in range(ROT)]
    rws = [kernels.repack(p, s) for p, s, _ in q4]
    gss = [g for _, _, g in q4]
    nf4 = [bnb_mods[1].quantize_4bit(w, quant_type="nf4", blocksize=64) for w in w_bf16] if bnb_mods else None
    xs = {m: torch.randn(m, k, device=DEV, dtype=torch.bfloat16) for m in ms}
    mfns, minfo = prepare_marlin(marlin_mod, q4, n, k, xs) if marlin_mod is not None else (None, {})
    if minfo:
        print(f"# marlin {mname} {lname} {n}x{k}: {json.dumps(minfo)}", flush=True)

    def ours(mode: str, x: torch.Tensor):  # noqa: ANN202
        mode = kernels.GEMM_MODES[mode]
        return lambda r: torch.ops.qerl.nvfp4_gemm(
            x, rws[r % ROT].qweight, rws[r % ROT].qscale, gss[r % ROT], None, n, mode)

    recs = []
    for m in ms:
        x = xs[m]
        fns = {
            "bf16": lambda r, x=x: F.linear(x, w_bf16[r % ROT]),
            "ours": ours("auto", x),
            f"kernel_{BASELINE}": ours(BASELINE, x),
            "dequant_cublas": ours("dequant_cublas", x),
        }
        for v in variants or []:
            if v != BASELINE and variant_applies(ext, v, m, n, k):
                fns[f"kernel_{v}"] = (narrow_wgmma_tiles(ext, ours(TILE_VARIANTS[v], x)) if v in TILE_VARIANTS
                                      else ours(v, x))
        if bnb_mods:
            xb = x.unsqueeze(0) if m == 1 else x
            fns["nf4"] = lambda r, xb=xb: bnb_mods[0].matmul_4bit(
                xb, nf4[r % ROT][0].t(), quant_state=nf4[r % ROT][1])
        if mfns is not None:
            fns["marlin"] = lambda r, x=x: mfns[r % ROT](x)
        rec = {"model": mname, "layer": lname, "N": n, "K": k, "M": m, "splits": int(ext.splits_for(m, n, k)),
               "ours_runs": ext.gemm_choice(m, n, k, int(kernels.GemmMode.AUTO)), **minfo}
        if "streamk" in (variants or []):
            rec["streamk_grid"] = int(ext.streamk_grid(m, n))
            rec["streamk_tiles"] = int(ext.streamk_tiles(m, n))
        for key, fn in fns.items():
            if key.startswith("kernel") and m > 1024:
                continue  # the fused kernel is not meant for these sizes (and is slow there)
            rec[f"{key}_eager_ms"] = round(bench_eager(fn, iters), 5)
            g = bench_graph(fn, reps=iters)
            rec[f"{key}_graph_ms"] = round(g, 5) if g is not None else None
        recs.append(add_variant_ratios(add_marlin_ratio(rec), variants or []))
    return recs


def streamk_calibration(rows: list[dict], rule: float, rule_stages: float = float("inf")) -> dict:
    """How well auto's rule -- stream-K when tiles >= ``rule`` x CTAs or each CTA's range has >= ``rule_stages``
    K stages (cuda/qerl_torch.cpp, ``streamk_pays``) -- picks between the forced kernels on the timed GEMMs.

    Per GEMM row with both ``kernel_splitk_graph_ms`` and ``kernel_streamk_graph_ms``: its tiles per CTA
    (``streamk_tiles`` / ``streamk_grid``, both recorded from the extension when the row was timed), stages per
    CTA (ceil(tiles x K stages / grid)) and which kernel is faster. Returns the points, how many the rule gets
    right, the summed time under the rule vs best-of-both, and the tiles threshold (among the observed values,
    and 0 / inf) that minimizes the summed time on these rows with the stages part of the rule kept.
    """
    pts = []
    for r in rows:
        sp, sk, grid = r.get("kernel_splitk_graph_ms"), r.get("kernel_streamk_graph_ms"), r.get("streamk_grid")
        tiles = r.get("streamk_tiles")
        if r.get("layer") == "sum" or not (sp and sk and grid and tiles):
            continue
        pts.append({"model": r["model"], "layer": r["layer"], "M": r["M"], "tiles_per_cta": round(tiles / grid, 4),
                    "stages_per_cta": -(-tiles * (r["K"] // kernels.K_STAGE) // grid), "splitk_ms": sp,
                    "streamk_ms": sk})

    def picks(p: dict, th: float) -> bool:
        return p["tiles_per_cta"] >= th or p["stages_per_cta"] >= rule_stages

    def total(th: float) -> float:
        return sum(p["streamk_ms"] if picks(p, th) else p["splitk_ms"] for p in pts)

    cands = sorted({0.0, float("inf"), *(p["tiles_per_cta"] for p in pts)})
    best = min(cands, key=lambda th: (total(th), th))
    right = sum(picks(p, rule) == (p["streamk_ms"] < p["splitk_ms"]) for p in pts)
    return {"rule": rule, "rule_stages": rule_stages, "rule_right": right, "rule_ms": round(total(rule), 5),
            "oracle_ms": round(sum(min(p["splitk_ms"], p["streamk_ms"]) for p in pts), 5),
            "best_threshold": best if best != float("inf") else None, "best_ms": round(total(best), 5),
            "points": sorted(pts, key=lambda p: p["tiles_per_cta"])}


def repro_throw() -> int:
    """Call the op with a shape it must refuse; print the error (run under cuda-gdb if it crashes)."""
    kernels.load_extension()
    packed, scale, gs = random_nvfp4(64, 256)
    rw = kernels.repack(packed, scale)
    try:
        torch.ops.qerl.nvfp4_gemm(torch.randn(4, 128, device=DEV).to(torch.bfloat16), rw.qweight, rw.qscale,
                                  gs, None, 64, kernels.GemmMode.SPLITK)
    except RuntimeError as ex:
        print("REPRO caught:", str(ex).splitlines()[0][:200])
    try:
        torch.ops.qerl.nvfp4_gemm(torch.randn(4, 256, device=DEV).half(), rw.qweight, rw.qscale, gs, None, 64,
                                  kernels.GemmMode.SPLITK)
    except RuntimeError as ex:
        print("REPRO caught:", str(ex).splitlines()[0][:200])
    print("REPRO done")
    return 0


#: (M, N, K) of the profiled GEMMs: 7B gate_up / o / down at decode, gate_up at M = 16, 64, 256
PROFILE_SHAPES = [(1, 37888, 3584), (1, 3584, 3584), (1, 3584, 18944), (16, 37888, 3584), (64, 37888, 3584),
                  (256, 37888, 3584)]


def profile_run(marlin: bool = False, ms: set[int] | None = None, variants: list[str] | None = None) -> int:
    """One fused-kernel call per shape and variant (for ncu), after a warm-up call each; with ``marlin`` vLLM's
    Marlin FP4 GEMM on the same weights right after ours (ncu -k 'regex:nvfp4_gemm|Marlin' keeps the GEMMs:
    split-K is ``nvfp4_gemm_splitk_kernel``, stream-K ``nvfp4_gemm_streamk_kernel``)."""
    kernels.load_extension()
    modes = profile_modes(variants, kernels.gemm_kernel_variant())
    mod = None
    if marlin:
        mod, why = load_marlin(torch.cuda.get_device_capability())
        if mod is None:
            print(f"# marlin profile skipped: {why}", flush=True)
    for m, n, k in [s for s in PROFILE_SHAPES if ms is None or s[0] in ms]:
        packed, scale, gs = random_nvfp4(n, k)
        rw = kernels.repack(packed, scale)
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        calls = [functools.partial(torch.ops.qerl.nvfp4_gemm, x, rw.qweight, rw.qscale, gs, None, n, mode)
                 for _, mode in modes]
        if mod is not None:
            calls.append(functools.partial(marlin_apply(mod, marlin_layer(mod, packed, scale, gs, n, k), n, k), x))
        for call in calls:
            for _ in range(2):
                call()
                torch.cuda.synchronize()
        print(f"# profiled M={m} N={n} K={k} ({', '.join(v for v, _ in modes)}): {len(calls)} GEMM(s) x 2 calls",
              flush=True)
    return 0


def _dequant_times(n: int, k: int) -> dict[str, float]:
    packed, scale, gs = random_nvfp4(n, k)
    rw = kernels.repack(packed, scale)
    return {"ct": bench_eager(lambda r: kernels.dequantize(packed, scale, gs), 20),
            "repacked": bench_eager(lambda r: kernels.dequantize_repacked(rw, gs, n), 20)}


def dequant_bandwidth(bw: float) -> dict:
    """Dequant kernels alone on the largest 7B/32B weights: time and bytes/s vs the copy ceiling."""
    res = {}
    for n, k in [(37888, 3584), (55296, 5120)]:
        moved = n * k * (0.5625 + 2)
        for name, t in _dequant_times(n, k).items():
            res[f"{name}_{n}x{k}"] = {"ms": round(t, 4), "TBps": round(moved / (t / 1e3) / 1e12, 3),
                                      "of_copy": round(moved / (t / 1e3) / 1e12 / bw, 3)}
        torch.cuda.empty_cache()
    print("# dequant kernels:", json.dumps(res), flush=True)
    return res


#: the ncu "details" metrics the NOTES tables quote, per profiled kernel
NCU_METRICS = ("Duration", "DRAM Throughput", "Compute (SM) Throughput", "Executed Ipc Active", "Issue Slots Busy",
               "Warp Cycles Per Issued Instruction", "Registers Per Thread", "Theoretical Occupancy",
               "Dynamic Shared Memory Per Block", "Waves Per SM", "L2 Hit Rate")


def ncu_summary(path: str) -> list[dict]:
    """One row per kernel launch of an ``ncu --csv --page details`` listing (plain or .gz): ID, kernel, grid,
    block and :data:`NCU_METRICS` (values as ncu prints them, with their unit)."""
    import csv
    import gzip
    import io

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as fh:
        lines = fh.read().splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if head is None:
        raise SystemExit(f"{path}: no ncu CSV header (\"ID\", ...); run ncu with --csv --page details")
    rows: dict[str, dict] = {}
    for rec in csv.DictReader(io.StringIO("\n".join(lines[head:]))):
        row = rows.setdefault(rec["ID"], {"ID": int(rec["ID"]), "kernel": rec["Kernel Name"].split("(")[0],
                                          "grid": rec["Grid Size"], "block": rec["Block Size"]})
        if rec["Metric Name"] in NCU_METRICS:
            row[rec["Metric Name"]] = f"{rec['Metric Value']} {rec['Metric Unit']}".strip()
    return sorted(rows.values(), key=lambda r: r["ID"])


def sass_summary(path: str) -> int:
    """Opcode histogram per kernel of a ``cuobjdump -sass`` listing (instruction mix of the loops)."""
    import collections
    import re

    funcs: dict[str, collections.Counter] = {}
    cur = None
    for line in Path(path).read_text(errors="replace").splitlines():
        mf = re.search(r"Function : (\S+)", line)
        if mf:
            cur = mf.group(1)
            funcs[cur] = collections.Counter()
            continue
        mi = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if cur and mi:
            funcs[cur][mi.group(1)] += 1
    for name, c in funcs.items():
        print(f"{name} ({sum(c.values())} instructions)")
        print("   " + " ".join(f"{op}:{n}" for op, n in c.most_common(28)))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", default=None, help="summarize a cuobjdump -sass listing and exit")
    ap.add_argument("--ncu-summary", default=None, help="print the key metrics of an ncu --csv listing and exit")
    ap.add_argument("--repro-throw", action="store_true")
    ap.add_argument("--profile", action="store_true", help="one call per decode shape (run under ncu)")
    ap.add_argument("--profile-marlin", action="store_true", help="with --profile: vLLM's Marlin on the same weights")
    ap.add_argument("--profile-m", default=None, help="with --profile: comma list of M to keep (default all)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--sanitize-modes", default=None,
                    help="with --sanitize: comma list of op mode names to run (default all; cuda/gemm_modes.h)")
    ap.add_argument("--sanitize-max-nk", type=int, default=None, help="with --sanitize: skip weights with N x K above")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--threshold", type=int, default=-1, help="force the dispatch threshold (M)")
    ap.add_argument("--no-marlin", action="store_true", help="skip the vLLM Marlin FP4 column")
    ap.add_argument("--variants", default=None,
                    help="fused-kernel variants to time side by side (splitk,streamk); with --profile: to profile "
                    "(default: the one $QERL_GEMM_KERNEL selects)")
    ap.add_argument("--models", default=None,
                    help=f"comma list of {sorted(MODELS)}, or all (default {','.join(DEFAULT_MODELS)})")
    ap.add_argument("--ms", default=None, help="comma list of M (default: all, or --quick's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        variants = parse_variants(args.variants)
        models = select_models(args.models)
        ms_arg = [int(v) for v in args.ms.split(",")] if args.ms else None
        sanitize_modes = parse_modes(args.sanitize_modes) if args.sanitize_modes else None
    except ValueError as ex:
        ap.error(str(ex))
    if args.ncu_summary:
        for row in ncu_summary(args.ncu_summary):
            print(json.dumps(row))
        return 0
    if args.sass:
        return sass_summary(args.sass)
    if args.sanitize:
        return sanitize_run(sanitize_modes, args.sanitize_max_nk)
    if args.repro_throw:
        return repro_throw()
    if args.profile:
        keep = {int(v) for v in args.profile_m.split(",")} if args.profile_m else None
        return profile_run(marlin=args.profile_marlin, ms=keep, variants=variants if args.variants else None)
    torch.backends.cuda.matmul.allow_tf32 = True
    if not kernels.load_extension(verbose=False):
        print("extension failed:", kernels.cuda_unavailable_reason())
        return 1
    ext = kernels.extension()
    ms = ms_arg or ([1, 16, 64, 256, 4096] if args.quick else MS)
    iters = 10 if args.quick else 30
    name = torch.cuda.get_device_name()
    out: dict = {
        "device": name,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()},
        "command": "python " + " ".join(sys.argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "rot_weight_sets": ROT,
        "variants": variants,
        "gemm_kernel_env": os.environ.get(kernels.GEMM_KERNEL_ENV, ""),
    }
    bw, tf = ceilings()
    out["copy_TBps"], out["bf16_TFLOPs"] = round(bw, 3), round(tf, 1)
    print(f"# {name} torch {torch.__version__}: copy {bw:.2f} TB/s, bf16 mm {tf:.0f} TFLOP/s", flush=True)
    out["dequant"] = dequant_bandwidth(bw)
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbF

        bnb_mods = (bnb, bnbF)
        out["versions"]["bitsandbytes"] = bnb.__version__
    except Exception as ex:  # noqa: BLE001
        print("# bitsandbytes unavailable:", ex)
        out["versions"]["bitsandbytes"] = f"unavailable: {ex}"
        bnb_mods = None

    if args.no_marlin:
        marlin_mod, reason = None, "disabled by --no-marlin"
    else:
        marlin_mod, reason = load_marlin(tuple(torch.cuda.get_device_capability()))
    if marlin_mod is None:
        out["marlin"] = {"skipped": reason}
        print(f"# vLLM Marlin FP4 column skipped: {reason}", flush=True)
    else:
        out["versions"]["vllm"], out["marlin"] = marlin_meta()
        print(f"# vLLM Marlin FP4 column: {out['marlin']['source']}", flush=True)

    if not args.no_tune:
        out["split_tuning"] = tune_splits({k: MODELS[k] for k in DEFAULT_MODELS}, [1, 16, 64])
    if args.threshold >= 0:
        ext.set_tuning(args.threshold, -1)
    out["tuning"] = dict(zip(("gemm_max_m", "split_penalty", "streamk_min_tiles_per_cta",
                              "streamk_min_stages_per_cta"), ext.get_tuning(), strict=True))
    print(f"# tuning: {out['tuning']}", flush=True)

    rows = []
    t0 = time.time()
    for mname, cfg in models.items():
        recs = []
        for lname, n, k in layer_shapes(cfg):
            for rec in measure_shape(mname, lname, n, k, ms, iters, bnb_mods, marlin_mod, variants):
                recs.append(rec)
                print(json.dumps(rec), flush=True)
            torch.cuda.empty_cache()
        rows.extend(recs)
        nweights = sum(n * k for _, n, k in layer_shapes(cfg))
        sums = sum_layers(recs, len(layer_shapes(cfg)))
        for m in ms:
            lay = {"model": mname, "M": m, "layer": "sum", **sums.get(m, {})}
            lay["floor_fp4_ms"] = round(nweights * 0.5625 / (bw * 1e12) * 1e3, 5)
            lay["floor_bf16_bytes_ms"] = round(nweights * 2 / (bw * 1e12) * 1e3, 5)
            lay["floor_compute_ms"] = round(2 * m * nweights / (tf * 1e12) * 1e3, 5)
            rows.append(add_variant_ratios(add_marlin_ratio(lay), variants))
    out["rows"] = rows
    out["elapsed_s"] = round(time.time() - t0, 1)
    if marlin_mod is not None:
        errs = [r["marlin_rel_err"] for r in rows if "marlin_rel_err" in r]
        failed = sorted({f"{r['model']} {r['layer']}: {r['marlin_error']}" for r in rows if "marlin_error" in r})
        out["marlin"]["max_rel_err"] = max(errs) if errs else None
        if failed:
            out["marlin"]["failed"] = failed
            print("# marlin column dropped for:", *failed, sep="\n#   ", flush=True)

    targets = build_targets(rows)
    out["targets"] = targets

    path = result_path(args.out, os.environ.get("OUT"), name, Path(__file__).parent / "results")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"# wrote {path}")
    # the measured winners per GEMM shape and M: auto mode's calibration (verl_qerl/kernels/dispatch.py)
    table = dispatch.table_from_rows(rows, name, tuple(torch.cuda.get_device_capability()), out["command"])
    table_path = path.with_name(path.name.replace("kernel-", "gemm_dispatch-"))
    table_path.write_text(json.dumps(table))
    print(f"# wrote the measured dispatch table {table_path} ({len(table['points'])} points)")

    print()
    print("\n".join(table_lines(rows, name)))
    if len(variants) > 1:
        print()
        print("\n".join(variant_lines(rows, variants)))
    if "streamk" in variants:
        tun = out["tuning"]
        out["streamk_calibration"] = cal = streamk_calibration(rows, tun["streamk_min_tiles_per_cta"],
                                                               tun["streamk_min_stages_per_cta"])
        print(f"# auto stream-K rule (tiles >= {cal['rule']} x CTAs or >= {cal['rule_stages']:.0f} stages per CTA): "
              f"picks the faster kernel in {cal['rule_right']}/{len(cal['points'])} GEMMs, {cal['rule_ms']:.4f} ms "
              f"summed vs {cal['oracle_ms']:.4f} best-of-both; best tiles threshold with that stages rule: "
              f"{cal['best_threshold']}")
    rec_thr = {}
    for mname in models:
        faster = [r["M"] for r in rows if r["layer"] == "sum" and r["model"] == mname
                  and r.get("kernel_splitk_graph_ms") and r.get("dequant_cublas_graph_ms")
                  and r["kernel_splitk_graph_ms"] < r["dequant_cublas_graph_ms"]]
        rec_thr[mname] = max(faster) if faster else 0
    out["recommended_gemm_max_m"] = rec_thr
    path.write_text(json.dumps(out, indent=1))
    print(f"# fused kernel faster than dequant+cuBLAS up to M = {rec_thr} (dispatch threshold now "
          f"{out['tuning']['gemm_max_m']:.0f})")
    met = sum(bool(target_met(t)) for t in targets)
    print(f"# targets met: {met}/{len(targets)}")
    for t in targets:
        print(f"#  {target_status(t):6} {t['name']}: {t['measured']} {t['op']} {t['target']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
