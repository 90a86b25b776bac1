"""Adaptive Quantization Noise (AQN): the noise schedule and channel noise on named RMSNorm weights.

QeRL (arXiv 2510.11696, section 3.3) drives exploration by adding a channel-wise Gaussian vector
``Z ~ N(0, sigma^2)`` to the gain of every RMSNorm that feeds a quantized linear layer
(``input_layernorm`` -> q/k/v, ``post_attention_layernorm`` -> gate/up), which is the same as
row-wise multiplicative noise ``1 + Z/w`` on those weights at zero extra parameters. ``sigma``
follows a stage-wise decay over training, with a noise-free first stage.

This module imports only torch and works on ``name -> tensor`` mappings, so one implementation
serves the training model (HF / peft / FSDP2) and the vLLM rollout model (through a worker
extension that passes ``model.named_parameters()``). It guarantees three things that the
authors' code does not:

* **Reproducible.** The noise of a tensor at a step is drawn on the CPU from a generator seeded
  by a stable hash of ``(seed, step, canonical tensor name)``: every tensor-parallel rank, every
  process, a resumed run, and the actor and the rollout engine get the same values, whatever the
  accelerator.
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "APPLY_TO",
    "DEFAULT_TARGETS",
    "ROUNDINGS",
    "SCHEDULES",
    "AQNConfig",
    "AQNConfigError",
    "NormNoiser",
    "StageInfo",
    "aqn_metrics",
    "attach_training_noise",
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

#: Decay shapes over stages 1..K-1 (stage 0 is always noise-free). "exponential" is the paper's.
SCHEDULES = ("exponential", "linear", "cosine", "constant", "none")
#: The schedules that go from sigma_start to sigma_end (the others ignore sigma_end).
DECAYING_SCHEDULES = ("exponential", "linear", "cosine")
#: "rollout": only the sampling engine is noisy (the paper). "both": the actor also computes old
#: log-probs and updates with the rollout's noise, so sampling and training see one policy.
APPLY_TO = ("rollout", "both")
#: How clean + Z lands in a low-precision dtype; see :func:`land_noise`.
ROUNDINGS = ("stochastic", "stochastic_plain", "nearest")
#: RMSNorms whose gain feeds a quantized linear layer (q/k/v and gate/up) [P section 3.3].
DEFAULT_TARGETS = ("input_layernorm", "post_attention_layernorm")

#: Part of every seed hash; changing it changes the noise of every run, so it is versioned.
_SEED_DOMAIN = "verl-qerl/aqn/v1"


class AQNConfigError(ValueError):
    """A bad AQN setting; the message starts with the offending key."""


def _bad(key: str, why: str) -> AQNConfigError:
    return AQNConfigError(f"{key}: {why}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_total_steps(total_steps: Any, key: str = "total_steps") -> int:
    if not _is_int(total_steps):
        raise _bad(key, f"must be an int > 0, got {total_steps!r}")
    if total_steps <= 0:
        raise _bad(key, f"must be > 0, got {total_steps}")
    return total_steps


def _check_step(step: Any) -> int:
    if not _is_int(step) or step < 0:
        raise _bad("step", f"must be an int >= 0 (verl's global_steps starts at 1), got {step!r}")
    return step


def _check_sigma(sigma: Any) -> float:
    if not _is_real(sigma) or not math.isfinite(sigma) or sigma < 0:
        raise _bad("sigma", f"must be a finite number >= 0, got {sigma!r}")
    return float(sigma)


@dataclass(frozen=True)
class AQNConfig:
    """AQN settings. Validated on construction, so an instance is always usable.

    Defaults are the paper's Table 4 (sigma 1e-2 -> 5e-4 over K = 10 stages, exponential).
    ``total_steps`` may stay ``None`` when the trainer supplies it (verl's
    ``total_training_steps``); the schedule functions then need it as an argument.
    """

    enable: bool = True
    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    num_stages: int = 10
    schedule: str = "exponential"
    seed: int = 0
    apply_to: str = "rollout"
    targets: tuple[str, ...] = DEFAULT_TARGETS
    include_final_norm: bool = False
    rounding: str = "stochastic"
    total_steps: int | None = None

    def __post_init__(self) -> None:
        targets = self.targets
        if isinstance(targets, str) or not isinstance(targets, Iterable):
            raise _bad("targets", f"must be a list of module names, got {targets!r}")
        object.__setattr__(self, "targets", tuple(targets))
        self.validate()

    def validate(self, total_steps: int | None = None) -> AQNConfig:
        """Raise :class:`AQNConfigError` naming the first bad key; return ``self``.

        ``total_steps`` (optional) checks a run length supplied by the trainer as well.
        """
        if not isinstance(self.enable, bool):
            raise _bad("enable", f"must be true or false, got {self.enable!r}")
        if self.schedule not in SCHEDULES:
            raise _bad("schedule", f"unknown schedule {self.schedule!r}; choose one of {SCHEDULES}")
        for key in ("sigma_start", "sigma_end"):
            value = getattr(self, key)
            if not _is_real(value) or not math.isfinite(value):
                raise _bad(key, f"must be a finite number, got {value!r}")
            if self.schedule == "exponential" and value <= 0:
                raise _bad(key, f"must be > 0 for the exponential schedule, got {value!r}")
            if value < 0:
                raise _bad(key, f"must be >= 0, got {value!r}")
        if self.schedule in DECAYING_SCHEDULES and self.sigma_end > self.sigma_start:
            raise _bad("sigma_end", f"{self.sigma_end!r} is above sigma_start={self.sigma_start!r}: the noise would "
                       "rise during training, where AQN decays it (swap the two, or use schedule=constant)")
        if not _is_int(self.num_stages):
            raise _bad("num_stages", f"must be an int >= 3, got {self.num_stages!r}")
        if self.num_stages < 3:
            raise _bad(
                "num_stages",
                f"must be >= 3 (stage 0 is noise-free and the decay needs two more), got {self.num_stages}",
            )
        if not _is_int(self.seed):
            raise _bad("seed", f"must be an int, got {self.seed!r}")
        if self.apply_to not in APPLY_TO:
            raise _bad("apply_to", f"unknown value {self.apply_to!r}; choose one of {APPLY_TO}")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise _bad("targets", f"must be a non-empty list of module names, got {self.targets!r}")
        if not isinstance(self.include_final_norm, bool):
            raise _bad("include_final_norm", f"must be true or false, got {self.include_final_norm!r}")
        if self.rounding not in ROUNDINGS:
            raise _bad("rounding", f"unknown rounding {self.rounding!r}; choose one of {ROUNDINGS}")
        if self.total_steps is not None:
            _check_total_steps(self.total_steps)
            short = short_run(self.total_steps, self)
            if short:
                raise _bad("total_steps", f"{self.total_steps} is fewer than num_stages={self.num_stages}: {short}; "
                           f"run at least {self.num_stages} steps, lower num_stages (>= 3) or disable AQN")
        if total_steps is not None:
            _check_total_steps(total_steps)
        return self

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> AQNConfig:
        """Build from a plain or OmegaConf mapping; unknown keys are errors (typos must not pass)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise _bad(unknown[0], f"unknown AQN key; known keys are {sorted(known)}")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (targets as a list) for logging and config round trips."""
        out = dataclasses.asdict(self)
        out["targets"] = list(self.targets)
        return out

    @property
    def noise_on_actor(self) -> bool:
        """Whether the training model also gets the noise (``apply_to == "both"``)."""
        return self.enable and self.apply_to == "both"

    def resolve_total_steps(self, total_steps: int | None) -> int:
        """The run length to use: the argument if given, else ``self.total_steps``."""
        if total_steps is None:
            if self.total_steps is None:
                raise _bad("total_steps", "unknown: pass it, or set AQNConfig.total_steps")
            return self.total_steps
        return _check_total_steps(total_steps)


# --------------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------------


def short_run(total_steps: int, cfg: AQNConfig) -> str | None:
    """What goes wrong when a run of ``total_steps`` is shorter than ``cfg.num_stages``, or None.

    Step ``s`` of ``T < K`` lands in stage ``(s - 1) K // T``, so only ``T`` of the ``K`` stages get
    a step, one of them the noise-free stage 0: most of the decay is skipped, and a one-step run
    gets no noise at all.
    """
    if not cfg.enable or cfg.schedule == "none" or total_steps >= cfg.num_stages:
        return None
    if total_steps <= 1:
        return "the only step is in stage 0, which is noise-free, so the run gets no noise at all"
    return (f"only {total_steps} of the {cfg.num_stages} stages get a step (stage 0 noise-free), so most of the "
            "noise schedule is skipped")


class StageInfo(NamedTuple):
    """One row of :func:`schedule_table`: steps ``first..last`` (1-based, inclusive) use ``sigma``.

    ``first > last`` marks a stage that gets no step (only when ``total_steps < num_stages``).
    """

    stage: int
    first_step: int
    last_step: int
    sigma: float


def stage_of(step: int, total_steps: int, num_stages: int) -> int:
    """The stage (0..K-1) of a training step.

    Steps are 1-based as verl's ``global_steps``: step ``s`` in ``1..T`` lies in stage
    ``floor((s - 1) * K / T)``, so the T steps split into K stages whose sizes differ by at most
    one (exactly T/K each when K divides T; then this equals the paper's
    ``floor((s - 1) / floor(T / K))``). Step 0 (verl's weight sync before the first step) is
    stage 0; steps past T (a run extended beyond its planned length) clamp to the last stage.
    With ``T < K`` some stages get no step.
    """
    _check_step(step)
    _check_total_steps(total_steps)
    if not _is_int(num_stages) or num_stages < 1:
        raise _bad("num_stages", f"must be an int >= 1, got {num_stages!r}")
    if step == 0:
        return 0
    return min((step - 1) * num_stages // total_steps, num_stages - 1)


def stage_bounds(stage: int, total_steps: int, num_stages: int) -> tuple[int, int]:
    """First and last step (1-based, inclusive) of ``stage``; the inverse of :func:`stage_of`.

    The last stage ends at ``total_steps`` (later steps also map to it, by clamping).
    """
    _check_total_steps(total_steps)
    if not _is_int(stage) or not 0 <= stage < num_stages:
        raise _bad("stage", f"must be an int in [0, {num_stages}), got {stage!r}")
    first = -(-stage * total_steps // num_stages) + 1
    last = -(-(stage + 1) * total_steps // num_stages)
    return first, last


def stage_sigma(stage: int, cfg: AQNConfig) -> float:
    """The noise std of a stage.

    Stage 0 is noise-free (the quantization error alone explores, Algorithm 1 of the paper).
    Stages ``k = 1..K-1`` use, for the exponential schedule,
    ``sigma_k = sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 2))``,
    which starts at ``sigma_start`` in stage 1 and reaches ``sigma_end`` exactly in the last
    stage. This is the authors' released code (K - 1 values spaced by ``arange(K-1) / (K-2)``).
    The paper's Eq. 8 writes the exponent as ``(k - 1) / (K - 1)``, which never reaches
    ``sigma_end`` (it stops one ratio step short); we follow the code so that ``sigma_end``
    means what it says. ``linear`` and ``cosine`` interpolate between the same end points with
    the same ``t = (k - 1) / (K - 2)``; ``constant`` holds ``sigma_start``; ``none`` is zero.
    """
    num_stages = cfg.num_stages
    if not _is_int(stage) or not 0 <= stage < num_stages:
        raise _bad("stage", f"must be an int in [0, {num_stages}), got {stage!r}")
    if not cfg.enable or cfg.schedule == "none" or stage == 0:
        return 0.0
    start, end = float(cfg.sigma_start), float(cfg.sigma_end)
    if cfg.schedule == "constant":
        return start
    if stage == 1:  # exact end points, free of pow/cos rounding
        return start
    if stage == num_stages - 1:
        return end
    t = (stage - 1) / (num_stages - 2)
    if cfg.schedule == "exponential":
        return start * (end / start) ** t
    if cfg.schedule == "linear":
        return start + (end - start) * t
    if cfg.schedule == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * t))
    raise AssertionError(f"unhandled schedule {cfg.schedule!r}")  # validate() makes this unreachable


def sigma_at(step: int, total_steps: int | None, cfg: AQNConfig) -> float:
    """The noise std to use for training step ``step`` (1-based; see :func:`stage_of`).

    ``total_steps=None`` takes ``cfg.total_steps``.
    """
    total = cfg.resolve_total_steps(total_steps)
    return stage_sigma(stage_of(step, total, cfg.num_stages), cfg)


def schedule_table(total_steps: int | None, cfg: AQNConfig) -> list[StageInfo]:
    """Every stage with its step range and sigma, e.g. to log the plan at start-up."""
    total = cfg.resolve_total_steps(total_steps)
    return [StageInfo(k, *stage_bounds(k, total, cfg.num_stages), stage_sigma(k, cfg)) for k in range(cfg.num_stages)]


def aqn_metrics(step: int, total_steps: int | None, cfg: AQNConfig) -> dict[str, float]:
    """Scalars for the trainer's logger at ``step``: the scheduled sigma and the stage."""
    total = cfg.resolve_total_steps(total_steps)
    stage = stage_of(step, total, cfg.num_stages)
    return {"qerl/aqn_sigma": stage_sigma(stage, cfg), "qerl/aqn_stage": float(stage)}


