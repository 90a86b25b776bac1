"""Shard the frozen NVFP4 base across FSDP2 ranks: each rank keeps 1/N of the rows of every layer.

FSDP2 shards parameters and leaves buffers alone, so ``NVFP4Linear``'s uint8 buffers are replicated
on every rank unless they become parameters. :func:`shard_nvfp4_base` turns the packed codes and the
block scales of every ``NVFP4Linear`` into frozen uint8 Parameters (same names and bytes) and makes
each layer an FSDP2 unit of its own, before the caller applies ``fully_shard`` to the decoder layers
and the root as usual. FSDP2 then does for the base what it does for any parameter:

* each rank stores ``ceil(rows / N)`` rows of ``weight_packed`` and ``weight_scale`` (dim-0 shards);
* the layer's pre-forward hook all-gathers them (raw bytes: no cast, no arithmetic, so exact), the
  post-forward hook frees the gathered copy (``reshard_after_forward``), and the pre-backward hook
  gathers it again for the input gradient; the gathers run on FSDP's all-gather stream, overlapped
  with compute like every other unit's (implicitly in forward, by reverse-order prefetch in backward);
* ``CPUOffloadPolicy`` keeps the shards on the host and copies them in per layer.

Why a unit per layer and not the base inside the decoder layer's unit: a unit has one mixed-precision
policy, and FSDP2 casts every parameter of a unit to ``param_dtype`` before the all-gather (torch
2.11 even casts integer parameters; 2.13 skips them). The base's unit therefore gets a policy that
casts nothing; its bias (a frozen float parameter of the same module) is then gathered in its stored
dtype and cast to the input's dtype inside the op, the same rounding FSDP's cast would have done.

torch 2.11 (the GPU stack) also builds FSDP2's sharded parameter as ``nn.Parameter(dtensor)`` and only then
sets ``requires_grad``; the constructor's default ``requires_grad=True`` raises "only Tensors of floating point
dtype can require gradients" for a uint8 tensor (pytorch/pytorch#177844, fixed in later releases, which pass
``requires_grad`` to the constructor). :func:`shard_nvfp4_base` therefore makes that default ``False`` for
non-float tensors while it calls ``fully_shard`` (:func:`_integer_parameters_frozen_by_default`), and never
asks for a post-forward mesh (an int ``reshard_after_forward``), whose parameter has the same construction.

FSDP1 (``FullyShardedDataParallel``) is not handled here: it flattens parameters and cannot flatten
integer tensors, so under FSDP1 the base stays in (replicated) buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn

from .linear import NVFP4Linear

__all__ = ["base_bytes", "nvfp4_layers", "shard_nvfp4_base"]


def nvfp4_layers(model: nn.Module) -> list[tuple[str, NVFP4Linear]]:
    """The ``NVFP4Linear`` modules of ``model`` with their names, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, NVFP4Linear)]


def shard_nvfp4_base(
    model: nn.Module,
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = True,
    offload_policy: Any = None,
) -> list[NVFP4Linear]:
    """Make every ``NVFP4Linear`` of ``model`` an FSDP2 unit holding 1/N of its quantized rows.

    Call it before ``fully_shard`` is applied to the layers that contain them (FSDP2 is applied
    bottom-up: a later ``fully_shard(decoder_layer)`` manages the LoRA adapters, norms and the rest,
    and skips the parameters already in a unit). ``mesh``, ``reshard_after_forward`` and
    ``offload_policy`` should be the ones the rest of the model gets; the mixed-precision policy is
    fixed (nothing cast). Returns the layers sharded. Raises ``ValueError`` when ``model`` has no
    ``NVFP4Linear`` or when one of them is already an FSDP2 module.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    layers = nvfp4_layers(model)
    if not layers:
        raise ValueError(f"shard_nvfp4_base: {type(model).__name__} has no NVFP4Linear layer to shard")
    for name, layer in layers:
        if isinstance(layer, FSDPModule):
            raise ValueError(f"shard_nvfp4_base: layer {name!r} is already an FSDP2 module (sharded twice?)")
    no_cast = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None, output_dtype=None, cast_forward_inputs=False)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        reshard_after_forward = True  # an int asks for a smaller post-forward mesh: reshard fully instead
    with _integer_parameters_frozen_by_default():
        for _, layer in layers:
            layer.store_as_parameters()
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=no_cast,
                        offload_policy=offload_policy if offload_policy is not None else OffloadPolicy())
    return [layer for _, layer in layers]


@contextlib.contextmanager
def _integer_parameters_frozen_by_default() -> Iterator[None]:
    """Within: ``nn.Parameter(t)`` of a non-float ``t`` defaults to ``requires_grad=False`` (not ``True``).

    An explicit ``requires_grad`` is passed through unchanged, so torch versions that already pass it
    (or a float tensor) see no difference. Not thread-safe (module construction is single-threaded).
    """
    original = nn.Parameter.__dict__["__new__"]
    new = original.__func__

    def frozen_default(cls, data=None, requires_grad=True):
        if requires_grad and data is not None and not (data.is_floating_point() or data.is_complex()):
            requires_grad = False
        return new(cls, data, requires_grad)

    nn.Parameter.__new__ = staticmethod(frozen_default)
    try:
        yield
    finally:
        nn.Parameter.__new__ = original


def _local_nbytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def base_bytes(layers: Iterable[NVFP4Linear]) -> dict[str, int]:
    """Bytes of the quantized base this rank holds (``local``: its shards, padding included, plus the
    replicated global scales) and the unsharded total (``total``), over ``layers``.

    Only the stored state: a gathered copy that exists during a layer's forward or backward is not
    counted (see :func:`gathered_layers` to watch those).
    """
    local = total = 0
    for layer in layers:
        for name in NVFP4Linear.STORED:
            t = getattr(layer, name)
            local += _local_nbytes(t)
            total += t.numel() * t.element_size()  # a DTensor's numel is the global one
    return {"local": local, "total": total}


def gathered_layers(layers: Iterable[NVFP4Linear]) -> int:
    """How many of ``layers`` hold their full gathered rows now (the memory FSDP2 has not freed).

    FSDP2 frees a gathered parameter by shrinking its storage to 0 bytes while keeping the tensor, so a
    layer counts when its module attribute is a plain tensor with live storage.
    """
    count = 0
    for layer in layers:
        t = layer.weight_packed
        if not layer.is_sharded and t.untyped_storage().nbytes() > 0:
            count += 1
    return count
