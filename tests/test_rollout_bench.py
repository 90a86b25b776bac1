"""benchmarks/rollout.py on CPU: the --tiny pipeline end to end, and its checkpoint writers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_qerl.testing.scripts import load_script

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "rollout.py"


def _load_script():
    return load_script("benchmarks/rollout.py", "rollout_bench")


def test_direct_nvfp4_checkpoint_matches_quantize_checkpoint(tmp_path):
    """The 32B path (NVFP4 written directly) gives the same bits as quantize_checkpoint of the BF16 one."""
    from verl_qerl.convert import quantize_checkpoint
    from verl_qerl.nvfp4.checkpoint import CheckpointReader

    rb = _load_script()
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=512)
    bf16 = rb.write_random_checkpoint(tmp_path / "bf16", shape, "bf16", device="cpu", show_progress=False)
    direct = rb.write_random_checkpoint(tmp_path / "direct", shape, "nvfp4", device="cpu", show_progress=False)
    quantize_checkpoint(bf16, tmp_path / "converted")
    a, b = CheckpointReader(direct), CheckpointReader(tmp_path / "converted")
    assert a.format == b.format == "compressed-tensors"
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        x, y = a.get(name), b.get(name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                           y.view(torch.uint8) if y.element_size() == 1 else y), name
    w = CheckpointReader(bf16).get("model.layers.0.mlp.down_proj.weight").float()
    assert abs(w.std().item() - 0.02) < 2e-3
    assert rb.checkpoint_bytes(shape, "bf16") == sum(
        p.stat().st_size for p in bf16.glob("*.safetensors")) - sum(  # minus safetensors headers
        len(p.read_bytes()[:8]) + int.from_bytes(p.read_bytes()[:8], "little") for p in bf16.glob("*.safetensors"))


def test_unknown_backend_is_a_clear_error():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--backends", "bf16,fp8"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown backend" in proc.stderr and "fp8" in proc.stderr


def test_disk_check_names_needed_and_free(tmp_path):
    rb = _load_script()
    with pytest.raises(rb.BenchError, match=r"needs .* GB .* GB free"):
        rb.check_disk(tmp_path, 10**18, "the bf16 checkpoint")


def test_tiny_rollout_writes_rows_and_targets(tmp_path):
    pytest.importorskip("vllm")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("OUT", None)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--work-dir", str(tmp_path / "work"),
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    files = list(out.glob("rollout-*.json"))
    assert len(files) == 1, files
    res = json.loads(files[0].read_text())
    for key in ("device", "versions", "command", "date", "rows", "targets"):
        assert key in res, key
    assert {"torch", "vllm", "transformers"} <= set(res["versions"])
    backends = {r["backend"] for r in res["rows"]}
    assert backends == {"bf16", "qerl_nvfp4"}, backends
    assert {(r["backend"], r["batch"]) for r in res["rows"]} == {(b, n) for b in backends for n in (1, 2)}
    for r in res["rows"]:
        assert r["tok_s"] > 0 and r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0, r
        assert r["output_tokens"] == r["batch"] * 8 and r["lora"] is True
    assert {s["backend"] for s in res["skipped"]} == {"ct_marlin", "nf4"}
    assert "skipped on CPU" in log
    targets = res["targets"]
    assert targets and all(set(t) >= {"name", "measured", "op", "target"} for t in targets)
    assert all(t["op"] in (">=", "<=") and isinstance(t["target"], float) for t in targets)
    bf16_targets = [t for t in targets if "/ bf16" in t["name"]]
    assert len(bf16_targets) == 2 and all(t["measured"] > 0 for t in bf16_targets)
    assert all(t["measured"] is None and t["note"] for t in targets if "/ bf16" not in t["name"])
    tail = proc.stdout.strip().splitlines()
    assert tail[-1].startswith("| tiny | 2 |")  # the ratio table comes last
