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
    from verl_qerl.checkpoint_conversion import quantize_checkpoint
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
        runs = r["prefill_s_runs"]  # the prefill timed three times, the median reported
        assert len(runs) == 3 and all(t > 0 for t in runs) and r["prefill_s"] == sorted(runs)[1], r
        assert r["output_tokens"] == r["batch"] * 8 and r["lora"] is True
        # proof of the LoRA path: the tiny model's 8 qerl_nvfp4 linear layers on the fast path (default auto)
        assert r["lora_fast_path_layers"] == (8 if r["backend"] == "qerl_nvfp4" else 0), r
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


# --merge: rows of an earlier rollout JSON are kept (one GPU call is 10 minutes), re-run pairs replace them

WORKLOAD = {"prompt_tokens": 256, "new_tokens": 1024, "batches": [1, 8], "lora_rank": 32, "seed": 0}


def _rows(model: str, backend: str, batches, tok_s: float) -> list[dict]:
    return [{"model": model, "backend": backend, "batch": b, "tok_s": tok_s * b, "decode_tok_s": tok_s * b,
             "prefill_tok_s": 1000.0} for b in batches]


def _result(rows, skipped=(), models=None, batches=(1, 8), device="NVIDIA H100") -> dict:
    return {"benchmark": "rollout", "device": device, "workload": {**WORKLOAD, "batches": list(batches)},
            "models": models or {}, "rows": rows, "skipped": list(skipped), "errors": [], "targets": []}


def _write(tmp_path, name: str, res: dict) -> str:
    (tmp_path / name).write_text(json.dumps(res))
    return str(tmp_path / name)


def test_merge_keeps_old_rows_and_replaces_rerun_pairs(tmp_path):
    rb = _load_script()
    old = _result(_rows("7b", "bf16", (1, 8, 64), 100.0) + _rows("7b", "qerl_nvfp4", (1, 8, 64), 120.0),
                  skipped=[{"model": "32b", "backend": "nf4", "reason": "no BF16 checkpoint"},
                           {"model": "7b", "backend": "ct_marlin", "reason": "old skip"}],
                  models={"7b": {"build_s": 1.0}}, batches=(1, 8, 64))
    path = _write(tmp_path, "rollout-old.json", old)
    previous = rb.read_previous([path], WORKLOAD, "NVIDIA H100")
    # now: 7b qerl_nvfp4 re-run (B=1,8 only) and ct_marlin measured; 32b bf16 measured
    now = _result(_rows("7b", "qerl_nvfp4", (1, 8), 170.0) + _rows("7b", "ct_marlin", (1, 8), 160.0)
                  + _rows("32b", "bf16", (1, 8), 40.0), models={"32b": {"build_s": 2.0}})
    final = rb.merge_previous(now, previous, ["32b", "7b"], [8, 1])
    got = {(r["model"], r["backend"], r["batch"]): r for r in final["rows"]}
    # the re-run pair replaces all its old rows (its B=64 row too), untouched pairs stay with their file named
    assert {k for k in got if k[1] == "qerl_nvfp4"} == {("7b", "qerl_nvfp4", 1), ("7b", "qerl_nvfp4", 8)}
    assert got[("7b", "qerl_nvfp4", 8)]["tok_s"] == 1360.0 and "merged_from" not in got[("7b", "qerl_nvfp4", 8)]
    assert {k for k in got if k[1] == "bf16" and k[0] == "7b"} == {("7b", "bf16", b) for b in (1, 8, 64)}
    assert got[("7b", "bf16", 64)]["merged_from"] == path
    assert [(r["model"], r["backend"], r["batch"]) for r in final["rows"]][:3] == [
        ("7b", "bf16", 1), ("7b", "bf16", 8), ("7b", "bf16", 64)]  # SHAPES, BACKENDS, batch order
    # skips: the old 32b nf4 stays, the old 7b ct_marlin goes (measured now)
    assert final["skipped"] == [{"model": "32b", "backend": "nf4", "reason": "no BF16 checkpoint"}]
    assert final["models"] == {"7b": {"build_s": 1.0}, "32b": {"build_s": 2.0}}
    assert final["merged_from"] == [path]
    assert final["workload"]["models"] == ["7b", "32b"] and final["workload"]["batches"] == [1, 8, 64]
    # targets over the union: 7b B=1 ratio from the new qerl_nvfp4 row over the merged bf16 row
    t = {x["name"]: x for x in final["targets"]}
    assert t["7b B=1: qerl_nvfp4 / bf16 output tok/s (LoRA)"]["measured"] == pytest.approx(1.7)
    assert t["7b B=8: qerl_nvfp4 / ct_marlin output tok/s (LoRA)"]["measured"] == pytest.approx(170 / 160)
    assert t["32b B=1: qerl_nvfp4 / nf4 output tok/s (LoRA)"]["note"] == "no BF16 checkpoint"
    assert t["7b B=64: qerl_nvfp4 / nf4 output tok/s (LoRA)"]["measured"] is None
    assert len(final["targets"]) == len(rb.make_targets([], ["7b", "32b"], [1, 8, 64], {}))
    table = rb.ratio_table(final["rows"], final["workload"]["models"], final["workload"]["batches"])
    assert "| 7b | 64 |" in table and "| 32b | 8 |" in table
    assert now["rows"] and len(now["rows"]) == 6  # the current result itself is not changed


