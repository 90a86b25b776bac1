"""The results side of ``benchmarks/rollout.py``: the targets over the measured rows (issue 8's cross-backend
ratios, issue 18's at B >= 64, issue 19's with / without LoRA), the ``--merge`` of earlier results JSONs, and the
ratio table printed last.

Kept apart from the runner because none of it launches anything: it works on plain rows and results dicts, so
every number of the results JSON and of the table can be checked on a CPU from made-up rows.
"""

from __future__ import annotations

from results_format import read_earlier  # benchmarks/: this module's own folder
from rollout_prepare import BACKENDS, LORA_RANK, SHAPES, BenchError

#: qerl_nvfp4 / bf16 target at batch <= 8, per model (issue 8).
BF16_TARGET = {"7b": 1.6, "32b": 2.0, "tiny": 1.6}
#: issue 18, end to end: the 7B rollout at the batch sizes RL decodes at (B >= 64), ours / BF16, both with LoRA
LARGE_BATCH_BF16_TARGET = {"7b": 1.2}
NF4_TARGET = 2.5
MARLIN_TARGET = 1.25
#: qerl_nvfp4 with LoRA / without LoRA, output tok/s, every batch; prefill time with / without (issue 19).
LORA_KEEP_TARGET = 0.90
LORA_PREFILL_TARGET = 1.3
#: workload keys a --merge file must share with this run for its rows to be comparable
MERGE_KEYS = ("prompt_tokens", "new_tokens", "lora_rank", "seed")


def _row_lora(row: dict) -> bool:
    return bool(row.get("lora", True))  # rows written before the split always had the adapter


def _index(rows: list[dict]) -> dict[tuple[str, str, int, bool], dict]:
    return {(r["model"], r["backend"], r["batch"], _row_lora(r)): r for r in rows}


def _ratio(rows: dict, model: str, b: int, num: str, den: str, key: str = "tok_s", lora: bool = True,
           den_lora: bool | None = None):
    """``num``'s ``key`` over ``den``'s, at one (model, batch); ``lora`` / ``den_lora`` pick the with- or
    without-adapter row of each (``den_lora`` defaults to ``lora``)."""
    a = rows.get((model, num, b, lora))
    c = rows.get((model, den, b, lora if den_lora is None else den_lora))
    if a is None or c is None:
        return None
    return a[key] / c[key]


def make_targets(rows: list[dict], models: list[str], batches: list[int], skipped: dict,
                 lora: bool = True) -> list[dict]:
    """Issue 8's cross-backend targets, on the LoRA rows where there are any (else on the no-LoRA rows, and
    labelled so), and issue 19's with / without LoRA targets where both kinds of qerl_nvfp4 rows exist.
    ``lora``: whether the run had the adapter, for the labels when there are no rows at all (``--no-lora``: the
    unmeasured targets are labelled "no LoRA", not "LoRA")."""
    idx = _index(rows)
    lora = any(_row_lora(r) for r in rows) if rows else lora
    label = "LoRA" if lora else "no LoRA"
    targets = []

    def add(name, model, b, num, den, target, key="tok_s", op=">=", num_lora=lora, den_lora=lora):
        measured = _ratio(idx, model, b, num, den, key, num_lora, den_lora)
        entry = {"name": name, "measured": None if measured is None else round(measured, 4), "op": op,
                 "target": target}
        if measured is None:
            why = [skipped.get((model, k)) for k in dict.fromkeys((num, den)) if skipped.get((model, k))]
            entry["note"] = "; ".join(why) or f"no {den} or {num} row (failed or not run)"
        targets.append(entry)

    for m in models:
        for b in batches:
            if b <= 8:
                add(f"{m} B={b}: qerl_nvfp4 / bf16 output tok/s ({label})", m, b, "qerl_nvfp4", "bf16", BF16_TARGET[m])
            elif b >= 64 and m in LARGE_BATCH_BF16_TARGET:
                add(f"{m} B={b}: qerl_nvfp4 / bf16 output tok/s ({label})", m, b, "qerl_nvfp4", "bf16",
                    LARGE_BATCH_BF16_TARGET[m])
            add(f"{m} B={b}: qerl_nvfp4 / nf4 output tok/s ({label})", m, b, "qerl_nvfp4", "nf4", NF4_TARGET)
            add(f"{m} B={b}: qerl_nvfp4 / ct_marlin output tok/s ({label})", m, b, "qerl_nvfp4", "ct_marlin",
                MARLIN_TARGET)
    split = {(r["model"], _row_lora(r)) for r in rows if r["backend"] == "qerl_nvfp4"}
    for m in models:
        if not {(m, True), (m, False)} <= split:
            continue
        for b in batches:
            add(f"{m} B={b}: qerl_nvfp4 with LoRA / without LoRA output tok/s", m, b, "qerl_nvfp4", "qerl_nvfp4",
                LORA_KEEP_TARGET, num_lora=True, den_lora=False)
            add(f"{m} B={b}: qerl_nvfp4 prefill time with LoRA / without LoRA", m, b, "qerl_nvfp4", "qerl_nvfp4",
                LORA_PREFILL_TARGET, key="prefill_s", op="<=", num_lora=True, den_lora=False)
    return targets


