"""The main job's closing table: aligned columns sized to their content."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "examples/tiny/summarize.py"
SPEC = importlib.util.spec_from_file_location("tiny_summarize", SCRIPT)
summarize = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(summarize)


def _rows() -> list[dict]:
    return [
        {"step": 1, "data": {"qerl/aqn_stage": 0, "qerl/aqn_sigma": 0.0, "critic/score/mean": 0.103,
                             "actor/pg_loss": -1e-6, "timing_s/gen": 11.4, "timing_s/step": 31.1}},
        {"step": 12, "data": {"qerl/aqn_stage": 1, "qerl/aqn_sigma": 1e-2, "critic/score/mean": 0.151,
                              "timing_s/gen": 1.7, "timing_s/step": 3.4}},
    ]


def test_columns_align_and_fit_their_content(tmp_path):
    lines = summarize.format_table(_rows())
    assert len(lines) == 3
    assert len({len(line) for line in lines}) == 1, lines          # every line equally wide: columns align
    header = lines[0].split()
    assert header[:4] == ["step", "stage", "sigma", "reward"]
    # no column is wider than its widest cell: two spaces between columns, no padding to a fixed 20
    cells = [line.split() for line in lines]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    assert len(lines[0]) == sum(widths) + 2 * (len(header) - 1)
    assert lines[2].split()[:4] == ["12", "1", "1.0e-02", "0.151"]
    assert lines[2].split()[5] == "-"                               # a missing metric prints as '-'
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    assert summarize.main(str(path)) == 0
