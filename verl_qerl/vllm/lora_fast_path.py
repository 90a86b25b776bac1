"""Single-adapter LoRA for vLLM linear layers: shrink, FP4 GEMM and expand as one op per layer.

vLLM's LoRA layers serve many adapters at once: every linear layer runs the punica shrink and
expand kernels over per-token adapter indices, slice by slice. In RL every request of a rollout
engine carries the same adapter (verl starts vLLM with ``max_loras=1``), so for a layer with one
adapter slot the LoRA term is simply::

    out += mask * (x @ A_cat^T) @ B_blockdiag^T

with ``A_cat`` the concatenated A matrices of all fused slices (q/k/v, gate/up), ``B_blockdiag`` the
slices' B matrices on a block diagonal (slice i's B in slice i's output rows and its rank columns,
zeros elsewhere) and ``mask`` 1 for tokens whose request has the adapter and 0 for those without.
The scaling ``alpha / r`` is already folded into vLLM's stored B. For a ``qerl_nvfp4`` layer in the kernel layout the
whole layer, base GEMM included, is one op, ``qerl::nvfp4_lora_linear`` (:mod:`verl_qerl.kernels.ops`): where the
split-K kernel or ``decode_tma`` runs (up to 16 tokens) one kernel launch, the shrink's CTAs in the FP4 GEMM's grid
and the expand, token mask and residual add in its epilogue, in FP32 before the output's one rounding; elsewhere
``qerl::lora_shrink`` (``x @ A_cat^T``, one Triton kernel up to ``lora_shrink.TRITON_MAX_TOKENS`` tokens and where
``lora_shrink.triton_wins`` up to 64, cuBLAS elsewhere; :mod:`verl_qerl.kernels.lora_shrink`) and the GEMM with the
expand in its tiles (the register-A wgmma kernels) or followed by ``qerl::lora_expand``. Every other served layer
(unquantized under ``all``, per-part global scales, the torch layout) runs its base GEMM and then the shrink and
``qerl::lora_expand`` (one Triton kernel: expand, token mask and residual add; :mod:`verl_qerl.kernels.lora_expand`).
``QERL_LORA_FUSED_EXPAND=expand`` runs the shrink as its own op before ``qerl::nvfp4_gemm_lora``, ``=off`` keeps the
separate expand everywhere (before / after switches for benchmarks). No per-token indexing, static shapes: it traces
under torch.compile and captures into CUDA graphs.

How it plugs in (no vLLM file is edited):

* :func:`install` wraps ``LoRAModelManager._create_lora_modules``. After vLLM has built its LoRA
  layers, every ``BaseLinearLayerWithLoRA`` whose base layer we serve gets its ``lora_a_stacked`` /
  ``lora_b_stacked`` re-laid as *views* of one concatenated A and one block-diagonal B (same
  shapes, zero-initialised like vLLM's) and is flagged ``qerl_lora_fast_path``. Wrapped once, for flagged
  layers only (vLLM's own code runs for all others): ``BaseLinearLayerWithLoRA._apply_sync`` (base GEMM + LoRA:
  what ``apply`` runs) and, for vLLM 0.24's fused column-parallel layers, the function ``_mcp_apply`` their
  ``apply`` calls instead, run the layer as described above; ``_apply_lora_to_output`` (LoRA on an output the
  base layer computed, e.g. ``_apply_base_forward``) runs the shrink and the separate expand. vLLM keeps
  writing adapters through those views (``set_lora`` / ``reset_lora``), so a new adapter, or new weights for
  the same id (verl's ``TensorLoRARequest`` sync), is what the next forward reads; nothing is copied.
* The per-token mask is one static buffer per punica wrapper, refreshed in ``update_metadata``
  (host side, once per batch mapping, outside any graph) from the wrapper's own token-to-slot
  indices: slot 0 -> 1, no adapter (-1) -> 0. Batches mixing requests with and without the
  adapter stay exact.

When it applies: the engine has one adapter slot (``max_loras=1``: one adapter per batch, so the
"several adapters in one batch" case cannot arise), LoRA is not fully sharded, vLLM's dual-stream
LoRA is off, and the layer's base quant method is ``qerl_nvfp4`` (``QERL_LORA_FAST_PATH=auto``, the
default, or ``on``) or also unquantized BF16 (``=all``, for a like-for-like BF16 baseline). Everything
else, including ``max_loras > 1`` engines, keeps vLLM's punica path untouched; ``=off`` keeps vLLM's
path everywhere. The mode is part of vLLM's compile-cache key (:func:`_key_compile_cache_on_mode`), so
engines with and without the fast path never load each other's compiled graph. Each engine logs one
line, ``qerl_lora_fast_path_layers=N``. If vLLM's LoRA internals are not what this module was written
against (read in vLLM 0.24 and 0.32), it logs why and leaves vLLM's path in place.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
from typing import Any

import torch

from verl_qerl.kernels.lora_expand import lora_expand
from verl_qerl.kernels.lora_shrink import lora_shrink

from .config import QeRLNvFp4Error
from .decode_stats import write_fast_path_record

logger = logging.getLogger(__name__)

#: ``auto`` (default) / ``on``: qerl_nvfp4 layers of single-slot engines; ``all``: also unquantized (BF16)
#: layers; ``off``: vLLM's path only.
FAST_PATH_ENV = "QERL_LORA_FAST_PATH"
_MODES = ("auto", "on", "all", "off")
_DEFAULT_MODE = "auto"

#: ``auto`` (default): on the fast path, ``qerl_nvfp4`` layers in the kernel layout are one op,
#: ``qerl::nvfp4_lora_linear`` (at decode M one kernel launch: the shrink's CTAs in the FP4 GEMM's grid, the expand in
#: its epilogue); ``expand``: the shrink as its own ``qerl::lora_shrink`` launch, the expand inside the GEMM
#: (``qerl::nvfp4_gemm_lora``); ``off``: every fast-path layer runs its GEMM and a separate ``qerl::lora_expand``.
#: The last two are for before / after measurements.
FUSED_EXPAND_ENV = "QERL_LORA_FUSED_EXPAND"
_FUSED_MODES = ("auto", "expand", "off")

# vLLM configures handlers for its own logger tree only: a child of it prints the per-engine summary at INFO in
# the engine's log, where a benchmark can read it.
summary_logger = logging.getLogger("vllm.qerl_lora_fast_path")

_installed = False


def fast_path_mode() -> str:
    """The ``QERL_LORA_FAST_PATH`` setting, validated (read when an engine builds its LoRA layers)."""
    mode = os.environ.get(FAST_PATH_ENV, _DEFAULT_MODE).strip().lower() or _DEFAULT_MODE
    if mode not in _MODES:
        raise QeRLNvFp4Error(f"{FAST_PATH_ENV}={mode!r}; expected one of {', '.join(_MODES)}")
    return mode


def fused_expand_mode() -> str:
    """The ``QERL_LORA_FUSED_EXPAND`` setting, validated (read when an engine builds its LoRA layers)."""
    mode = os.environ.get(FUSED_EXPAND_ENV, "auto").strip().lower() or "auto"
    if mode not in _FUSED_MODES:
        raise QeRLNvFp4Error(f"{FUSED_EXPAND_ENV}={mode!r}; expected one of {', '.join(_FUSED_MODES)}")
    return mode


def install() -> bool:
    """Hook vLLM's LoRA model manager so single-slot engines get the fast path. Idempotent.

    Returns whether the hook is in place; False (with one log line) where vLLM lacks the pieces.
    """
    global _installed
    if _installed:
        return True
    try:
        from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
        from vllm.lora.model_manager import LoRAModelManager
    except ImportError as exc:
        logger.warning("qerl LoRA fast path unavailable (%s); vLLM's LoRA path is used", exc)
        return False
    missing = [name for owner, name in ((LoRAModelManager, "_create_lora_modules"),
                                        (BaseLinearLayerWithLoRA, "_apply_lora_to_output"))
               if not callable(getattr(owner, name, None))]
    if missing:
        logger.warning("qerl LoRA fast path unavailable: this vLLM lacks %s; vLLM's LoRA path is used", missing)
        return False
    original_create = LoRAModelManager._create_lora_modules
    original_apply = BaseLinearLayerWithLoRA._apply_lora_to_output

    @functools.wraps(original_create)
    def create_lora_modules(self, *args: Any, **kwargs: Any) -> Any:
        result = original_create(self, *args, **kwargs)
        convert_manager(self)
        return result

    # On the class every linear LoRA layer inherits it from, switched per layer by a plain attribute (a
    # constant for torch.compile, which traces this function once per layer).
    @functools.wraps(original_apply)
    def apply_lora_to_output(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        if getattr(self, "qerl_lora_fast_path", False):
            return _apply_lora_single(self, x, output)
        return original_apply(self, x, output)

    LoRAModelManager._create_lora_modules = create_lora_modules
    BaseLinearLayerWithLoRA._apply_lora_to_output = apply_lora_to_output
    _wrap_apply_sync(BaseLinearLayerWithLoRA)
    _wrap_merged_column_apply()
    _key_compile_cache_on_mode()
    _installed = True
    return True


def _wrap_apply_sync(cls: Any) -> None:
    """``_apply_sync(x, bias)`` is where vLLM's linear LoRA layers run their base GEMM and then the LoRA term
    (``apply``, without the dual-stream option). For flagged layers the wrap runs :func:`_apply_layer`, which can put
    the expand inside the GEMM; without the method (another vLLM) the LoRA term still runs through the wrapped
    ``_apply_lora_to_output``, only not fused."""
    original = getattr(cls, "_apply_sync", None)
    if not callable(original):
        logger.info("qerl LoRA fast path: this vLLM has no _apply_sync; the expand stays a separate kernel")
        return

    @functools.wraps(original)
    def apply_sync(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if getattr(self, "qerl_lora_fast_path", False):
            return _apply_layer(self, x, bias)
        return original(self, x, bias)

    cls._apply_sync = apply_sync


def _wrap_merged_column_apply() -> None:
    """vLLM 0.24's fused column-parallel LoRA layers (qkv, gate_up) do not call ``_apply_lora_to_output``:
    their ``apply`` runs the module function ``_mcp_apply`` (base GEMM + punica shrink/expand; in 0.32 only
    the fully sharded classes use it). Wrap that function too, with the same per-layer switch; ``apply``
    looks it up in its module's globals at call time."""
    try:
        from vllm.lora.layers import column_parallel_linear
    except ImportError:
        return
    original = getattr(column_parallel_linear, "_mcp_apply", None)
    if not callable(original):
        return

    @functools.wraps(original)
    def mcp_apply(x: torch.Tensor, bias: torch.Tensor | None, layer: Any) -> torch.Tensor:
        if getattr(layer, "qerl_lora_fast_path", False):
            return _apply_layer(layer, x, bias)
        return original(x, bias, layer)

    column_parallel_linear._mcp_apply = mcp_apply


