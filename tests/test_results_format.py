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
