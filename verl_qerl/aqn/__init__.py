"""Adaptive Quantization Noise (AQN): the noise schedule and channel noise on named RMSNorm weights.

QeRL (arXiv 2510.11696, section 3.3) drives exploration by adding a channel-wise Gaussian vector
``Z ~ N(0, sigma^2)`` to the gain of every RMSNorm that feeds a quantized linear layer
(``input_layernorm`` -> q/k/v, ``post_attention_layernorm`` -> gate/up), which is the same as
row-wise multiplicative noise ``1 + Z/w`` on those weights at zero extra parameters. ``sigma``
follows a stage-wise decay over training, with a noise-free first stage.

This package imports only torch and works on ``name -> tensor`` mappings: the vLLM rollout model
gets the noise through a worker extension that passes ``model.named_parameters()``, and an HF/peft
model (e.g. for an offline entropy probe) through the same call. The noise goes to the rollout
engine only, as in the paper; the actor trains on the clean weights. It guarantees three things
that the authors' code does not:

* **Reproducible.** The noise of a tensor at a step is drawn on the CPU from a generator seeded
  by a stable hash of ``(seed, step, canonical tensor name)``: every tensor-parallel rank, every
  process and a resumed run get the same values, whatever the accelerator.
* **Non-accumulating.** Clean weights are snapshotted once; every ``apply`` writes
  ``clean + Z`` (never ``current + Z``) *in place* (``copy_``; vLLM's CUDA graphs hold the
  storage pointer), and ``restore`` writes the clean bits back exactly.
* **It lands.** In BF16 the grid spacing near 1 is 2^-7 ~ 7.8e-3, so round-to-nearest erases
  late-stage noise (sigma ~ 5e-4) entirely on weights near 1. Plain stochastic rounding keeps
  the mean right but overshoots the spread (the realized perturbation is 0 or one grid step, so
  its std grows like sqrt(sigma * spacing): ~3x sigma at the last stage). The default rounding
  is *variance-matched stochastic rounding*: stochastic rounding of ``clean + c * Z`` with a
  per-element ``c <= 1`` chosen so that the realized perturbation has mean 0 and std ``sigma``
  exactly (for a uniform local grid). See :func:`land_noise`.

The package splits by job: :mod:`.schedule` (settings and the sigma schedule), :mod:`.targets`
(which tensors, and their wrapper-free names), :mod:`.noise` (seeded draws), :mod:`.rounding`
(landing the noise in BF16) and :mod:`.apply` (in-place apply/restore on named tensors).
"""

from __future__ import annotations

from ._checks import AQNConfigError
from .apply import NormNoiser, noisy
from .noise import derive_seed, noise_for
from .rounding import ROUNDINGS, land_noise, matched_noise_scale, realized_std, sr_variance, stochastic_round
from .schedule import (
    APPLY_TO,
    DECAYING_SCHEDULES,
    SCHEDULES,
    AQNConfig,
    StageInfo,
    aqn_metrics,
    schedule_table,
    short_run,
    sigma_at,
    stage_bounds,
    stage_of,
    stage_sigma,
)
from .targets import DEFAULT_TARGETS, canonical_name, select_norm_tensors

__all__ = [
    "APPLY_TO",
    "DECAYING_SCHEDULES",
    "DEFAULT_TARGETS",
    "ROUNDINGS",
    "SCHEDULES",
    "AQNConfig",
    "AQNConfigError",
    "NormNoiser",
    "StageInfo",
    "aqn_metrics",
    "canonical_name",
    "derive_seed",
    "land_noise",
    "matched_noise_scale",
    "noise_for",
    "noisy",
    "realized_std",
    "select_norm_tensors",
    "short_run",
    "sigma_at",
    "sr_variance",
    "schedule_table",
    "stage_bounds",
    "stage_of",
    "stage_sigma",
    "stochastic_round",
]
