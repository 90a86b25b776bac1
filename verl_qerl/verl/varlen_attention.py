"""Attention over packed sequences without flash-attn: a transformers attention function, ``qerl_varlen``.

verl's FSDP actor removes padding (``use_remove_padding=True``): each micro-batch becomes one row of packed
sequences, and the model needs an attention that keeps them apart. verl relies on flash-attn's varlen kernel
for that. Where the flash-attn package is missing (no wheel for the installed torch), the fallback so far was
SDPA on padded batches with an explicit mask, which rules out PyTorch's flash backend (no masks), computes the
whole square instead of its causal half, and pays for the padding rows in every layer.

PyTorch itself ships FlashAttention-2 for packed sequences (``torch.nn.attention.varlen.varlen_attn``, CUDA).
This module registers it with transformers under the name :data:`QERL_VARLEN`: select it with
``+actor_rollout_ref.model.override_config.attn_implementation=qerl_varlen`` and
``actor_rollout_ref.model.use_remove_padding=True`` (:func:`verl_qerl.verl.launch.varlen_overrides`). The
sequence boundaries come from the packed ``position_ids`` (a new sequence wherever the position does not
advance by one), computed once per forward. On CPU (tests, the CPU platform) the same function runs
PyTorch SDPA per sequence, which is also the reference the GPU path is tested against.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

#: The ``attn_implementation`` name this module registers with transformers.
QERL_VARLEN = "qerl_varlen"


class VarlenAttentionError(ValueError):
    """``qerl_varlen`` was asked for something it does not do (padded batches, dropout, sliding windows)."""


def packed_boundaries(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_len)`` of the sequences packed in ``position_ids`` of shape ``(1, T)``.

    A sequence starts at token 0 and wherever the position does not follow the previous one by +1 (verl's
    packed rows restart at 0). ``cu_seqlens`` is int32 ``[0, end_1, ..., T]``.
    """
    if position_ids is None:
        raise VarlenAttentionError(f"{QERL_VARLEN}: the model call has no position_ids; packed inputs need them "
                                   "(verl passes them with use_remove_padding=True)")
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise VarlenAttentionError(f"{QERL_VARLEN}: position_ids of shape {tuple(position_ids.shape)}; expected "
                                   "(1, total_tokens) of packed sequences (3-D rope positions are not supported)")
    pos = position_ids[0]
    total = pos.numel()
    new = torch.ones(total, dtype=torch.bool, device=pos.device)
    if total > 1:
        new[1:] = pos[1:] != pos[:-1] + 1
    starts = torch.nonzero(new).flatten().to(torch.int32)
    ends = torch.tensor([total], dtype=torch.int32, device=pos.device)
    cu = torch.cat([starts, ends])
    max_len = int((cu[1:] - cu[:-1]).max()) if total else 0
    return cu, max_len


class _BoundaryCache:
    """One entry: the boundaries of the position_ids tensor of the forward in flight.

    Every decoder layer (and the recomputed forward of gradient checkpointing) sees the same ``position_ids``
    object; the ``max_len`` needs a device-to-host copy, so it is taken once per forward, not per layer.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._ref: torch.Tensor | None = None
        self._value: tuple[torch.Tensor, int] | None = None

    def get(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        key = (id(position_ids), position_ids.data_ptr(), position_ids._version, tuple(position_ids.shape),
               position_ids.device)
        if self._key != key or self._ref is not position_ids:
            self._value = packed_boundaries(position_ids)
            self._key, self._ref = key, position_ids
        return self._value


_boundaries = _BoundaryCache()


def _sdpa_per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Reference path: causal SDPA on each packed sequence. ``q`` (T, H, D), ``k`` / ``v`` (T, Hkv, D)."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs = q[start:end].transpose(0, 1)
        ks = k[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        vs = v[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs, dim=0)


@functools.cache
def _varlen_attn() -> tuple[Callable, frozenset[str]]:
    """PyTorch's varlen attention and the names of its parameters (its signature changed across torch 2.10-2.13)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                  scale: float) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn``, causal, across the signatures of torch 2.10-2.13."""
    varlen_attn, params = _varlen_attn()
    kwargs: dict = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6):
        raise VarlenAttentionError(f"{QERL_VARLEN}: this torch's varlen_attn has no scale argument and the model "
                                   f"scales by {scale} (not 1/sqrt(head_dim))")
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, sliding_window: int | None = None,
                             softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` (1, H, T, D), ``key`` / ``value`` (1, Hkv, T, D).

    Returns ``(out, None)`` with ``out`` of shape (1, T, H, D), as transformers' own functions do.
    """
    if attention_mask is not None:
        raise VarlenAttentionError(f"{QERL_VARLEN}: got an attention mask, i.e. a padded batch; this attention "
                                   "serves packed rows only (set actor_rollout_ref.model.use_remove_padding=True)")
    if query.shape[0] != 1:
        raise VarlenAttentionError(f"{QERL_VARLEN}: batch of {query.shape[0]} rows; packed inputs are one row")
    if dropout:
        raise VarlenAttentionError(f"{QERL_VARLEN}: attention dropout {dropout} is not supported")
    if sliding_window is not None or softcap:
        raise VarlenAttentionError(f"{QERL_VARLEN}: sliding window {sliding_window} / softcap {softcap} are not "
                                   "supported (use flash_attention_2 or sdpa)")
    cu, max_len = _boundaries.get(kwargs.get("position_ids"))
    if int(query.shape[2]) != int(cu[-1]):
        raise VarlenAttentionError(f"{QERL_VARLEN}: {query.shape[2]} query tokens but position_ids cover "
                                   f"{int(cu[-1])}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, heads, D)
    if q.is_cuda:
        out = _torch_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, max_len, scale)
    else:
        out = _sdpa_per_sequence(q, k, v, cu, scale)
    return out.unsqueeze(0), None


def register() -> None:
    """Register :data:`QERL_VARLEN` with transformers (idempotent; needs no flash-attn)."""
    from transformers import AttentionInterface

    AttentionInterface.register(QERL_VARLEN, varlen_attention_forward)
