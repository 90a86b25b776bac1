"""benchmarks/results_format.py: one reading of a ``targets`` entry for every benchmark."""

import pytest

from verl_qerl.testing.scripts import load_script

rf = load_script("benchmarks/results_format.py", "results_format_under_test")


@pytest.mark.parametrize(("measured", "op", "target", "want"), [
    (1.2, ">=", 1.0, "met"), (0.8, ">=", 1.0, "MISSED"), (0.5, "<=", 0.75, "met"), (0.9, "<=", 0.75, "MISSED"),
    (None, ">=", 1.0, "-"), (1.0, ">=", 1.0, "met"),
])
def test_status_honours_the_op_and_never_calls_nothing_met(measured, op, target, want):
    assert rf.target_status({"name": "x", "measured": measured, "op": op, "target": target}) == want


def test_unknown_op_names_the_target():
    with pytest.raises(ValueError, match="'speed'"):
        rf.target_met({"name": "speed", "measured": 1.0, "op": ">", "target": 1.0})


def test_report_and_write_prints_targets_and_replaces_the_file_whole(tmp_path, capsys):
    """The targets are printed with their status, the JSON lands under the given name (folders made), an existing
    file is replaced, and no temporary file is left beside it."""
    import json

    path = tmp_path / "sub" / "res.json"
    path.parent.mkdir()
    path.write_text("old, not JSON")
    res = {"device": "d", "rows": [1], "targets": [{"name": "speed", "measured": 0.5, "op": ">=", "target": 1.0},
                                                   {"name": "mem", "measured": None, "op": "<=", "target": 2.0}]}
    assert rf.report_and_write(path, res) == path
    assert json.loads(path.read_text()) == res
    assert [p.name for p in path.parent.iterdir()] == ["res.json"]
    out = capsys.readouterr().out
    assert "MISSED speed: 0.5 >= 1.0" in out and "-      mem: None <= 2.0" in out and f"# wrote {path}" in out
    fresh = tmp_path / "new" / "deeper" / "r.json"
    rf.report_and_write(fresh, {"rows": []})
    assert json.loads(fresh.read_text()) == {"rows": []}