def test_merge_later_file_wins_a_pair_and_nothing_merged_is_a_no_op(tmp_path):
    rb = _load_script()
    a = _write(tmp_path, "a.json", _result(_rows("7b", "bf16", (1, 8), 100.0)))
    b = _write(tmp_path, "b.json", _result(_rows("7b", "bf16", (1,), 90.0)))
    final = rb.merge_previous(_result([]), rb.read_previous([a, b], WORKLOAD, "NVIDIA H100"), ["7b"], [1, 8])
    assert [(r["batch"], r["tok_s"], r["merged_from"]) for r in final["rows"]] == [(1, 90.0, b)]
    now = _result(_rows("7b", "bf16", (1, 8), 100.0) + _rows("7b", "qerl_nvfp4", (1, 8), 150.0))
    plain = rb.merge_previous(now, [], ["7b"], [1, 8])
    assert plain["rows"] == now["rows"] and plain["merged_from"] == []
    assert plain["targets"] == rb.make_targets(now["rows"], ["7b"], [1, 8], {})


def test_merge_with_other_workload_or_device_is_refused(tmp_path):
    rb = _load_script()
    path = _write(tmp_path, "old.json", _result(_rows("7b", "bf16", (1,), 100.0)))
    for key, value in (("new_tokens", 512), ("prompt_tokens", 128), ("lora_rank", None), ("seed", 1)):
        with pytest.raises(rb.BenchError, match=rf"{path}.*{key}: .* there, {value!r} here"):
            rb.read_previous([path], {**WORKLOAD, key: value}, "NVIDIA H100")
    with pytest.raises(rb.BenchError, match=rf"{path}.*device 'NVIDIA H100' there, 'NVIDIA H200' here"):
        rb.read_previous([path], WORKLOAD, "NVIDIA H200")
    assert rb.read_previous([path], {**WORKLOAD, "batches": [64]}, "NVIDIA H100")[0][0] == path  # batches may differ
    bad = _write(tmp_path, "bad.json", {"rows": []})
    for p in (bad, str(tmp_path / "missing.json")):
        with pytest.raises(rb.BenchError, match=p):
            rb.read_previous([p], WORKLOAD, "NVIDIA H100")


def test_merge_error_exits_2_naming_the_file(tmp_path):
    path = _write(tmp_path, "old.json", _result(_rows("tiny", "bf16", (1,), 100.0), device="cpu"))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--new-tokens", "4", "--merge", path,
                           "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert path in proc.stderr and "new_tokens: 1024 there, 4 here" in proc.stderr
    assert not list((tmp_path / "out").glob("*.json"))  # refused before anything was written