def _key_compile_cache_on_mode() -> None:
    """Make vLLM's compile-cache key depend on the fast-path mode.

    vLLM keys its torch.compile artifacts (the AOT-compiled model under ``VLLM_CACHE_ROOT``, the inductor cache
    directory) on ``VllmConfig.compute_hash()``, which knows nothing of this module: an engine with the fast path
    would load the graph an engine without it compiled (punica kernels on the re-laid, strided adapter views:
    ``assert lora_b_weight.is_contiguous()``), and the other way round (``no attribute 'qerl_lora_a'``).
    ``VllmConfig.compute_hash`` folds in ``LoRAConfig.compute_hash``, so the mode goes there, for the engines the
    mode can change (one adapter slot, not fully sharded); every other engine keeps vLLM's own key."""
    try:
        from vllm.config.lora import LoRAConfig
    except ImportError:
        return
    original = getattr(LoRAConfig, "compute_hash", None)
    if not callable(original) or getattr(original, "qerl_keyed", False):
        return

    @functools.wraps(original)
    def compute_hash(self: Any) -> str:
        key = original(self)
        mode = fast_path_mode()
        if mode == "off" or getattr(self, "max_loras", None) != 1 or getattr(self, "fully_sharded_loras", False):
            return key
        return hashlib.sha256(f"{key}|{FAST_PATH_ENV}={mode}|{FUSED_EXPAND_ENV}={fused_expand_mode()}".encode()
                              ).hexdigest()

    compute_hash.qerl_keyed = True  # type: ignore[attr-defined]
    LoRAConfig.compute_hash = compute_hash