# --------------------------------------------------------------------------------------------
# Names: which tensors get noise, and the name the noise is keyed by
# --------------------------------------------------------------------------------------------

#: Path segments that wrappers insert and that must not change the noise of a tensor.
_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
#: Leading paths added by wrappers: DDP (``module.``) and peft (``base_model.model.``).
_WRAPPER_PREFIXES = ("module.", "base_model.model.")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.\d+\.")


def canonical_name(name: str) -> str:
    """The name noise is keyed by: wrapper segments and prefixes removed.

    ``base_model.model.model.layers.0.input_layernorm.weight`` (peft),
    ``_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.input_layernorm.weight`` (FSDP1)
    and vLLM's ``model.layers.0.input_layernorm.weight`` all map to the last one, so the actor
    and the rollout engine draw the same noise for the same weight.
    """
    parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
    out = ".".join(parts)
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if out.startswith(prefix):
                out = out[len(prefix) :]
                changed = True
    return out


def _target_regex(cfg: AQNConfig) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(t) for t in cfg.targets)
    return re.compile(rf"(?:^|\.)layers\.\d+\.(?:{alternatives})\.weight$")


def _is_final_norm(key: str) -> bool:
    return (key == "norm.weight" or key.endswith(".norm.weight")) and not _LAYER_RE.search(key)