def test_child_that_dies_keeps_the_batches_it_measured(tmp_path, monkeypatch):
    """A 32B engine that times out at B=256 must not lose B=1..64 (the rows it already measured): the parent keeps
    every row the child logged before dying, and a child that logged none returns no rows."""
    rb = _load_script()
    row = {"model": "32b", "backend": "qerl_nvfp4", "batch": 8, "tok_s": 496.9}
    fake = tmp_path / "fake_child.py"
    fake.write_text("import json, sys, time\n"
                    f"print({rb.ROW_PREFIX!r} + json.dumps({row!r}), flush=True)\n"
                    "print('[rollout] 32b qerl_nvfp4 B=   8 ...', flush=True)\n"
                    "time.sleep(30) if 'sleep' in open(sys.argv[2]).read() else sys.exit(3)\n")
    monkeypatch.setattr(rb, "HERE", fake)
    crashed = rb.run_child({"kind": "bench"}, tmp_path / "a", 60, "crash")
    assert crashed["error"].startswith("rc=3") and crashed["rows"] == [row]
    timed_out = rb.run_child({"kind": "bench", "sleep": 1}, tmp_path / "b", 2, "slow")
    assert timed_out["error"].startswith("rc=timeout") and timed_out["rows"] == [row]
    fake.write_text("import sys; sys.exit(4)\n")
    assert rb.run_child({"kind": "bench"}, tmp_path / "c", 60, "none")["rows"] == []


def _lora_rows(model: str, backend: str, batches, tok_s: float, prefill_s: float, lora: bool) -> list[dict]:
    return [{**r, "lora": lora, "prefill_s": prefill_s} for r in _rows(model, backend, batches, tok_s)]


def test_lora_split_targets_and_table():
    """--lora-split: each backend with and without the adapter in one result; the cross-backend targets use the
    LoRA rows, the with / without LoRA targets compare qerl_nvfp4 to itself, and the table shows both."""
    rb = _load_script()
    rows = (_lora_rows("7b", "bf16", (1, 8), 100.0, 0.04, True) + _lora_rows("7b", "bf16", (1, 8), 130.0, 0.03, False)
            + _lora_rows("7b", "qerl_nvfp4", (1, 8), 180.0, 0.02, True)
            + _lora_rows("7b", "qerl_nvfp4", (1, 8), 190.0, 0.015, False))
    t = {x["name"]: x for x in rb.make_targets(rows, ["7b"], [1, 8], {})}
    assert t["7b B=1: qerl_nvfp4 / bf16 output tok/s (LoRA)"]["measured"] == pytest.approx(1.8)
    keep = t["7b B=8: qerl_nvfp4 with LoRA / without LoRA output tok/s"]
    assert keep["measured"] == pytest.approx(180 / 190, abs=1e-4) and keep["op"] == ">=" and keep["target"] == 0.9
    prefill = t["7b B=1: qerl_nvfp4 prefill time with LoRA / without LoRA"]
    assert prefill["measured"] == pytest.approx(0.02 / 0.015, abs=1e-4)
    assert prefill["op"] == "<=" and prefill["target"] == 1.3
    assert rb.target_status(prefill) == "MISSED" and rb.target_status(keep) == "met"
    table = rb.ratio_table(rows, ["7b"], [1, 8])
    assert "| 7b | 1 | r32 | 100 | 180 |" in table and "| 7b | 1 | off | 130 | 190 |" in table
    assert "with LoRA / without LoRA" in table and "| 7b | 8 | 0.77x | 1.33x | 0.95x | 1.33x |" in table
    # merging keeps the with- and without-LoRA rows of a pair apart: re-running one does not drop the other
    now = {"rows": _lora_rows("7b", "qerl_nvfp4", (1, 8), 200.0, 0.02, True), "skipped": [], "models": {},
           "workload": dict(WORKLOAD)}
    final = rb.merge_previous(now, [("old.json", {"rows": rows, "workload": dict(WORKLOAD)})], ["7b"], [1, 8])
    got = {(r["backend"], r["batch"], r["lora"]): r["tok_s"] for r in final["rows"]}
    assert got[("qerl_nvfp4", 8, True)] == 1600.0 and got[("qerl_nvfp4", 8, False)] == 1520.0 and len(got) == 8