# -- conversion ---------------------------------------------------------------------------------


def _served(layer: Any, mode: str) -> bool:
    """Whether ``mode`` puts this LoRA layer's base quant method on the fast path."""
    from .linear_method import QeRLNvFp4LinearMethod

    method = getattr(getattr(layer, "base_layer", None), "quant_method", None)
    if isinstance(method, QeRLNvFp4LinearMethod):
        return True
    if mode == "all":
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        return isinstance(method, UnquantizedLinearMethod)
    return False


def convert_manager(manager: Any) -> int:
    """Put the served linear LoRA layers of ``manager`` on the fast path; returns how many.

    Logs one line per engine (per LoRA manager) with the count, ``qerl_lora_fast_path_layers=N``, so a
    benchmark's log shows whether the fast path ran; the count is also kept on the manager."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    mode = fast_path_mode()
    why_not = None
    slots = getattr(manager, "lora_slots", None)
    if mode == "off":
        why_not = f"{FAST_PATH_ENV}=off"
    elif slots != 1:
        why_not = f"the engine has {slots} adapter slots (max_loras); the fast path needs exactly 1"
    elif getattr(getattr(manager, "lora_config", None), "fully_sharded_loras", False):
        why_not = "fully_sharded_loras is on"
    done, skipped = [], {}
    if why_not is None:
        for name, layer in getattr(manager, "modules", {}).items():
            if not isinstance(layer, BaseLinearLayerWithLoRA) or not _served(layer, mode):
                continue
            why = convert_layer(layer)
            if why is None:
                done.append(name)
            else:
                skipped[name] = why
    for name, why in skipped.items():
        logger.warning("qerl LoRA fast path: %s keeps vLLM's path (%s)", name, why)
    manager.qerl_lora_fast_path_layers = len(done)
    write_fast_path_record(len(done), mode, why_not)
    summary_logger.info("qerl LoRA fast path: qerl_lora_fast_path_layers=%d (mode %s%s)", len(done), mode,
                        f"; not used: {why_not}" if why_not else "")
    return len(done)


def count_fast_path_layers(model: Any) -> int:
    """How many linear LoRA layers of ``model`` run on the fast path."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    return sum(isinstance(m, BaseLinearLayerWithLoRA) and bool(getattr(m, "qerl_lora_fast_path", False))
               for m in model.modules())


