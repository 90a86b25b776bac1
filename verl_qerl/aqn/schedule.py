"""The AQN settings and the noise schedule: which sigma each training step uses.

Stage 0 is noise-free; stages 1..K-1 decay sigma from ``sigma_start`` to ``sigma_end``
(exponential by default, the paper's Table 4). ``noise_from_start`` instead gives stage 0
``sigma_start`` and decays over stages 0..K-1, so the noise is on from the first step (for studies
whose question is early exploration). Pure arithmetic on the config; no tensors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from ._checks import bad, check_step, check_total_steps, is_int, is_real
from .rounding import ROUNDINGS
from .targets import DEFAULT_TARGETS

#: Decay shapes over stages 1..K-1 (0..K-1 with ``noise_from_start``). "exponential" is the paper's.
SCHEDULES = ("exponential", "linear", "cosine", "constant", "none")
#: The schedules that go from sigma_start to sigma_end (the others ignore sigma_end).
DECAYING_SCHEDULES = ("exponential", "linear", "cosine")
#: Where the noise goes: only the sampling (rollout) engine, the paper's setting. The actor computes
#: log-probs and updates on the clean weights.
APPLY_TO = ("rollout",)


@dataclass(frozen=True)
class AQNConfig:
    """AQN settings. Validated on construction, so an instance is always usable.

    Defaults are the paper's Table 4 (sigma 1e-2 -> 5e-4 over K = 10 stages, exponential).
    ``total_steps`` may stay ``None`` when the trainer supplies it (verl's
    ``total_training_steps``); the schedule functions then need it as an argument.
    ``noise_from_start=True`` puts ``sigma_start`` on stage 0 too (see :func:`stage_sigma`).
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
    noise_from_start: bool = False

    def __post_init__(self) -> None:
        targets = self.targets
        if isinstance(targets, str) or not isinstance(targets, Iterable):
            raise bad("targets", f"must be a list of module names, got {targets!r}")
        object.__setattr__(self, "targets", tuple(targets))
        self.validate()

    def validate(self, total_steps: int | None = None) -> AQNConfig:
        """Raise :class:`AQNConfigError` naming the first bad key; return ``self``.

        ``total_steps`` (optional) checks a run length supplied by the trainer as well.
        """
        if not isinstance(self.enable, bool):
            raise bad("enable", f"must be true or false, got {self.enable!r}")
        if self.schedule not in SCHEDULES:
            raise bad("schedule", f"unknown schedule {self.schedule!r}; choose one of {SCHEDULES}")
        for key in ("sigma_start", "sigma_end"):
            value = getattr(self, key)
            if not is_real(value) or not math.isfinite(value):
                raise bad(key, f"must be a finite number, got {value!r}")
            if self.schedule == "exponential" and value <= 0:
                raise bad(key, f"must be > 0 for the exponential schedule, got {value!r}")
            if value < 0:
                raise bad(key, f"must be >= 0, got {value!r}")
        if self.schedule in DECAYING_SCHEDULES and self.sigma_end > self.sigma_start:
            raise bad("sigma_end", f"{self.sigma_end!r} is above sigma_start={self.sigma_start!r}: the noise would "
                       "rise during training, where AQN decays it (swap the two, or use schedule=constant)")
        if self.enable and self.schedule != "none" and self.sigma_start == 0:
            # every noisy stage starts from sigma_start (and a decay cannot rise above it): AQN on, no noise
            raise bad("sigma_start", f"0 with enable=true and schedule={self.schedule} adds no noise at any step; set "
                       "sigma_start > 0, or say so with schedule=none or enable=false")
        if not isinstance(self.noise_from_start, bool):
            raise bad("noise_from_start", f"must be true or false, got {self.noise_from_start!r}")
        least = min_stages(self.noise_from_start)
        if not is_int(self.num_stages):
            raise bad("num_stages", f"must be an int >= {least}, got {self.num_stages!r}")
        if self.num_stages < least:
            why = ("the decay needs a first and a last stage" if self.noise_from_start
                   else "stage 0 is noise-free and the decay needs two more; or set noise_from_start=true")
            raise bad("num_stages", f"must be >= {least} ({why}), got {self.num_stages}")
        if not is_int(self.seed):
            raise bad("seed", f"must be an int, got {self.seed!r}")
        if self.apply_to not in APPLY_TO:
            raise bad("apply_to", f"{self.apply_to!r} is not supported: AQN perturbs the rollout engine only "
                      f"(the paper's setting); the only value is {APPLY_TO[0]!r}")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise bad("targets", f"must be a non-empty list of module names, got {self.targets!r}")
        if not isinstance(self.include_final_norm, bool):
            raise bad("include_final_norm", f"must be true or false, got {self.include_final_norm!r}")
        if self.rounding not in ROUNDINGS:
            raise bad("rounding", f"unknown rounding {self.rounding!r}; choose one of {ROUNDINGS}")
        if self.total_steps is not None:
            check_total_steps(self.total_steps)
            short = short_run(self.total_steps, self)
            if short:
                raise bad("total_steps", f"{self.total_steps} is fewer than num_stages={self.num_stages}: {short}; "
                           f"run at least {self.num_stages} steps, lower num_stages "
                           f"(>= {min_stages(self.noise_from_start)}) or disable AQN")
        if total_steps is not None:
            check_total_steps(total_steps)
        return self

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> AQNConfig:
        """Build from a plain or OmegaConf mapping; unknown keys are errors (typos must not pass)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise bad(unknown[0], f"unknown AQN key; known keys are {sorted(known)}")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (targets as a list) for logging and config round trips."""
        out = dataclasses.asdict(self)
        out["targets"] = list(self.targets)
        return out

    def resolve_total_steps(self, total_steps: int | None) -> int:
        """The run length to use: the argument if given, else ``self.total_steps``."""
        if total_steps is None:
            if self.total_steps is None:
                raise bad("total_steps", "unknown: pass it, or set AQNConfig.total_steps")
            return self.total_steps
        return check_total_steps(total_steps)