def test_large_batch_target_is_ours_over_bf16_at_b64_and_up():
    """Issue 18's end-to-end target: at 7B from B = 64 on, ours / BF16 >= 1.2 with LoRA; none between 8 and 64."""
    rb = _load_script()
    rows = _lora_rows("7b", "bf16", (32, 64, 256), 8000.0, 0.5, True) + _lora_rows(
        "7b", "qerl_nvfp4", (32, 64, 256), 9000.0, 0.5, True)
    t = {x["name"]: x for x in rb.make_targets(rows, ["7b"], [32, 64, 256], {})}
    for b in (64, 256):
        x = t[f"7b B={b}: qerl_nvfp4 / bf16 output tok/s (LoRA)"]
        assert x["measured"] == pytest.approx(1.125) and x["op"] == ">=" and x["target"] == 1.2
        assert rb.target_status(x) == "MISSED"
    assert "7b B=32: qerl_nvfp4 / bf16 output tok/s (LoRA)" not in t


def test_no_lora_targets_are_labelled_no_lora():
    rb = _load_script()
    rows = _lora_rows("7b", "bf16", (1,), 100.0, 0.04, False) + _lora_rows("7b", "qerl_nvfp4", (1,), 150.0, 0.02,
                                                                           False)
    names = [x["name"] for x in rb.make_targets(rows, ["7b"], [1], {})]
    assert "7b B=1: qerl_nvfp4 / bf16 output tok/s (no LoRA)" in names
    assert not [n for n in names if "(LoRA)" in n or "with LoRA" in n]
    assert rb.parse_args(["--lora-split"]).lora_split
    with pytest.raises(SystemExit):
        rb.parse_args(["--lora-split", "--no-lora"])


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1)