def convert_layer(layer: Any) -> str | None:
    """Re-lay one LoRA layer's adapter buffers as views of a concatenated A / block-diagonal B and
    switch it to the fast forward. Returns None on success, else why the layer was left alone."""
    if getattr(layer, "qerl_lora_fast_path", False):
        return None
    if getattr(layer, "_enable_aux_cuda_stream", False):
        return "vLLM's dual-stream LoRA (VLLM_LORA_ENABLE_DUAL_STREAM) is on"
    a_stacked, b_stacked = getattr(layer, "lora_a_stacked", None), getattr(layer, "lora_b_stacked", None)
    slices = tuple(getattr(layer, "output_slices", ()) or ())
    if not isinstance(a_stacked, tuple) or not isinstance(b_stacked, tuple) or not a_stacked:
        return "lora_a_stacked / lora_b_stacked are not tuples of tensors"
    n = len(a_stacked)
    if len(b_stacked) != n or len(slices) != n:
        return f"{n} A slices, {len(b_stacked)} B slices, {len(slices)} output slices"
    if any(t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != 1 for t in (*a_stacked, *b_stacked)):
        return "adapter buffers are not [1, 1, rows, cols]"
    rank, k = a_stacked[0].shape[2], a_stacked[0].shape[3]
    rank_b = b_stacked[0].shape[3]
    if any(t.shape[2:] != (rank, k) for t in a_stacked) or any(t.shape[3] != rank_b for t in b_stacked):
        return "slices differ in rank or input size"
    if [t.shape[2] for t in b_stacked] != list(slices) or rank_b != rank:
        return "B rows do not match the output slices"
    dtype, device = a_stacked[0].dtype, a_stacked[0].device
    if any(t.dtype != dtype or t.device != device for t in (*a_stacked, *b_stacked)):
        return "adapter buffers differ in dtype or device"
    wrapper = getattr(layer, "punica_wrapper", None)
    if wrapper is None or not isinstance(getattr(wrapper, "_token_lora_indices", None), torch.Tensor):
        return "no punica wrapper with token indices"
    held = wrapper.__dict__.get("qerl_token_mask")
    if held is not None and held.dtype != dtype:
        return f"adapter dtype {dtype} differs from another layer's {held.dtype}"
    if n == 1:
        a_cat, b_diag = a_stacked[0], b_stacked[0]
    else:
        a_cat = torch.zeros(1, 1, n * rank, k, dtype=dtype, device=device)
        b_diag = torch.zeros(1, 1, sum(slices), n * rank, dtype=dtype, device=device)
        a_views, b_views, row = [], [], 0
        for i, (a_i, b_i, width) in enumerate(zip(a_stacked, b_stacked, slices)):
            a_view = a_cat[:, :, i * rank:(i + 1) * rank, :]
            b_view = b_diag[:, :, row:row + width, i * rank:(i + 1) * rank]
            a_view.copy_(a_i)  # whatever vLLM holds already (zeros right after creation)
            b_view.copy_(b_i)
            a_views.append(a_view)
            b_views.append(b_view)
            row += width
        layer.lora_a_stacked = tuple(a_views)
        layer.lora_b_stacked = tuple(b_views)
    layer.qerl_lora_a = a_cat[0, 0]  # [n*r, K]
    layer.qerl_lora_b = b_diag[0, 0]  # [N, n*r]: qerl::nvfp4_gemm_lora's lora_b
    layer.qerl_lora_b_t = b_diag[0, 0].t()  # [n*r, N]: qerl::lora_expand's right operand, no copy
    layer.qerl_slice_bounds = [0, *itertools.accumulate(slices)]  # [0, end of slice 0, ..., N]
    layer.qerl_token_mask = attach_token_mask(wrapper, dtype)
    fused_mode = fused_expand_mode()
    layer.qerl_lora_fused = fused_mode != "off" and _has_lora_epilogue(layer)
    layer.qerl_lora_shrink_in_op = fused_mode == "auto"
    layer.qerl_lora_fast_path = True  # read by the patched _apply_lora_to_output
    base = getattr(layer, "base_layer", None)
    if base is not None:
        base.qerl_lora_fast_path = True
    return None


