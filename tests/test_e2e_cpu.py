"""The README's main job, end to end: `python -m verl.trainer.main_ppo` with QeRL on the tiny default.

Three GRPO steps of a tiny Qwen2: the NVFP4 actor + LoRA (FSDP2, gloo), the `qerl_nvfp4` vLLM CPU rollout with
the adapter synced each step, AQN on the rollout's RMSNorms (stage 0 noise-free, then sigma_start, sigma_end
with num_stages=3). Takes ~2-4 minutes on the 2-core CI machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("verl")
pytest.importorskip("vllm")


@pytest.mark.slow
def test_tiny_qerl_grpo_runs_and_logs_aqn(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    # Ray's unix sockets live under RAY_TMPDIR and must stay below 108 bytes: keep the folder short
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = {**os.environ, "WORKDIR": str(tmp_path / "tiny"), "PYTHON": str(Path(os.sys.executable)),
           "RAY_TMPDIR": ray_tmp, "QERL_DEVICE": "cpu", "TIMEOUT": "1200"}
    res = subprocess.run(["bash", str(REPO / "examples/tiny/grpo.sh"), "nvfp4"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=1500)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    log = res.stdout + res.stderr
    (tmp_path / "run.log").write_text(log)
    assert res.returncode == 0, log[-6000:]
    assert "actor: Linear layers converted to nvfp4" in log  # the FSDP engine hook ran in the worker
    assert "qerl_nvfp4" in log  # vLLM was started with our quantization method
    rows = [json.loads(line) for line in (tmp_path / "tiny/metrics-nvfp4.jsonl").read_text().splitlines()]
    steps = {r["step"]: r["data"] for r in rows}
    assert sorted(steps) == [1, 2, 3]
    sigmas = [steps[s]["qerl/aqn_sigma"] for s in (1, 2, 3)]
    assert sigmas == pytest.approx([0.0, 1e-2, 5e-4])
    assert [steps[s]["qerl/aqn_stage"] for s in (1, 2, 3)] == [0, 1, 2]
    # the shaping reward gives GRPO a signal, so the adapters really train (lr 2e-2) ...
    assert max(steps[s]["actor/grad_norm"] for s in steps) > 0
    for s, data in steps.items():
        # ... and the rollout (vLLM: NVFP4 base + the synced adapter + AQN) still agrees with the actor
        # (NVFP4 + LoRA) on the sampled tokens' probabilities: the adapter reached vLLM every step
        assert data["training/rollout_probs_diff_max"] < 5e-3, (s, data["training/rollout_probs_diff_max"])
        assert "timing_s/update_actor" in data and "actor/pg_loss" in data
