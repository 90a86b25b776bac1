"""The vLLM Marlin FP4 anchor of ``benchmarks/kernel.py`` (its ``marlin`` column, ``--profile-marlin``).

vLLM's own Marlin FP4 GEMM (W4A16, ``torch.ops._C.marlin_gemm`` with the ``float4_e2m1f`` type), reached through
vLLM's public helpers ``prepare_fp4_layer_for_marlin`` and ``apply_fp4_marlin_linear``: whether it can run here
(a one-line reason when not, never an exception), the layer those helpers expect, the float64 check every weight
set passes before it is timed, and the ``ours/marlin`` ratio. Kept apart because it is the only part of the
benchmark that depends on vLLM, and its skip logic and correctness gate are tested on a CPU with a stand-in module.
"""

from __future__ import annotations

import importlib
import os

import torch

from verl_qerl.kernels import reference

MARLIN_TOL = 1e-2  # relative norm error vs the float64 reference, checked before Marlin is timed
#: ``is_fp4_marlin_supported()``'s threshold in vLLM 0.24 (``has_device_capability(75)``); checked here
#: first so an old GPU is skipped before vLLM is imported, and vLLM's own check is asked as well.
MARLIN_MIN_CAPABILITY = (7, 5)
MARLIN_MODULE = "vllm.model_executor.layers.quantization.utils.marlin_utils_fp4"
MARLIN_FUNCS = ("prepare_fp4_layer_for_marlin", "apply_fp4_marlin_linear", "is_fp4_marlin_supported")
MARLIN_OPS = ("marlin_gemm", "gptq_marlin_repack")


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


def add_marlin_ratio(row: dict) -> dict:
    """``row["ours/marlin"]`` = marlin_graph_ms / ours_graph_ms (ours' speedup over vLLM's Marlin, CUDA-graph
    timing; > 1 means ours is faster), where both are present."""
    if row.get("marlin_graph_ms") and row.get("ours_graph_ms"):
        row["ours/marlin"] = round(row["marlin_graph_ms"] / row["ours_graph_ms"], 3)
    return row
