"""Per-(seed, step, tensor name) generators and the Gaussian noise and uniforms drawn from them."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import Tensor

from ._checks import check_sigma, check_step
from .targets import canonical_name

#: Part of every seed hash; changing it changes the noise of every run, so it is versioned.
_SEED_DOMAIN = "verl-qerl/aqn/v1"


def derive_seed(seed: int, step: int, name: str, stream: str = "noise") -> int:
    """A 63-bit generator seed from ``(seed, step, canonical name, stream)``.

    Uses BLAKE2b, not Python's ``hash()`` (salted per process for strings), so every process,
    rank and resumed run agrees. ``stream`` separates independent draws (the noise itself and
    the stochastic-rounding uniforms) for the same tensor and step.
    """
    text = "\x1f".join((_SEED_DOMAIN, stream, str(int(seed)), str(int(step)), canonical_name(name)))
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _generator(seed: int, step: int, name: str, stream: str) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(derive_seed(seed, step, name, stream))


def as_shape(shape: Iterable[int] | torch.Size) -> tuple[int, ...]:
    """A shape as a tuple of Python ints."""
    return tuple(int(d) for d in shape)


def noise_for(name: str, shape: Iterable[int] | torch.Size, sigma: float, seed: int, step: int) -> Tensor:
    """``Z ~ N(0, sigma^2)``, one value per channel of the tensor ``name``: fp32, on the CPU.

    Drawn on the CPU (in fp64, then scaled and rounded to fp32) from a generator seeded by
    :func:`derive_seed`, so the values do not depend on the accelerator, the rank, or the
    wrapper prefixes in ``name``. The same ``(seed, step, name)`` gives the same direction for
    any sigma (``noise_for(.., 2s, ..) == 2 * noise_for(.., s, ..)`` up to fp32 rounding).
    """
    sigma = check_sigma(sigma)
    check_step(step)
    generator = _generator(seed, step, name, "noise")
    standard = torch.randn(as_shape(shape), generator=generator, dtype=torch.float64)
    return (standard * sigma).to(torch.float32)


def uniform_for(name: str, shape: tuple[int, ...], seed: int, step: int) -> Tensor:
    """U[0, 1) in fp64 for stochastic rounding, from its own seeded stream."""
    return torch.rand(shape, generator=_generator(seed, step, name, "round"), dtype=torch.float64)