def _has_lora_epilogue(layer: Any) -> bool:
    """Whether the layer's base quant method can run the expand inside its GEMM (``qerl_nvfp4``)."""
    from .linear_method import QeRLNvFp4LinearMethod

    return isinstance(getattr(getattr(layer, "base_layer", None), "quant_method", None), QeRLNvFp4LinearMethod)


def _apply_layer(layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A flagged layer's forward, base GEMM included: ``qerl::nvfp4_lora_linear`` (or shrink + ``qerl::nvfp4_gemm_lora``
    under ``QERL_LORA_FUSED_EXPAND=expand``) where the layer's GEMM takes the expand in its epilogue (kernel layout,
    one global scale: checked per call, a weight reload may change it), else the base GEMM and
    :func:`_apply_lora_single`."""
    method = layer._get_quant_method()
    base = layer.base_layer
    if getattr(layer, "qerl_lora_fused", False) and method.lora_epilogue_supported(base):
        x2 = x.reshape(-1, x.shape[-1])
        mask = layer.qerl_token_mask[: x2.shape[0]]
        if getattr(layer, "qerl_lora_shrink_in_op", False):
            out = method.apply_with_lora(base, x2, bias, None, layer.qerl_lora_b, mask, layer.qerl_slice_bounds,
                                         lora_a=layer.qerl_lora_a)
        else:
            shrunk = lora_shrink(x2, layer.qerl_lora_a)  # one GEMM for all slices: [T, n*r]
            out = method.apply_with_lora(base, x2, bias, shrunk, layer.qerl_lora_b, mask, layer.qerl_slice_bounds)
        return out.view(*x.shape[:-1], out.shape[-1])
    return _apply_lora_single(layer, x, method.apply(base, x, bias))


def _apply_lora_single(self: Any, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """``output + mask * (x @ A_cat^T) @ B_blockdiag^T`` for vLLM's single adapter slot: two ops, two kernels
    on CUDA at decode token counts (the shrink; expand, token mask and residual add)."""
    out_shape = output.shape
    x2 = x.reshape(-1, x.shape[-1])
    out2 = output.reshape(-1, output.shape[-1])
    shrunk = lora_shrink(x2, self.qerl_lora_a)  # one GEMM for all slices: [T, n*r]
    return lora_expand(out2, shrunk, self.qerl_lora_b_t, self.qerl_token_mask[: x2.shape[0]]).view(out_shape)


# -- per-layer op count ---------------------------------------------------------------------------

# ops that only make a view (no kernel); what remains of a layer's top-level ops is one kernel launch each on CUDA
_VIEW_OPS = frozenset({"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::slice",
                       "aten::t", "aten::transpose", "aten::as_strided", "aten::expand", "aten::unsqueeze",
                       "aten::squeeze", "aten::select", "aten::alias", "aten::detach", "aten::flatten",
                       "aten::permute", "aten::numpy_T", "aten::lift_fresh", "aten::empty", "aten::empty_strided"})


def _top_level_ops(fn: Any, *args: Any) -> tuple[list[str], list[str]]:
    """The top-level non-view torch ops ``fn(*args)`` runs, and the device kernels it launches (none on CPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    ops, kernels = [], []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kernels.append(e.name)
        elif e.cpu_parent is None and "::" in e.name and e.name not in _VIEW_OPS:
            ops.append(e.name)
    return ops, kernels


def lora_layer_ops(model: Any, tokens: int | None = None) -> dict[str, dict[str, Any]]:
    """Per linear LoRA layer of ``model``: the top-level ops (and on CUDA the kernels) of one forward of ``tokens``
    tokens through ``layer.apply`` (``ops`` / ``kernels``: base GEMM and LoRA together), and what that adds to the
    base layer's ``quant_method.apply`` alone (``lora_ops`` / ``lora_kernels``; where the expand runs inside the
    GEMM, ``fused_expand``, the fused op replaces the base GEMM's, so the difference lists it in full).

    ``tokens`` defaults to the token count of the punica wrapper's current mapping (vLLM's own path indexes its
    per-token adapter slots, so it needs that count). Runs under ``torch.inference_mode``; the model's weights
    and adapter buffers are only read."""
    from collections import Counter

    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    out: dict[str, dict[str, Any]] = {}
    with torch.inference_mode():
        for name, layer in model.named_modules():
            if not isinstance(layer, BaseLinearLayerWithLoRA):
                continue
            base = layer.base_layer
            n = tokens if tokens is not None else int(layer.punica_wrapper.token_lora_indices.shape[0])
            a0 = layer.lora_a_stacked[0]
            x = torch.randn(n, a0.shape[-1], dtype=a0.dtype, device=a0.device)
            base_ops, base_kernels = _top_level_ops(layer._get_quant_method().apply, base, x, None)
            all_ops, all_kernels = _top_level_ops(layer.apply, x, None)
            lora_ops = Counter(all_ops) - Counter(base_ops)
            lora_kernels = Counter(all_kernels) - Counter(base_kernels)
            out[name] = {"fast_path": bool(getattr(layer, "qerl_lora_fast_path", False)), "tokens": n,
                         "fused_expand": bool(getattr(layer, "qerl_lora_fused", False)),
                         "method": type(base.quant_method).__name__,
                         "ops": sorted(all_ops), "kernels": sorted(all_kernels),
                         "lora_ops": sorted(lora_ops.elements()), "lora_kernels": sorted(lora_kernels.elements())}
    return out


# -- per-token adapter mask ---------------------------------------------------------------------


def attach_token_mask(wrapper: Any, dtype: torch.dtype) -> torch.Tensor:
    """The punica wrapper's ``[max_tokens, 1]`` mask (1: the token's request has the adapter in slot 0),
    created once per wrapper and refreshed by its ``update_metadata`` from its own token indices."""
    mask = wrapper.__dict__.get("qerl_token_mask")
    if mask is not None:
        return mask
    indices = wrapper._token_lora_indices
    mask = torch.zeros(indices.shape[0], 1, dtype=dtype, device=indices.device)
    update = wrapper.update_metadata

    @functools.wraps(update)
    def update_metadata(*args: Any, **kwargs: Any) -> Any:
        result = update(*args, **kwargs)
        mask.copy_(wrapper._token_lora_indices.ge(0).unsqueeze(1))
        return result

    wrapper.update_metadata = update_metadata
    wrapper.qerl_token_mask = mask
    return mask