def select_norm_tensors(named: Iterable[tuple[str, Any]] | Iterable[str], cfg: AQNConfig) -> list[str]:
    """Names (as given, in order) of the RMSNorm weights AQN perturbs.

    Matches ``...layers.N.<target>.weight`` for each of ``cfg.targets`` (default
    ``input_layernorm`` and ``post_attention_layernorm``) and, with ``include_final_norm``, the
    final ``...norm.weight`` outside the layer stack. ``q_norm``/``k_norm`` are not targets:
    they feed no quantized layer. Accepts ``named_parameters()`` pairs or bare names.
    """
    pattern = _target_regex(cfg)
    out = []
    for item in named:
        name = item if isinstance(item, str) else item[0]
        key = canonical_name(name)
        if pattern.search(key) or (cfg.include_final_norm and _is_final_norm(key)):
            out.append(name)
    return out


# --------------------------------------------------------------------------------------------
# Seeds and noise
# --------------------------------------------------------------------------------------------


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


def _shape(shape: Iterable[int] | torch.Size) -> tuple[int, ...]:
    return tuple(int(d) for d in shape)


def noise_for(name: str, shape: Iterable[int] | torch.Size, sigma: float, seed: int, step: int) -> Tensor:
    """``Z ~ N(0, sigma^2)``, one value per channel of the tensor ``name``: fp32, on the CPU.

    Drawn on the CPU (in fp64, then scaled and rounded to fp32) from a generator seeded by
    :func:`derive_seed`, so the values do not depend on the accelerator, the rank, or the
    wrapper prefixes in ``name``. The same ``(seed, step, name)`` gives the same direction for
    any sigma (``noise_for(.., 2s, ..) == 2 * noise_for(.., s, ..)`` up to fp32 rounding).
    """
    sigma = _check_sigma(sigma)
    _check_step(step)
    generator = _generator(seed, step, name, "noise")
    standard = torch.randn(_shape(shape), generator=generator, dtype=torch.float64)
    return (standard * sigma).to(torch.float32)


