"""The README's main job, end to end: `python -m verl.trainer.main_ppo` with QeRL on the tiny default.

Three GRPO steps of a tiny Qwen2: the NVFP4 actor + LoRA (FSDP2, gloo), the `qerl_nvfp4` vLLM CPU rollout with
the adapter synced each step, AQN on the rollout's RMSNorms (stage 0 noise-free, then sigma_start, sigma_end
with num_stages=3). Takes ~2-4 minutes on the 2-core CI machine, per variant:

* ``bf16_path``: model.path is the BF16 tiny model; the actor quantizes it, vLLM quantizes it at load;
* ``nvfp4_path``: model.path is its compressed-tensors NVFP4A16 checkpoint (``qerl-quantize``): the actor is built
  from it with no dense Linear weight and vLLM loads it with ``qerl_nvfp4`` (the "32B on one GPU" route).
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

import verl  # noqa: E402, F401  (required in CI: missing verl / vLLM must fail, not skip)
import vllm  # noqa: E402, F401

from verl_qerl.vllm import decode_stats  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("model_path", ["bf16_path", "nvfp4_path"])
def test_tiny_qerl_grpo_runs_and_logs_aqn(tmp_path, model_path):
    assert shutil.which("bash"), "the example scripts need bash"
    work = tmp_path / "tiny"
    extra = []
    if model_path == "nvfp4_path":
        from verl_qerl.checkpoint_conversion import quantize_checkpoint

        subprocess.run([os.sys.executable, str(REPO / "examples/tiny/prepare.py"), str(work)], cwd=REPO, check=True)
        quantize_checkpoint(work / "model", work / "model-nvfp4")
        extra = [f"actor_rollout_ref.model.path={work / 'model-nvfp4'}"]  # the last override wins
    # Ray's unix sockets live under RAY_TMPDIR and must stay below 108 bytes: keep the folder short
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = {**os.environ, "WORKDIR": str(work), "PYTHON": str(Path(os.sys.executable)),
           "RAY_TMPDIR": ray_tmp, "QERL_DEVICE": "cpu", "TIMEOUT": "1200",
           decode_stats.ENV: str(tmp_path / "stats")}
    res = subprocess.run(["bash", str(REPO / "examples/tiny/grpo.sh"), "nvfp4", *extra], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=1500)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    log = res.stdout + res.stderr
    (tmp_path / "run.log").write_text(log)
    assert res.returncode == 0, log[-6000:]
    if model_path == "bf16_path":
        assert "actor: Linear layers converted to nvfp4" in log  # the FSDP engine hook ran in the worker
    else:
        # the actor was built from the NVFP4 checkpoint (no BF16 weights exist) and not converted again
        assert "actor: built from the NVFP4 checkpoint" in log and "model-nvfp4" in log
        assert "Linear layers already NVFP4" in log and "actor: Linear layers converted" not in log
        assert f"model='{work / 'model-nvfp4'}'" in log  # vLLM loaded the NVFP4 checkpoint (with qerl_nvfp4)
    assert "qerl_nvfp4" in log  # vLLM was started with our quantization method
    # the rollout engine verl built ran the adapter on QeRL's single-adapter LoRA path on every quantized layer
    # (qkv, o, gate_up, down per decoder layer), not on vLLM's own punica path: the record each LoRA manager of the
    # vLLM worker leaves (the worker's own log line does not reach main_ppo's log)
    layers = json.loads((work / "model" / "config.json").read_text())["num_hidden_layers"]
    recs = decode_stats.read_fast_path_records(tmp_path / "stats")
    assert recs and all(r["layers"] == 4 * layers and r["not_used"] is None for r in recs), recs
    assert decode_stats.read_records(tmp_path / "stats"), "no decode-step record from the rollout engine"
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