def min_stages(noise_from_start: bool) -> int:
    """The fewest stages a schedule can have: a decay needs a first and a last noisy stage, plus the
    noise-free stage 0 unless ``noise_from_start``."""
    return 2 if noise_from_start else 3


def short_run(total_steps: int, cfg: AQNConfig) -> str | None:
    """What goes wrong when a run of ``total_steps`` is shorter than ``cfg.num_stages``, or None.

    Step ``s`` of ``T < K`` lands in stage ``(s - 1) K // T``, so only ``T`` of the ``K`` stages get
    a step, one of them the noise-free stage 0: most of the decay is skipped, and a one-step run
    gets no noise at all (with ``noise_from_start`` it gets ``sigma_start`` only).
    """
    if not cfg.enable or cfg.schedule == "none" or total_steps >= cfg.num_stages:
        return None
    if cfg.noise_from_start:
        return (f"only {total_steps} of the {cfg.num_stages} stages get a step, so most of the noise decay is "
                "skipped")
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
    check_step(step)
    check_total_steps(total_steps)
    if not is_int(num_stages) or num_stages < 1:
        raise bad("num_stages", f"must be an int >= 1, got {num_stages!r}")
    if step == 0:
        return 0
    return min((step - 1) * num_stages // total_steps, num_stages - 1)


def stage_bounds(stage: int, total_steps: int, num_stages: int) -> tuple[int, int]:
    """First and last step (1-based, inclusive) of ``stage``; the inverse of :func:`stage_of`.

    The last stage ends at ``total_steps`` (later steps also map to it, by clamping).
    """
    check_total_steps(total_steps)
    if not is_int(stage) or not 0 <= stage < num_stages:
        raise bad("stage", f"must be an int in [0, {num_stages}), got {stage!r}")
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

    ``noise_from_start`` shifts the decay one stage earlier: stage 0 gets ``sigma_start`` and stage
    ``k`` uses ``t = k / (K - 1)``, reaching ``sigma_end`` in the last stage as before.
    """
    num_stages = cfg.num_stages
    if not is_int(stage) or not 0 <= stage < num_stages:
        raise bad("stage", f"must be an int in [0, {num_stages}), got {stage!r}")
    if not cfg.enable or cfg.schedule == "none" or (stage == 0 and not cfg.noise_from_start):
        return 0.0
    start, end = float(cfg.sigma_start), float(cfg.sigma_end)
    if cfg.schedule == "constant":
        return start
    first = 0 if cfg.noise_from_start else 1
    if stage == first:  # exact end points, free of pow/cos rounding
        return start
    if stage == num_stages - 1:
        return end
    t = (stage - first) / (num_stages - 1 - first)
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

