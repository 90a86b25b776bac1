"""benchmarks/train_step.py on CPU at tiny shapes: --fsdp2 wraps every mode as verl's actor, nvfp4:shard-base adds
one FSDP2 unit per NVFP4Linear, and a mode option it does not know is refused (recorded as that mode's error)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(sys.platform != "linux", reason="gloo process group on Linux")
def test_fsdp2_modes_side_by_side(tmp_path):
    out = tmp_path / "ts.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/train_step.py", "--tiny", "--device", "cpu", "--fsdp2", "--warmup", "1",
         "--steps", "1", "--modes", "bf16,nvfp4,nvfp4:shard-base,nvfp4:other", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == {"bf16", "nvfp4", "nvfp4:shard-base", "nvfp4:other"}
    # 2 decoder layers + embed_tokens + lm_head + root; shard-base adds the 2 x 7 projections
    assert rows["bf16"]["fsdp2_units"] == rows["nvfp4"]["fsdp2_units"] == 5
    assert rows["nvfp4:shard-base"]["fsdp2_units"] == 5 + 14
    assert "only option is nvfp4:shard-base" in rows["nvfp4:other"]["error"]
    assert data["config"]["fsdp2"] is True
    names = [t["name"] for t in data["targets"]]
    assert any("shard-base/nvfp4" in n for n in names) and not any("nf4" in n for n in names)
    for r in (rows["bf16"], rows["nvfp4"], rows["nvfp4:shard-base"]):
        assert r["step_time_s"] > 0 and all(loss == loss for loss in r["losses"])