def read_previous(paths: list[str], workload: dict, device: str) -> list[tuple[str, dict]]:
    """(path, result) of each --merge file, refused (BenchError) unless measured on ``device`` with ``workload``'s
    MERGE_KEYS. Read before the first save: the output file may be one of them."""
    previous = []
    for path in paths:
        try:
            res = read_earlier(path, flag="--merge", script="rollout.py", section="workload", device=device,
                               keys=MERGE_KEYS, here=workload)
        except ValueError as exc:
            raise BenchError(str(exc)) from exc
        previous.append((str(path), res))
    return previous


def _model_key(model: str) -> tuple[int, str]:
    order = [*SHAPES, "tiny"]
    return (order.index(model) if model in order else len(order), model)


def merge_previous(result: dict, previous: list[tuple[str, dict]], models: list[str], batches: list[int]) -> dict:
    """``result`` plus the rows, skips and model info of ``previous`` (``read_previous``) for the (model, backend)
    pairs without rows here (a later file wins a pair; a pair that failed here before any batch keeps its old
    rows), and the
    targets over the union of models and batches (also set in ``workload``: models in SHAPES order, batches
    sorted). Why: one GPU call (10 minutes) holds only part of the comparison."""
    def pair(x: dict) -> tuple:
        return x["model"], x["backend"], _row_lora(x)

    def skip_pair(x: dict) -> tuple[str, str]:
        return x["model"], x["backend"]

    now = {pair(r) for r in result["rows"]}
    old: dict[tuple[str, str], list[dict]] = {}
    skipped: dict[tuple[str, str], str] = {}
    info: dict = {}
    all_batches = set(batches)
    for path, prev in previous:
        groups: dict[tuple[str, str], list[dict]] = {}
        for r in prev["rows"]:
            groups.setdefault(pair(r), []).append({**r, "merged_from": r.get("merged_from", path)})
        old.update(groups)
        skipped.update({skip_pair(s): s["reason"] for s in prev.get("skipped", [])})
        info.update(prev.get("models", {}))
        all_batches.update(prev["workload"].get("batches") or [])
    rows = [r for p, rs in old.items() if p not in now for r in rs] + result["rows"]
    have = {skip_pair(r) for r in rows}
    skipped.update({skip_pair(s): s["reason"] for s in result["skipped"]})
    skipped = {p: why for p, why in skipped.items() if p not in have}
    all_models = sorted({*models, *(m for m, _ in have), *(m for m, _ in skipped), *info}, key=_model_key)
    batch_list = sorted(all_batches | {r["batch"] for r in rows})
    rows.sort(key=lambda r: (_model_key(r["model"]), BACKENDS.index(r["backend"]), not _row_lora(r), r["batch"]))
    return {**result, "workload": {**result["workload"], "models": all_models, "batches": batch_list},
            "models": {**info, **result["models"]}, "rows": rows,
            "skipped": [{"model": m, "backend": b, "reason": why} for (m, b), why in skipped.items()],
            "targets": make_targets(rows, all_models, batch_list, skipped,
                                    lora=result["workload"].get("lora_rank") is not None),
            "merged_from": [path for path, _ in previous]}


def ratio_table(rows: list[dict], models: list[str], batches: list[int], lora: bool = True) -> str:
    """Markdown tables: per metric, each backend with and/or without LoRA and ours over the others; where a
    backend ran both ways, its with / without LoRA ratios. ``lora``: the LoRA column's label when there are no
    rows (whether the run had the adapter)."""
    idx = _index(rows)
    lora_kinds = [k for k in (True, False) if any(_row_lora(r) == k for r in rows)] or [lora]
    lines = []

    def fmt(x, ratio=False):
        return "-" if x is None else (f"{x:.2f}x" if ratio else f"{x:,.0f}")

    for key, label in (("tok_s", "output tok/s (prefill + decode)"), ("decode_tok_s", "decode tok/s"),
                       ("prefill_tok_s", "prefill input tok/s")):
        lines.append(f"\n{label}")
        lines.append(f"| model | B | LoRA | {' | '.join(BACKENDS)} | ours/bf16 | ours/nf4 | ours/ct_marlin |")
        lines.append("| --- | ---: | --- |" + " ---: |" * (len(BACKENDS) + 3))
        for m in models:
            for lora in lora_kinds:
                for b in batches:
                    vals = [fmt(idx[(m, be, b, lora)][key]) if (m, be, b, lora) in idx else "-" for be in BACKENDS]
                    rats = [fmt(_ratio(idx, m, b, "qerl_nvfp4", d, key, lora), True)
                            for d in ("bf16", "nf4", "ct_marlin")]
                    lines.append(f"| {m} | {b} | {'r' + str(LORA_RANK) if lora else 'off'} | {' | '.join(vals)} | "
                                 f"{' | '.join(rats)} |")
    both = [be for be in BACKENDS if any((m, be, b, True) in idx and (m, be, b, False) in idx
                                         for m in models for b in batches)]
    if both:
        lines.append("\nwith LoRA / without LoRA (output tok/s; prefill time)")
        lines.append("| model | B | " + " | ".join(f"{be} tok/s | {be} prefill" for be in both) + " |")
        lines.append("| --- | ---: |" + " ---: |" * (2 * len(both)))
        for m in models:
            for b in batches:
                cells = []
                for be in both:
                    cells.append(fmt(_ratio(idx, m, b, be, be, "tok_s", True, False), True))
                    cells.append(fmt(_ratio(idx, m, b, be, be, "prefill_s", True, False), True))
                lines.append(f"| {m} | {b} | {' | '.join(cells)} |")
    return "\n".join(lines)