def test_random_checkpoint_takes_a_real_tokenizer_folder(tmp_path):
    """--tokenizer: the folder's tokenizer (here a GGUF's, as qerl-pretrained --tokenizer-only writes it) goes into
    the checkpoint with its EOS / pad ids; the marker keys reuse on it; a tokenizer larger than the vocab is refused
    before anything is written."""
    from transformers import AutoTokenizer

    from verl_qerl.testing.tiny_gguf import write_tiny_gguf

    rb = _load_script()
    (tmp_path / "g").mkdir()
    gguf_file = write_tiny_gguf(tmp_path / "g" / "t.gguf")
    tok_dir = tmp_path / "tok"
    ref = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    ref.save_pretrained(tok_dir)
    shape = dict(SMALL, vocab_size=len(ref) + 64)  # padded like Qwen2.5-7B's 152,064 rows for 151,936 ids
    ckpt = rb.write_random_checkpoint(tmp_path / "ckpt", shape, "bf16", device="cpu", show_progress=False,
                                      tokenizer=tok_dir)
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.get_vocab() == ref.get_vocab() and len(tok) == len(ref)
    config = json.loads((ckpt / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (ref.eos_token_id, ref.pad_token_id)
    assert config["vocab_size"] == len(ref) + 64
    done = json.loads((ckpt / rb.DONE).read_text())
    assert done["tokenizer"] == rb.tokenizer_identity(tok_dir) != rb.TINY_TOKENIZER
    assert done["tokenizer_len"] == len(ref)

    stamp = (ckpt / "model-layer-000.safetensors").stat().st_mtime_ns
    assert rb.write_random_checkpoint(ckpt, shape, "bf16", device="cpu", show_progress=False, tokenizer=tok_dir)
    assert (ckpt / "model-layer-000.safetensors").stat().st_mtime_ns == stamp  # same tokenizer: reused
    rb.write_random_checkpoint(ckpt, shape, "bf16", device="cpu", show_progress=False)  # the tiny one: rewritten
    assert len(AutoTokenizer.from_pretrained(ckpt)) == 512
    assert json.loads((ckpt / rb.DONE).read_text())["tokenizer"] == rb.TINY_TOKENIZER

    with pytest.raises(rb.BenchError, match=f"{len(ref)} ids, more than the model's vocab_size {len(ref) - 1}"):
        rb.write_random_checkpoint(tmp_path / "small", dict(SMALL, vocab_size=len(ref) - 1), "bf16", device="cpu",
                                   show_progress=False, tokenizer=tok_dir)
    assert not (tmp_path / "small").exists()
    with pytest.raises(rb.BenchError, match="no tokenizer.json.*--tokenizer-only"):
        rb.write_random_checkpoint(tmp_path / "none", dict(SMALL, vocab_size=512), "bf16", device="cpu",
                                   show_progress=False, tokenizer=tmp_path / "missing")


def test_checkpoints_written_before_the_tokenizer_marker_count_as_the_tiny_one(tmp_path):
    rb = _load_script()
    shape = dict(SMALL, vocab_size=512)
    ckpt = rb.write_random_checkpoint(tmp_path / "c", shape, "bf16", device="cpu", show_progress=False)
    (ckpt / rb.DONE).write_text(json.dumps({"fmt": "bf16", "seed": 0, "bytes": 1}))  # an older marker
    stamp = (ckpt / "config.json").stat().st_mtime_ns
    rb.write_random_checkpoint(ckpt, shape, "bf16", device="cpu", show_progress=False)
    assert (ckpt / "config.json").stat().st_mtime_ns == stamp


def test_verl_samples_only_the_checkpoints_tokenizer_ids(tmp_path):
    """The 512-id artifact, with verl's own logits mask as the oracle: verl's vLLM server masks every logit at or above
    len(tokenizer of the checkpoint); the tiny default leaves 512 ids, a real tokenizer folder leaves all of its."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer
    from verl.workers.rollout.vllm_rollout.utils import monkey_patch_compute_logits

    from verl_qerl.testing.tiny import build_tokenizer

    rb = _load_script()
    build_tokenizer(800).save_pretrained(tmp_path / "tok")  # a larger vocabulary than the tiny default's 512
    shape = dict(SMALL, vocab_size=1024)

    def sampleable(ckpt) -> int:
        model = SimpleNamespace(compute_logits=lambda *a, **k: torch.zeros(2, shape["vocab_size"]))
        monkey_patch_compute_logits(model, len(AutoTokenizer.from_pretrained(ckpt)))
        return int(torch.isfinite(model.compute_logits(None)[0]).sum())

    tiny = rb.write_random_checkpoint(tmp_path / "a", shape, "bf16", device="cpu", show_progress=False)
    real = rb.write_random_checkpoint(tmp_path / "b", shape, "bf16", device="cpu", show_progress=False,
                                      tokenizer=tmp_path / "tok")
    assert sampleable(tiny) == 512
    assert sampleable(real) == 800


def test_compile_cache_is_isolated_per_qerl_setting(monkeypatch):
    """vLLM's compile cache does not key on QERL_* settings (they are baked into the traced graphs), so the rollout
    and LoRA-profile benchmarks give every setting its own VLLM_CACHE_ROOT below the caller's."""
    rb = _load_script()
    for k in [k for k in os.environ if k.startswith("QERL_")]:
        monkeypatch.delenv(k)
    monkeypatch.setattr(rb, "_CACHE_BASE", "/base")
    monkeypatch.setenv("QERL_PDL", "0")
    off = rb.isolate_compile_cache()
    assert off.startswith("/base/qerl-") and os.environ["VLLM_CACHE_ROOT"] == off
    monkeypatch.setenv("QERL_PDL", "1")
    on = rb.isolate_compile_cache()
    assert on != off and on.startswith("/base/qerl-")
    monkeypatch.setenv("QERL_PDL", "0")
    assert rb.isolate_compile_cache() == off  # same settings, same graphs


def test_max_num_seqs_switch_is_checked_against_the_batches():
    rollout = _load_script()
    args = rollout.parse_args(["--batches", "1,8", "--max-num-seqs", "512"])
    assert args.max_num_seqs == 512
    assert rollout.parse_args(["--batches", "1,8"]).max_num_seqs is None
    with pytest.raises(SystemExit):
        rollout.parse_args(["--batches", "1,64", "--max-num-seqs", "32"])
