"""Argument checks shared by the AQN modules, and the error they raise."""

from __future__ import annotations

import math
from typing import Any


class AQNConfigError(ValueError):
    """A bad AQN setting; the message starts with the offending key."""


def bad(key: str, why: str) -> AQNConfigError:
    """The error for a bad value of ``key``."""
    return AQNConfigError(f"{key}: {why}")


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_total_steps(total_steps: Any, key: str = "total_steps") -> int:
    """``total_steps`` as an int > 0, or an error naming ``key``."""
    if not is_int(total_steps):
        raise bad(key, f"must be an int > 0, got {total_steps!r}")
    if total_steps <= 0:
        raise bad(key, f"must be > 0, got {total_steps}")
    return total_steps


def check_step(step: Any) -> int:
    """A training step: an int >= 0."""
    if not is_int(step) or step < 0:
        raise bad("step", f"must be an int >= 0 (verl's global_steps starts at 1), got {step!r}")
    return step


def check_sigma(sigma: Any) -> float:
    """A noise std: a finite number >= 0."""
    if not is_real(sigma) or not math.isfinite(sigma) or sigma < 0:
        raise bad("sigma", f"must be a finite number >= 0, got {sigma!r}")
    return float(sigma)
