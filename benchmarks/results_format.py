"""The ``targets`` entries every results JSON carries, and the one rule for reading them.

An entry is ``{"name", "measured", "op" (">=" or "<="), "target"}``; ``measured`` is None when the thing
could not be measured (a failed or skipped run). Every benchmark prints its targets with :func:`target_status`
so "met" means the same everywhere (the op is honoured, None is never "met").
"""

from __future__ import annotations

import json
from pathlib import Path


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


def report_and_write(path: Path, result: dict) -> Path:
    """Prints ``result``'s targets (status, name, measured, op, target) and writes it to ``path`` as JSON, whole:
    to a temporary file beside it, then renamed, so an interrupted run leaves no half-written results file."""
    for t in result.get("targets", []):
        print(f"#  {target_status(t):6} {t['name']}: {t['measured']} {t['op']} {t['target']}")
    write_json(path, result)
    print(f"# wrote {path}")
    return path


def write_json(path: Path, obj, *, indent: int = 1, default=None, end: str = "") -> Path:
    """``obj`` as JSON at ``path``, whole or not at all: written to a temporary file beside it (folders made), then
    renamed over ``path``, so a run killed or out of disk mid-write leaves the previous file (or none), never a
    truncated one. ``default`` / ``end``: json.dumps's ``default`` and text after the JSON (e.g. a newline)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=indent, default=default) + end)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_json(path: str | Path, flag: str):  # noqa: ANN201 - any JSON value
    """The JSON value in ``path``; a file that cannot be read or is not JSON raises ValueError naming ``flag`` (the
    argument that gave the path) and the file."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc})") from exc


def read_earlier(path: str, *, flag: str, script: str, section: str, device: str, keys: tuple[str, ...],
                 here: dict, defaults: dict | None = None) -> dict:
    """An earlier results JSON of ``script`` that a later call extends (``--baseline``, ``--merge``): one remote
    GPU call is limited to 10 minutes, so a comparison's runs are spread over calls. Raises ValueError naming
    ``flag`` and the file when it cannot be read, is not such a JSON (``rows`` and ``section``), or was measured
    on another device or with other ``keys`` of ``section`` than ``here`` (each difference with both values).
    ``defaults``: what a key that an older file lacks meant when that file was written."""
    res = read_json(path, flag)
    if not (isinstance(res, dict) and isinstance(res.get("rows"), list) and isinstance(res.get(section), dict)):
        raise ValueError(f"{flag} {path}: not a {script} results JSON (needs 'rows' and '{section}')")
    diff = [f"device {res.get('device')!r} there, {device!r} here"] if res.get("device") != device else []
    there = {**(defaults or {}), **res[section]}
    diff += [f"{k}: {there.get(k)!r} there, {here[k]!r} here" for k in keys if there.get(k) != here[k]]
    if diff:
        raise ValueError(f"{flag} {path}: measured otherwise: " + "; ".join(diff))
    return res


def positive_ints(text: str, flag: str) -> list[int]:
    """A comma list of positive integers (``--batches 1,8,64``, ``--ms 1,16,64``) -> the integers in order; anything
    else (an empty item as in ``64,,256``, 0, a negative or non-integer value) raises ValueError naming ``flag`` and
    the bad items."""
    items = [v.strip() for v in text.split(",")]
    bad = [v for v in items if not v.isdigit() or int(v) < 1]
    if bad:
        raise ValueError(f"{flag} {text!r}: expected a comma list of positive integers (bad: {bad})")
    return [int(v) for v in items]
