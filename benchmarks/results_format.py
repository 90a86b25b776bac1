"""The ``targets`` entries every results JSON carries, and the one rule for reading them.

An entry is ``{"name", "measured", "op" (">=" or "<="), "target"}``; ``measured`` is None when the thing
could not be measured (a failed or skipped run). Every benchmark prints its targets with :func:`target_status`
so "met" means the same everywhere (the op is honoured, None is never "met").
"""

from __future__ import annotations


def target_met(t: dict) -> bool | None:
    """True/False by the entry's op, None when nothing was measured."""
    m = t.get("measured")
    if m is None:
        return None
    if t["op"] == "<=":
        return m <= t["target"]
    if t["op"] == ">=":
        return m >= t["target"]
    raise ValueError(f"target {t.get('name')!r}: op {t['op']!r} is neither '>=' nor '<='")


def target_status(t: dict) -> str:
    """'met', 'MISSED' or '-' (not measured)."""
    return {True: "met", False: "MISSED", None: "-"}[target_met(t)]