def _uniform_for(name: str, shape: tuple[int, ...], seed: int, step: int) -> Tensor:
    """U[0, 1) in fp64 for stochastic rounding, from its own seeded stream."""
    return torch.rand(shape, generator=_generator(seed, step, name, "round"), dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# Landing clean + Z in a low-precision dtype
# --------------------------------------------------------------------------------------------

#: Above this, E[frac(t)(1 - frac(t))] for t ~ N(0, a^2) equals 1/6 to fp64 precision
#: (the periodic correction decays like exp(-2 pi^2 a^2)).
_SR_SATURATED = 1.5
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _fine_dtype(dtype: torch.dtype) -> bool:
    """fp32/fp64: spacing ~1e-7 relative, far below any useful sigma, so no rounding tricks."""
    return dtype.is_floating_point and torch.finfo(dtype).eps <= 2.0**-23


def sr_variance(a: Tensor) -> Tensor:
    """``E[K^2]`` where ``K`` is ``t ~ N(0, a^2)`` stochastically rounded to an integer.

    ``E[K^2] = a^2 + E[frac(t) (1 - frac(t))]``: the Gaussian's variance plus the rounding's own
    variance. Computed in closed form from truncated-normal moments over the unit intervals
    (the integrand is even in t, so only ``t >= 0`` is summed, twice). It rises from
    ``a * sqrt(2/pi)`` for tiny ``a`` to ``a^2 + 1/6`` for ``a >= 1.5``; it is increasing, which
    :func:`matched_noise_scale` inverts.
    """
    a = a.to(torch.float64)
    out = a * a + 1.0 / 6.0
    small = (a > 0) & (a < _SR_SATURATED)
    out = torch.where(a <= 0, torch.zeros_like(a), out)
    if bool(small.any()):
        s = a[small][:, None]
        k = torch.arange(math.ceil(12 * _SR_SATURATED) + 2, dtype=torch.float64)
        alpha, beta = k / s, (k + 1) / s
        pdf_a = _INV_SQRT_2PI * torch.exp(-0.5 * alpha * alpha)
        pdf_b = _INV_SQRT_2PI * torch.exp(-0.5 * beta * beta)
        m0 = torch.special.ndtr(-alpha) - torch.special.ndtr(-beta)  # P(k <= t < k + 1)
        m1 = s * (pdf_a - pdf_b)  # E[t; k <= t < k + 1]
        m2 = s * s * (m0 + alpha * pdf_a - beta * pdf_b)  # E[t^2; ...]
        # (t - k)(k + 1 - t) = -t^2 + (2k + 1) t - k (k + 1)
        per_interval = -m2 + (2 * k + 1) * m1 - k * (k + 1) * m0
        out[small] = (s * s).squeeze(1) + 2.0 * per_interval.sum(dim=1)
    return out


def _neighbours(values: Tensor) -> tuple[Tensor, Tensor]:
    """Next representable value below and above, in the values' own dtype."""
    inf = torch.full_like(values, math.inf)
    return torch.nextafter(values, -inf), torch.nextafter(values, inf)


def _scale_for_spacings(sigma: float, up: Tensor, down: Tensor) -> Tensor:
    """Solve ``(up^2 V(c sigma / up) + down^2 V(c sigma / down)) / 2 = sigma^2`` for ``c``.

    ``V`` is :func:`sr_variance`; the left side is increasing in ``c`` and at ``c = 1`` is at
    least ``sigma^2`` (``V(a) >= a^2``), so ``c`` lies in (0, 1]: bisection, elementwise.
    """
    target = sigma * sigma
    lo = torch.zeros_like(up)
    hi = torch.ones_like(up)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        var = 0.5 * (up * up * sr_variance(mid * sigma / up) + down * down * sr_variance(mid * sigma / down))
        below = var < target
        lo = torch.where(below, mid, lo)
        hi = torch.where(below, hi, mid)
    return 0.5 * (lo + hi)


@functools.lru_cache(maxsize=256)
def _scale_table(sigma: float, e_lo: int, e_hi: int, d_lo: int, d_hi: int) -> Tensor:
    """``c`` for spacing ``2^(e-1)`` above and ``2^(e-1-d)`` below, flattened over (e, d).

    Cached: sigma is constant within a stage, so the bisection runs about once per stage.
    Callers must not modify the returned tensor.
    """
    ups = torch.arange(e_lo, e_hi + 1, dtype=torch.float64)[:, None].expand(-1, d_hi - d_lo + 1)
    downs = ups - torch.arange(d_lo, d_hi + 1, dtype=torch.float64)[None, :]
    half = torch.full_like(ups, 0.5)
    return _scale_for_spacings(sigma, torch.ldexp(half, ups), torch.ldexp(half, downs)).reshape(-1)


def matched_noise_scale(clean: Tensor, sigma: float, dtype: torch.dtype) -> Tensor:
    """Per-element ``c`` in (0, 1] such that stochastic rounding of ``clean + c * Z`` to
    ``dtype``, with ``Z ~ N(0, sigma^2)``, moves the value by a perturbation of mean 0 and
    variance ``sigma^2``.

    Why: with local grid spacing ``u`` and ``Z = sigma * n``, stochastic rounding of
    ``clean + y``, ``y ~ N(0, (a u)^2)``, moves the value by ``u * K`` with
    ``E[K] = 0`` and ``E[K^2] = sr_variance(a)`` (the Gaussian's variance *plus* the rounding's
    own). Solving for the ``a`` that gives ``sigma^2`` yields ``c = a u / sigma``. For
    ``sigma >> u`` this tends to ``sqrt(1 - u^2 / (6 sigma^2)) -> 1``; for ``sigma << u`` the
    value moves by one grid step with probability ~ ``(sigma / u)^2``. The spacing above and
    below ``clean`` differ by 2x at a power of two (1.0 is one: every RMSNorm gain at init);
    one common ``c`` for both sides keeps the mean exactly 0 and matches the variance averaged
    over the sign of ``Z``. Exact when ``clean`` is on the grid and ``clean + c Z`` stays in
    its binade; close otherwise.
    """
    grid = clean.to(torch.float64).to(dtype)
    below, above = _neighbours(grid)
    grid64 = grid.to(torch.float64)
    up = above.to(torch.float64) - grid64
    down = grid64 - below.to(torch.float64)
    ok = torch.isfinite(up) & torch.isfinite(down) & (up > 0) & (down > 0)
    if sigma <= 0 or not bool(ok.any()):
        return torch.ones_like(grid64)
    # Spacings are powers of two, so c takes one value per (exponent above, exponent below)
    # pair present (a handful): solve on a small dense table and gather. Elements without a
    # usable grid (non-finite) get c = 1 through a placeholder spacing of 1.
    _, e_up = torch.frexp(torch.where(ok, up, 1.0))
    _, e_down = torch.frexp(torch.where(ok, down, 1.0))
    e_lo, e_hi = int(e_up.min()), int(e_up.max())
    d = e_up - e_down  # 0 inside a binade, 1 at a power of two
    d_lo, d_hi = int(d.min()), int(d.max())
    table = _scale_table(float(sigma), e_lo, e_hi, d_lo, d_hi)
    index = (e_up - e_lo).long() * (d_hi - d_lo + 1) + (d - d_lo).long()
    return torch.where(ok, table[index], 1.0)


def stochastic_round(x: Tensor, dtype: torch.dtype, uniform: Tensor) -> Tensor:
    """Round ``x`` (fp64) to ``dtype``: up with probability (x - lo) / (hi - lo), so E[out] = x.

    ``uniform`` holds U[0, 1) draws of ``x``'s shape (from a seeded generator, so every rank
    rounds the same way). Values already on the grid stay put; non-finite values round to
    nearest.
    """
    x = x.to(torch.float64)
    cand = x.to(dtype)
    below, above = _neighbours(cand)
    is_low = cand.to(torch.float64) <= x
    lo = torch.where(is_low, cand, below)
    hi = torch.where(is_low, above, cand)
    lo64, hi64 = lo.to(torch.float64), hi.to(torch.float64)
    p_up = (x - lo64) / (hi64 - lo64)
    out = torch.where(uniform < p_up, hi, lo)
    finite = torch.isfinite(lo64) & torch.isfinite(hi64) & torch.isfinite(x)
    return torch.where(finite, out, cand)


def land_noise(
    clean: Tensor,
    z: Tensor,
    sigma: float,
    dtype: torch.dtype,
    rounding: str = "stochastic",
    uniform: Tensor | None = None,
) -> Tensor:
    """``clean + z`` represented in ``dtype`` (CPU in, CPU out), so that the noise survives.

    * fp32 / fp64 ``dtype``: written exactly as ``clean + z`` in that dtype (any rounding).
    * ``"stochastic"`` (default): variance-matched stochastic rounding of ``clean + c * z``
      (:func:`matched_noise_scale`): mean perturbation 0 and std ``sigma`` at every weight
      magnitude; the perturbation keeps the sign of ``z`` and is ``E[.|z] = c z``.
    * ``"stochastic_plain"``: textbook stochastic rounding of ``clean + z``
      (``E[out | z] = clean + z``), whose std overshoots ``sigma`` when sigma is below the
      grid spacing (it adds the rounding's own variance, up to ``spacing^2 / 4``).
    * ``"nearest"``: ``(clean + z)`` in fp32 then round-to-nearest-even, as the authors' code
      does in BF16; erases noise below half the grid spacing. For ablations only.

    ``uniform``: U[0, 1) draws for the stochastic modes (required for them).
    """
    if rounding not in ROUNDINGS:
        raise _bad("rounding", f"unknown rounding {rounding!r}; choose one of {ROUNDINGS}")
    if _fine_dtype(dtype):
        return clean.to(dtype) + z.to(dtype)
    if rounding == "nearest":
        return (clean.to(torch.float32) + z.to(torch.float32)).to(dtype)
    if uniform is None:
        raise ValueError("land_noise: stochastic rounding needs `uniform`")
    z64 = z.to(torch.float64)
    if rounding == "stochastic":
        z64 = z64 * matched_noise_scale(clean, sigma, dtype)
    return stochastic_round(clean.to(torch.float64) + z64, dtype, uniform)


def realized_std(clean: Tensor, noisy: Tensor) -> float:
    """Std (population, fp64) of the perturbation that actually landed: ``noisy - clean``."""
    delta = noisy.detach().to("cpu", torch.float64) - clean.detach().to("cpu", torch.float64)
    return float(delta.std(correction=0)) if delta.numel() else 0.0


# --------------------------------------------------------------------------------------------
# NormNoiser: apply / restore on named tensors
# --------------------------------------------------------------------------------------------


def _is_dtensor(tensor: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def _local_tensor(tensor: Tensor) -> Tensor:
    """The storage to write in place: the tensor itself, or a DTensor's local shard.

    Resolved at every write, never cached: FSDP2 may re-point a DTensor's local tensor (lazy
    init copies the shard into its padded buffer), and a cached one would go stale.
    """
    if _is_dtensor(tensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def _global_region(tensor: Tensor) -> tuple[tuple[int, ...], tuple[slice, ...] | None]:
    """(global shape, region of the global tensor held locally; None when it is all local).

    FSDP2 shards parameters on dim 0 as DTensors; their noise is drawn at the global shape and
    sliced, so a sharded actor gets the same values as an unsharded engine.
    """
    if not _is_dtensor(tensor):
        return _shape(tensor.shape), None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(isinstance(p, (Shard, Replicate)) for p in tensor.placements):
        raise ValueError(f"AQN: unsupported DTensor placements {tensor.placements} (need Shard/Replicate)")
    local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return _shape(tensor.shape), tuple(slice(o, o + n) for o, n in zip(offset, local_shape))


def _tensor_bytes(tensor: Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


@dataclass
class _Entry:
    name: str
    key: str  # canonical name: what the noise is keyed by
    source: Tensor  # the tensor as given (a DTensor stays a DTensor)
    global_shape: tuple[int, ...]
    region: tuple[slice, ...] | None
    clean: Tensor  # exact clone of live: same device, dtype and bits
    clean_cpu: Tensor  # the same bits on the CPU, for the noise arithmetic
    expected: Tensor | None = None  # what we last wrote; None while clean

    @property
    def live(self) -> Tensor:
        """What is written in place (the local shard for a DTensor)."""
        return _local_tensor(self.source)


class NormNoiser:
    """Adds AQN to a fixed set of named tensors, in place, and takes it off again.

    Works on any ``name -> tensor`` mapping (parameters of an HF/peft model, FSDP2 DTensors,
    or a vLLM model's RMSNorm weights), holding no model object. The clean values are
    snapshotted once; ``apply(step, sigma)`` writes ``clean + Z(seed, step, name)`` landed in
    the rounding dtype; ``restore()`` writes the clean bits back. Writes are ``copy_`` into the
    existing storage under ``no_grad`` (CUDA graphs keep their pointers; autograd still sees
    the version bump if a graph saved the weight, so misuse errors loudly).

    If a tensor changes behind the noiser's back (a weight sync or an optimizer step on a
    noisy weight), the next ``apply``/``restore`` raises instead of silently mixing states;
    call :meth:`refresh_clean` once the new value is the intended clean weight.

    ``round_to``: the dtype the weights are *computed* in, if coarser than they are stored
    (e.g. ``torch.bfloat16`` for an FSDP actor that keeps fp32 master weights and computes in
    BF16): the noisy value is then rounded onto that grid and stored exactly, so the actor and
    a BF16 rollout engine see the same numbers.
    """

    def __init__(
        self,
        tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
        *,
        seed: int = 0,
        rounding: str = "stochastic",
        round_to: torch.dtype | None = None,
    ) -> None:
        if not _is_int(seed):
            raise _bad("seed", f"must be an int, got {seed!r}")
        if rounding not in ROUNDINGS:
            raise _bad("rounding", f"unknown rounding {rounding!r}; choose one of {ROUNDINGS}")
        self.seed = seed
        self.rounding = rounding
        self.round_to = round_to
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
        live = _local_tensor(tensor)
        global_shape, region = _global_region(tensor)
        if not live.dtype.is_floating_point:
            raise TypeError(f"NormNoiser: {name!r} has dtype {live.dtype}; need a floating dtype")
        if live.numel() == 0 and math.prod(global_shape) == 0:
            raise ValueError(f"NormNoiser: {name!r} is empty")
        if live.numel() == 0 and region is None:
            raise ValueError(
                f"NormNoiser: {name!r} has no local elements (an FSDP1 flat-parameter view?); "
                "use FSDP2 (DTensor parameters) or unsharded tensors"
            )
        target = self.round_to or live.dtype
        if torch.finfo(target).eps < torch.finfo(live.dtype).eps:
            raise ValueError(f"NormNoiser: round_to={target} is finer than {name!r}'s storage {live.dtype}")
        clean = live.detach().clone()
        return _Entry(name, key, tensor, global_shape, region, clean, clean.to("cpu"))

    @classmethod
    def from_config(
        cls,
        named_tensors: Iterable[tuple[str, Tensor]],
        cfg: AQNConfig,
        *,
        round_to: torch.dtype | None = None,
    ) -> NormNoiser:
        """Select the AQN targets of ``named_tensors`` (e.g. ``model.named_parameters()``)."""
        named = list(named_tensors)
        chosen = set(select_norm_tensors(named, cfg))
        if not chosen:
            sample = [n for n, _ in named[:8]]
            raise ValueError(
                f"AQN: no tensor matches targets {cfg.targets} (final norm: {cfg.include_final_norm}); "
                f"first names seen: {sample}"
            )
        picked = [(n, t) for n, t in named if n in chosen]
        return cls(picked, seed=cfg.seed, rounding=cfg.rounding, round_to=round_to)

    # -- introspection -------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """Tensor names as given, in order."""
        return tuple(e.name for e in self._entries)

    @property
    def current(self) -> tuple[int, float] | None:
        """``(step, sigma)`` of the noise now in the tensors; ``None`` while clean."""
        return self._current

    def __len__(self) -> int:
        return len(self._entries)

    def checksum(self) -> str:
        """BLAKE2b hex digest of the bytes the tensors hold now (rank-local for DTensors)."""
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
        elements, and the fraction of elements whose stored value changed (rank-local)."""
        return dict(self._stats)

    # -- writing -------------------------------------------------------------------------

    def _verify_untouched(self) -> None:
        for e in self._entries:
            expected = e.clean if e.expected is None else e.expected
            if not torch.equal(e.live.detach(), expected):
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
        step = _check_step(step)
        sigma = _check_sigma(sigma)
        self._verify_untouched()
        if sigma == 0.0:
            self._write_clean()
            self._current = (step, 0.0)
            return
        # One land_noise call per (storage dtype, rounding dtype) group: the per-call cost of
        # the rounding setup is then paid once per step, not once per tensor.
        groups: dict[tuple[torch.dtype, torch.dtype], list[_Entry]] = {}
        for e in self._entries:
            dtype = e.clean_cpu.dtype
            groups.setdefault((dtype, self.round_to or dtype), []).append(e)
        sum_sq, count, changed = 0.0, 0, 0
        with torch.no_grad():
            for (_, target), entries in groups.items():
                needs_uniform = self.rounding != "nearest" and not _fine_dtype(target)
                zs, uniforms = [], []
                for e in entries:
                    z = noise_for(e.key, e.global_shape, sigma, self.seed, step)
                    u = _uniform_for(e.key, e.global_shape, self.seed, step) if needs_uniform else None
                    if e.region is not None:
                        z = z[e.region]
                        u = None if u is None else u[e.region]
                    zs.append(z.reshape(-1))
                    if u is not None:
                        uniforms.append(u.reshape(-1))
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
        with torch.no_grad():
            for e in self._entries:
                live = e.live
                if e.expected is not None and torch.equal(live.detach(), e.expected):
                    live.copy_(e.clean)
                else:
                    e.clean = live.detach().clone()
                    e.clean_cpu = e.clean.to("cpu")
                e.expected = None
        self._current = None
        self._stats = {"qerl/aqn_sigma_effective": 0.0, "qerl/aqn_changed_frac": 0.0}


# --------------------------------------------------------------------------------------------
# Training-side adapter
# --------------------------------------------------------------------------------------------


def attach_training_noise(model: Any, cfg: AQNConfig, *, round_to: torch.dtype | None = None) -> NormNoiser:
    """A :class:`NormNoiser` over a PyTorch model's targeted RMSNorm parameters.

    Works for plain HF models, peft-wrapped ones and FSDP2 (DTensor) modules: it only uses
    ``model.named_parameters()``. With FSDP mixed precision (fp32 stored, BF16 computed) pass
    ``round_to=torch.bfloat16`` so the actor computes with the same values as a BF16 rollout.
    Used when ``cfg.apply_to == "both"``.
    """
    return NormNoiser.from_config(model.named_parameters(), cfg, round_to=round_to)


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
