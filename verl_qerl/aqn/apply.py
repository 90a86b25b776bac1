"""NormNoiser: writes AQN into named tensors in place and restores the clean bits."""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import bad, check_sigma, check_step, is_int
from .noise import as_shape, noise_for, uniform_for
from .rounding import ROUNDINGS, fine_dtype, land_noise
from .schedule import AQNConfig
from .targets import DEFAULT_TARGETS, canonical_name, select_norm_tensors, unmatched_targets


def _same(a: Tensor, b: Tensor) -> bool:
    """``torch.equal`` where NaN equals NaN at the same place: a NaN left in a tensor must not read as a
    change made behind the noiser's back."""
    if torch.equal(a, b):
        return True
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return bool(nan_a.any()) and torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])


def _check_finite(name: str, tensor: Tensor, when: str) -> None:
    """Noise on a NaN/inf weight stays non-finite, and such a snapshot could never be written back as "clean"."""
    count = int((~torch.isfinite(tensor)).sum())
    if count:
        raise ValueError(f"NormNoiser: {name!r} holds {count} non-finite value(s) (NaN/inf) {when}: noise on it "
                         "stays non-finite and it could not be restored as a clean weight; AQN needs finite weights "
                         "(a broken checkpoint or weight sync?)")


def _tensor_bytes(tensor: Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


@dataclass
class _Entry:
    name: str
    key: str  # canonical name: what the noise is keyed by
    live: Tensor  # the tensor as given: written in place
    clean: Tensor  # exact clone of live: same device, dtype and bits
    clean_cpu: Tensor  # the same bits on the CPU, for the noise arithmetic
    expected: Tensor | None = None  # what we last wrote; None while clean


class NormNoiser:
    """Adds AQN to a fixed set of named tensors, in place, and takes it off again.

    Works on any ``name -> tensor`` mapping (a vLLM model's RMSNorm weights, or the parameters
    of an unsharded HF/peft model), holding no model object. The clean values are
    snapshotted once; ``apply(step, sigma)`` writes ``clean + Z(seed, step, name)`` landed in
    the rounding dtype; ``restore()`` writes the clean bits back. Writes are ``copy_`` into the
    existing storage under ``no_grad`` (CUDA graphs keep their pointers; autograd still sees
    the version bump if a graph saved the weight, so misuse errors loudly).

    If a tensor changes behind the noiser's back (a weight sync or an optimizer step on a
    noisy weight), the next ``apply``/``restore`` raises instead of silently mixing states;
    call :meth:`refresh_clean` once the new value is the intended clean weight.

    """

    def __init__(
        self,
        tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
        *,
        seed: int = 0,
        rounding: str = "stochastic",
    ) -> None:
        if not is_int(seed):
            raise bad("seed", f"must be an int, got {seed!r}")
        if rounding not in ROUNDINGS:
            raise bad("rounding", f"unknown rounding {rounding!r}; choose one of {ROUNDINGS}")
        self.seed = seed
        self.rounding = rounding
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        if not items:
            raise ValueError("NormNoiser: no tensors given")
        self._entries: list[_Entry] = []
        seen: dict[str, str] = {}
        for name, tensor in items:
            key = canonical_name(name)
            if key in seen:
                raise ValueError(f"NormNoiser: {name!r} and {seen[key]!r} share the noise key {key!r}")
            seen[key] = name
            self._entries.append(self._make_entry(name, key, tensor))
        self._current: tuple[int, float] | None = None
        self._stats = {"qerl/aqn_sigma_effective": 0.0, "qerl/aqn_changed_frac": 0.0}

    def _make_entry(self, name: str, key: str, tensor: Tensor) -> _Entry:
        if hasattr(tensor, "placements"):
            raise TypeError(f"NormNoiser: {name!r} is a sharded DTensor; AQN writes the rollout engine's plain "
                            "tensors (pass unsharded tensors)")
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"NormNoiser: {name!r} has dtype {tensor.dtype}; need a floating dtype")
        if tensor.numel() == 0:
            raise ValueError(f"NormNoiser: {name!r} is empty")
        clean = tensor.detach().clone()
        _check_finite(name, clean, "at construction")
        return _Entry(name, key, tensor, clean, clean.to("cpu"))

    @classmethod
    def from_config(
        cls,
        named_tensors: Iterable[tuple[str, Tensor]],
        cfg: AQNConfig,
    ) -> NormNoiser:
        """Select the AQN targets of ``named_tensors`` (e.g. ``model.named_parameters()``)."""
        named = list(named_tensors)
        chosen = set(select_norm_tensors(named, cfg))
        missing = unmatched_targets([n for n, _ in named], cfg)
        if missing:  # one misspelled entry must not pass because another one matches
            sample = [n for n, _ in named[:8]]
            raise ValueError(
                f"AQN: no tensor matches {'; '.join(missing)} (targets are module names under layers.N, e.g. "
                f"{', '.join(DEFAULT_TARGETS)}); {len(chosen)} tensor(s) matched the rest; first names seen: {sample}"
            )
        picked = [(n, t) for n, t in named if n in chosen]
        return cls(picked, seed=cfg.seed, rounding=cfg.rounding)

    # -- introspection -------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """Tensor names as given, in order."""
        return tuple(e.name for e in self._entries)

    @property
    def current(self) -> tuple[int, float] | None:
        """``(step, sigma)`` of the last :meth:`apply` (sigma ``0.0``: it wrote the clean values); ``None``
        before any apply and after :meth:`restore` / :meth:`refresh_clean`."""
        return self._current

    def __len__(self) -> int:
        return len(self._entries)

    def checksum(self) -> str:
        """BLAKE2b hex digest of the bytes the tensors hold now."""
        h = hashlib.blake2b(digest_size=16)
        for e in self._entries:
            h.update(f"{e.key}|{e.live.dtype}|{tuple(e.live.shape)}|".encode())
            h.update(_tensor_bytes(e.live))
        return h.hexdigest()

    def clean_checksum(self) -> str:
        """Digest, like :meth:`checksum`, of the clean snapshot."""
        h = hashlib.blake2b(digest_size=16)
        for e in self._entries:
            h.update(f"{e.key}|{e.clean.dtype}|{tuple(e.clean.shape)}|".encode())
            h.update(_tensor_bytes(e.clean))
        return h.hexdigest()

    def metrics(self) -> dict[str, float]:
        """What the last ``apply`` really wrote: std of ``noisy - clean`` over all targeted
        elements, and the fraction of elements whose stored value changed."""
        return dict(self._stats)

    # -- writing -------------------------------------------------------------------------

    def _verify_untouched(self) -> None:
        for e in self._entries:
            expected = e.clean if e.expected is None else e.expected
            if not _same(e.live.detach(), expected):
                raise RuntimeError(
                    f"AQN: {e.name!r} changed outside NormNoiser since its last apply/restore "
                    "(a weight sync, or an update of a noisy weight?). If its current value is the "
                    "intended clean weight, call refresh_clean(); otherwise restore before updating."
                )

    def apply(self, step: int, sigma: float) -> None:
        """Write ``clean + Z(seed, step, name)`` into every tensor, in place.

        Always computed from the clean snapshot, so repeated calls never accumulate; sigma 0
        writes the clean values.
        """
        step = check_step(step)
        sigma = check_sigma(sigma)
        self._verify_untouched()
        if sigma == 0.0:
            self._write_clean()
            self._current = (step, 0.0)  # clean values, but a step was applied (see ``current``)
            return
        # One land_noise call per storage dtype: the per-call cost of the rounding setup is then
        # paid once per step, not once per tensor.
        groups: dict[torch.dtype, list[_Entry]] = {}
        for e in self._entries:
            groups.setdefault(e.clean_cpu.dtype, []).append(e)
        sum_sq, count, changed = 0.0, 0, 0
        with torch.no_grad():
            for target, entries in groups.items():
                needs_uniform = self.rounding != "nearest" and not fine_dtype(target)
                zs, uniforms = [], []
                for e in entries:
                    shape = as_shape(e.clean_cpu.shape)
                    zs.append(noise_for(e.key, shape, sigma, self.seed, step).reshape(-1))
                    if needs_uniform:
                        uniforms.append(uniform_for(e.key, shape, self.seed, step).reshape(-1))
                clean = torch.cat([e.clean_cpu.reshape(-1) for e in entries])
                uniform = torch.cat(uniforms) if needs_uniform else None
                values = land_noise(clean, torch.cat(zs), sigma, target, self.rounding, uniform)
                values = values.to(clean.dtype)
                delta = values.to(torch.float64) - clean.to(torch.float64)
                sum_sq += float((delta * delta).sum())
                count += delta.numel()
                changed += int((values != clean).sum())
                for e, part in zip(entries, values.split([e.clean_cpu.numel() for e in entries])):
                    live = e.live
                    on_device = part.reshape(live.shape).to(live.device)
                    live.copy_(on_device)
                    e.expected = on_device
        self._current = (step, sigma)
        self._stats = {
            "qerl/aqn_sigma_effective": math.sqrt(sum_sq / count) if count else 0.0,
            "qerl/aqn_changed_frac": changed / count if count else 0.0,
        }

    def _write_clean(self) -> None:
        with torch.no_grad():
            for e in self._entries:
                e.live.copy_(e.clean)
                e.expected = None
        self._current = None
        self._stats = {"qerl/aqn_sigma_effective": 0.0, "qerl/aqn_changed_frac": 0.0}

    def restore(self) -> None:
        """Write the clean snapshot back, bit-exactly and in place."""
        self._verify_untouched()
        self._write_clean()

    def refresh_clean(self) -> None:
        """Take externally written values as the new clean snapshot, and drop this noiser's noise.

        For after a framework wrote new clean weights (a full weight sync; trainable norms
        updated after ``restore``): a tensor that changed since the last apply/restore is
        adopted as clean; a tensor that still holds this noiser's noise gets its clean value
        back (never adopted, which would bake the noise in).
        """
        # decide, and refuse a non-finite new snapshot, before writing anything: a refusal leaves every
        # tensor and snapshot as it was
        adopt = [e.expected is None or not _same(e.live.detach(), e.expected) for e in self._entries]
        for e, new in zip(self._entries, adopt):
            if new:
                _check_finite(e.name, e.live.detach(), "to adopt as clean in refresh_clean")
        with torch.no_grad():
            for e, new in zip(self._entries, adopt):
                live = e.live
                if new:
                    e.clean = live.detach().clone()
                    e.clean_cpu = e.clean.to("cpu")
                else:
                    live.copy_(e.clean)
                e.expected = None
        self._current = None
        self._stats = {"qerl/aqn_sigma_effective": 0.0, "qerl/aqn_changed_frac": 0.0}



@contextlib.contextmanager
def noisy(noiser: NormNoiser, step: int, sigma: float) -> Iterator[NormNoiser]:
    """Apply the noise of ``step`` for the duration of the block, then restore.

    Put the forward *and* the backward inside the block: restoring in place before backward
    changes weights autograd may have saved (it raises if the norms require grad).
    """
    noiser.apply(step, sigma)
    try:
        yield noiser
    finally:
        noiser.restore()
