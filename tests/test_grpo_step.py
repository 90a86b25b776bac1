"""benchmarks/grpo_step.py: its overrides compose in verl's real config, and its summaries/targets are right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_qerl.testing.scripts import load_script

gs = load_script("benchmarks/grpo_step.py", "grpo_step")


@pytest.mark.parametrize("variant", sorted(gs.VARIANTS))
@pytest.mark.parametrize("tiny", [False, True])
def test_overrides_compose_in_verls_config(variant, tiny, tmp_path):
    from hydra import compose, initialize_config_module

    from verl_qerl.verl.config import apply_qerl

    args = gs.parse_args(["--variants", variant, "--batch", "4", "--n", "2", "--micro-batch", "4", "--seed", "7"]
                         + (["--tiny"] if tiny else []))
    ov = gs.main_ppo_overrides(args, variant, 2, tmp_path / "m", tmp_path / "t.parquet", tmp_path / "v.parquet")
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=ov)
    assert cfg.qerl.mode == gs.VARIANTS[variant].split("_")[0]
    assert cfg.trainer.n_gpus_per_node == 2 and cfg.actor_rollout_ref.rollout.seed == 7
    assert cfg.actor_rollout_ref.model.lora_rank == 32 and cfg.qerl.replay_poll_s == 0.1
    apply_qerl(cfg)  # the plugin's own validation accepts it


def _steps(n: int, step_s: float, tokens: int, score0: float = 0.1) -> list[dict]:
    return [{"training/global_step": i + 1, "timing_s/step": step_s * (3 if i == 0 else 1), "timing_s/gen": step_s / 2,
             "timing_s/update_actor": step_s / 4, "timing_s/old_log_prob": 0.1, "timing_s/update_weights": 0.05,
             "perf/total_num_tokens": tokens, "critic/score/mean": score0 + 0.1 * i, "actor/pg_loss": 0.01 * i,
             "actor/entropy": 1.0, "actor/perf/max_memory_allocated_gb": 3.0 + i} for i in range(n)]


def test_summary_drops_the_warmup_step_and_computes_throughput():
    s = gs.summarize_run(_steps(4, 2.0, 1000), gpus=2)
    assert s["step_s"] == pytest.approx(2.0)  # the 6 s first step is left out
    assert s["tokens_per_s"] == pytest.approx(500.0) and s["tokens_per_s_per_gpu"] == pytest.approx(250.0)
    assert s["actor_peak_allocated_gb"] == 6.0 and s["steps_measured"] == 3
    assert s["curves"]["critic/score/mean"][0] == pytest.approx(0.1)


def test_targets_for_both_comparisons():
    rows = [{"variant": "qerl", "gpus": 1, **gs.summarize_run(_steps(4, 3.0, 900), 1)},
            {"variant": "lora", "gpus": 1, **gs.summarize_run(_steps(4, 4.0, 900), 1)}]
    ratios, targets = gs.compare(rows, "variants")
    assert targets == [{"name": "grpo_step_time_ratio[qerl/lora]", "measured": pytest.approx(0.75), "op": "<=",
                        "target": 0.75}]
    rows = [{"variant": "qerl", "gpus": 1, **gs.summarize_run(_steps(4, 4.0, 1000), 1)},
            {"variant": "qerl", "gpus": 2, **gs.summarize_run(_steps(4, 2.5, 1000, score0=0.2), 2)}]
    ratios, targets = gs.compare(rows, "gpus")
    assert ratios["throughput_ratio"] == pytest.approx(1.6) and ratios["scaling_efficiency"] == pytest.approx(0.8)
    assert ratios["max_abs_diff[critic/score/mean]"] == pytest.approx(0.1)
    thr = next(t for t in targets if t["name"] == "throughput_2gpu_over_1gpu")
    assert thr["op"] == ">=" and thr["measured"] == pytest.approx(1.6)
    # a failed run gives no target rather than a wrong one
    assert gs.compare([rows[0], {"variant": "qerl", "gpus": 2, "error": "rc=1"}], "gpus")[1] == []


def test_metrics_reader_sorts_by_step(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text("\n".join(json.dumps({"step": s, "data": {"timing_s/step": float(s)}}) for s in (2, 1, 3)) + "\n")
    assert [r["timing_s/step"] for r in gs.read_metrics(f)] == [1.0, 2.0, 3.0]
    assert gs.read_metrics(tmp_path / "missing.jsonl") == []


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        gs.parse_args(["--variants", "qerl,fp8"])
    assert "--variants" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gs.parse_args(["--batch", "3", "--n", "3", "--micro-batch", "4"])
    assert "--micro-batch" in capsys.readouterr().err


# --baseline: rows of an earlier results JSON are reused instead of run again (one remote call is 10 minutes)

DEVICE = "NVIDIA H100 80GB HBM3"


def _row(variant: str, gpus: int, step_s: float) -> dict:
    return {"variant": variant, "qerl": gs.VARIANTS[variant], "gpus": gpus, "rc": 0,
            **gs.summarize_run(_steps(4, step_s, 900), gpus)}


def _baseline(tmp_path, argv: list[str], rows: list[dict], device: str = DEVICE, **settings) -> str:
    args = gs.parse_args(argv)
    res = {"benchmark": "grpo_step", "device": device, "rows": rows,
           "settings": {k: v for k, v in vars(args).items() if k != "extra"} | settings}
    path = tmp_path / f"base-{len(list(tmp_path.glob('base-*')))}.json"
    path.write_text(json.dumps(res, default=str))
    return str(path)


@pytest.fixture
def fake_runs(monkeypatch, tmp_path):
    """main() without main_ppo: run_one records its calls and returns a fake row."""
    calls: list[tuple] = []

    def run_one(args, variant, gpus, gpu_ids, inputs, work, cpus=None):
        assert cpus is None or args.cpu_split  # CPUs are pinned only on request
        calls.append((variant, gpus, gpu_ids))
        return _row(variant, gpus, 3.0 if variant == "qerl" else 4.0)

    monkeypatch.setattr(gs, "run_one", run_one)
    monkeypatch.setattr(gs, "build_inputs", lambda args, work: (tmp_path / "m", tmp_path / "t", tmp_path / "v"))
    monkeypatch.setattr(gs, "device_name", lambda: DEVICE)
    monkeypatch.setattr(gs, "versions", lambda: {})
    return calls


def _main(tmp_path, argv: list[str]) -> tuple[int, dict]:
    out = tmp_path / "out"
    rc = gs.main(argv + ["--out", str(out), "--work-dir", str(tmp_path / "work")])
    files = list(out.glob("grpo_step-*.json"))
    return rc, (json.loads(files[0].read_text()) if files else {})


def test_baseline_rows_are_reused_in_variants_order(fake_runs, tmp_path, capsys):
    base = _baseline(tmp_path, ["--variants", "lora"], [_row("lora", 1, 4.0)])
    rc, res = _main(tmp_path, ["--variants", "qerl,lora", "--baseline", base])
    assert rc == 0 and fake_runs == [("qerl", 1, [0])]  # lora is not run again
    assert [r["variant"] for r in res["rows"]] == ["qerl", "lora"]  # qerl stays the numerator
    assert "from_baseline" not in res["rows"][0] and res["rows"][1]["from_baseline"] == base
    assert res["baselines"] == [base]
    assert res["targets"][0]["name"] == "grpo_step_time_ratio[qerl/lora]"
    assert res["targets"][0]["measured"] == pytest.approx(0.75)
    assert f"[grpo_step] lora-1gpu: from baseline {base}" in capsys.readouterr().out


def test_baseline_skips_only_rows_it_holds(fake_runs, tmp_path):
    # a failed row of the baseline is run again; --concurrent gives the runs left GPUs 0, 1, ...
    base = _baseline(tmp_path, ["--variants", "qerl,lora,nvfp4"],
                     [_row("qerl", 1, 3.0), {"variant": "lora", "gpus": 1, "error": "rc=1, 0 steps logged"}])
    rc, res = _main(tmp_path, ["--variants", "qerl,lora,nvfp4", "--concurrent", "--baseline", base])
    assert rc == 0 and sorted(fake_runs) == [("lora", 1, [0]), ("nvfp4", 1, [1])]
    assert [r["variant"] for r in res["rows"]] == ["qerl", "lora", "nvfp4"]
    assert [bool(r.get("from_baseline")) for r in res["rows"]] == [True, False, False]


def test_baseline_for_gpus_comparison(fake_runs, tmp_path):
    one = _baseline(tmp_path, ["--compare", "gpus"], [_row("qerl", 1, 3.0)])
    rc, res = _main(tmp_path, ["--compare", "gpus", "--baseline", one])
    assert rc == 0 and fake_runs == [("qerl", 2, [0, 1])]
    assert [(r["variant"], r["gpus"]) for r in res["rows"]] == [("qerl", 1), ("qerl", 2)]
    # both rows from baselines (a later file wins): nothing runs, no inputs are built, targets still computed
    fake_runs.clear()
    two = _baseline(tmp_path, ["--compare", "gpus"], [_row("qerl", 2, 2.0)])
    rc, res = _main(tmp_path, ["--compare", "gpus", "--baseline", one, "--baseline", two])
    assert rc == 0 and fake_runs == []
    assert [r["from_baseline"] for r in res["rows"]] == [one, two] and res["baselines"] == [one, two]
    assert res["targets"][0]["measured"] == pytest.approx(1.5)


def test_baseline_with_other_settings_is_refused(fake_runs, tmp_path, capsys):
    base = _baseline(tmp_path, ["--variants", "lora", "--steps", "6", "--lr", "2e-5"], [_row("lora", 1, 4.0)])
    rc, _ = _main(tmp_path, ["--baseline", base])
    err = capsys.readouterr().err
    assert rc == 2 and fake_runs == []
    assert base in err and "steps: 6 there, 4 here" in err and "lr: 2e-05 there, 1e-05 here" in err
    assert "variants" not in err.split(base)[1]  # which variants ran is not a setting of the measurement


def test_baseline_from_another_device_is_refused(fake_runs, tmp_path, capsys):
    base = _baseline(tmp_path, ["--variants", "lora"], [_row("lora", 1, 4.0)], device="NVIDIA H200")
    rc, _ = _main(tmp_path, ["--baseline", base])
    err = capsys.readouterr().err
    assert rc == 2 and fake_runs == []
    assert "'NVIDIA H200'" in err and repr(DEVICE) in err


def test_baseline_that_is_not_a_results_file(fake_runs, tmp_path, capsys):
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    for path in (tmp_path / "missing.json", tmp_path / "other.json"):
        rc, _ = _main(tmp_path, ["--baseline", str(path)])
        assert rc == 2 and str(path) in capsys.readouterr().err
    assert fake_runs == []


def test_merge_only_combines_baselines_without_a_gpu(fake_runs, tmp_path, monkeypatch, capsys):
    """Each variant of a long preset runs on its own machine; the comparison is written afterwards, here."""
    monkeypatch.setattr(gs, "device_name", lambda: pytest.fail("--merge-only must not look for a GPU"))
    h200 = "NVIDIA H200"
    q = _baseline(tmp_path, ["--variants", "qerl"], [_row("qerl", 1, 3.0)], device=h200)
    lo = _baseline(tmp_path, ["--variants", "lora"], [_row("lora", 1, 4.0)], device=h200)
    for path, ver in ((q, "0.24.0"), (lo, "0.24.0-other")):
        res = json.loads(Path(path).read_text())
        Path(path).write_text(json.dumps({**res, "versions": {"vllm": ver}}))
    rc, res = _main(tmp_path, ["--variants", "qerl,lora", "--merge-only", "--baseline", q, "--baseline", lo])
    assert rc == 0 and fake_runs == []
    assert res["device"] == h200 and res["versions"] == {"vllm": "0.24.0"}
    assert [r["from_baseline"] for r in res["rows"]] == [q, lo]
    assert res["targets"][0]["measured"] == pytest.approx(0.75)
    # a planned run that no file holds: refused, nothing written
    rc, res = _main(tmp_path, ["--variants", "qerl,lora,nvfp4", "--merge-only", "--baseline", q, "--baseline", lo])
    assert rc == 2 and "no --baseline row for nvfp4 on 1 GPU(s)" in capsys.readouterr().err
    # files from two devices: refused, naming both
    other = _baseline(tmp_path, ["--variants", "lora"], [_row("lora", 1, 4.0)], device="NVIDIA H100 80GB HBM3")
    rc, _ = _main(tmp_path, ["--variants", "qerl,lora", "--merge-only", "--baseline", q, "--baseline", other])
    err = capsys.readouterr().err
    assert rc == 2 and "different devices" in err and "H100" in err and h200 in err
    with pytest.raises(SystemExit):
        gs.parse_args(["--merge-only"])
    assert "--merge-only needs" in capsys.readouterr().err


def test_memory_targets_count_a_run_that_timed_out_after_its_first_step():
    """The 32B memory claim: a logged step and the nvidia-smi peak, even when step 2 ran into --timeout."""
    rows = [{"variant": "qerl", "gpus": 1, "steps_logged": 1, "gpu_peak_used_gb_max": 65.1, "error": "rc=timeout"},
            {"variant": "qerl", "gpus": 1, "steps_logged": 0}]
    t = gs.memory_targets(rows, 80.0)
    assert [(x["measured"], x["op"], x["target"]) for x in t] == [(1, ">=", 1), (65.1, "<=", 80.0), (0, ">=", 1),
                                                                 (None, "<=", 80.0)]
    assert [gs.target_status(x) for x in t] == ["met", "met", "MISSED", "-"]


def test_learning_parity_is_a_paired_z_of_the_step_differences():
    x = [0.30, 0.35, 0.32, 0.40, 0.38, 0.41]
    noise = [0.01, -0.02, 0.015, -0.01, 0.005, -0.004]
    z, info = gs.paired_z(x, [a + e for a, e in zip(x, noise, strict=True)])
    assert z < 1 and info["steps"] == 6 and not info["constant"]
    z, _ = gs.paired_z(x, [a + 0.05 + e / 5 for a, e in zip(x, noise, strict=True)])  # learns differently
    assert z > gs.PARITY_Z_LIMIT
    assert gs.paired_z([0.0] * 5, [0.0] * 5) == (0.0, {"steps": 5, "mean_diff": 0.0, "constant": True})
    assert gs.paired_z([1.0, None, 2.0], [1.0, 3.0, None])[0] is None  # fewer than 3 shared steps
    rows = [{"variant": "qerl", "gpus": g, **gs.summarize_run(_steps(6, 2.0, 1000, score0=s), g)}
            for g, s in ((1, 0.1), (2, 0.5))]
    _, targets = gs.compare(rows, "gpus")
    z_score = next(t for t in targets if t["name"] == "learning_parity_paired_z[critic/score/mean]")
    assert z_score["measured"] > 1e6 and gs.target_status(z_score) == "MISSED"  # a constant +0.4 shift
    _, targets = gs.compare(rows, "gpus", concurrent=True)  # GPUs shared: parity targets, no time target
    assert [t["name"] for t in targets if "throughput" in t["name"]] == []
    assert {t["name"] for t in targets} == {f"learning_parity_paired_z[{k}]" for k in gs.PARITY_METRICS}


def test_baseline_from_before_the_polling_option_counts_as_verls_2s(fake_runs, tmp_path, capsys):
    """Results written before --replay-poll-s ran under verl's 2 s polling: they only merge with --replay-poll-s 2."""
    base = _baseline(tmp_path, ["--variants", "lora"], [_row("lora", 1, 4.0)])
    res = json.loads(Path(base).read_text())
    assert res["settings"]["replay_poll_s"] == 0.1
    del res["settings"]["replay_poll_s"]
    Path(base).write_text(json.dumps(res))
    rc, _ = _main(tmp_path, ["--baseline", base])
    assert rc == 2 and fake_runs == [] and "replay_poll_s: 2.0 there, 0.1 here" in capsys.readouterr().err
    rc, res = _main(tmp_path, ["--baseline", base, "--replay-poll-s", "2"])
    assert rc == 0 and fake_runs == [("qerl", 1, [0])] and res["rows"][1]["from_baseline"] == base


def test_the_polling_interval_reaches_main_ppo(tmp_path):
    args = gs.parse_args(["--replay-poll-s", "0.25"])
    ov = gs.main_ppo_overrides(args, "qerl", 1, tmp_path / "m", tmp_path / "t", tmp_path / "v")
    assert "qerl.replay_poll_s=0.25" in ov
    with pytest.raises(SystemExit):
        gs.parse_args(["--replay-poll-s", "0"])


def test_72b_preset_writes_an_nvfp4_checkpoint_of_the_qwen25_72b_shape(monkeypatch, tmp_path):
    written = []
    monkeypatch.setattr(gs, "write_random_checkpoint", lambda folder, shape, fmt, seed, tokenizer: written.append(
        (folder, shape, fmt)) or folder)
    args = gs.parse_args(["--model", "72b", "--variants", "qerl", "--micro-batch", "1", "--ckpt-dir", str(tmp_path)])
    model, _, _ = gs.build_inputs(args, tmp_path / "work")
    (folder, shape, fmt), = written
    assert fmt == "nvfp4" and folder == tmp_path / "72b" / "nvfp4" and model == folder.resolve()
    assert (shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]) == (8192, 29568, 80)
    assert (shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"]) == (64, 8, 152064)
    with pytest.raises(gs.StepBenchError, match="72b.*NVFP4 variants only"):
        gs.build_inputs(gs.parse_args(["--model", "72b", "--variants", "qerl,lora"]), tmp_path / "work")


def test_per_rank_base_bytes_are_read_from_the_actor_log():
    """The per-rank figure the 2-GPU memory target is read from: one line per FSDP rank, the largest kept."""
    log = ("(WorkerDict pid=1) [verl-qerl] actor: NVFP4 base of 196 layers sharded over 2 FSDP2 ranks (gathered "
           "per layer); this rank holds 1836000000 of 3672000000 base bytes\n"
           "noise\n(WorkerDict pid=2) [verl-qerl] actor: NVFP4 base of 196 layers sharded over 2 FSDP2 ranks "
           "(gathered per layer); this rank holds 1836000512 of 3672000000 base bytes\n")
    assert gs.base_bytes_held(log) == [1836000000, 1836000512]
    assert gs.base_bytes_held("no sharding here") == []


# --preset reasoning (issue 20)

def _tok_dir(tmp_path: Path) -> Path:
    """A tokenizer folder the preset accepts (the tiny BPE saved: only tokenizer.json's content matters here)."""
    from verl_qerl.testing.tiny import build_tokenizer

    d = tmp_path / "tok"
    if not (d / "tokenizer.json").is_file():
        build_tokenizer(512).save_pretrained(d)
    return d


@pytest.mark.parametrize("variant", ["qerl", "lora"])
def test_reasoning_preset_composes_in_verls_config(variant, tmp_path):
    from hydra import compose, initialize_config_module

    from verl_qerl.verl.config import apply_qerl

    args = gs.parse_args(["--preset", "reasoning", "--variants", variant, "--tokenizer", str(_tok_dir(tmp_path))])
    ov = gs.main_ppo_overrides(args, variant, 1, tmp_path / "m", tmp_path / "t.parquet", tmp_path / "v.parquet")
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=ov)
    r, a = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    assert cfg.data.train_batch_size * r.n == 256 and cfg.data.max_response_length == 2048 and r.ignore_eos
    assert r.temperature == 1.0 and r.gpu_memory_utilization == 0.5 and r.max_model_len == 128 + 2048 + 8
    assert cfg.actor_rollout_ref.model.lora_rank == 32 and a.ppo_mini_batch_size == 32
    assert a.optim.lr == {"qerl": 1e-5, "lora": 5e-6}[variant]  # the paper's, per variant
    assert cfg.trainer.total_training_steps == 3 and a.ppo_micro_batch_size_per_gpu == 4
    apply_qerl(cfg)


def test_preset_values_yield_to_explicit_flags_and_generic_defaults_stay(tmp_path):
    args = gs.parse_args(["--preset", "reasoning", "--steps", "2", "--lr", "3e-5", "--tokenizer",
                          str(_tok_dir(tmp_path))])
    assert (args.steps, args.lr, args.batch, args.response_length) == (2, 3e-5, 32, 2048)
    assert gs.lr_for(args, "lora") == 3e-5
    plain = gs.parse_args([])
    assert {k: getattr(plain, k) for k in gs.GENERIC} == gs.GENERIC and plain.preset is None
    assert plain.tokenizer_id is None  # the random checkpoints' own (tiny) tokenizer, as before the preset
    with pytest.raises(SystemExit):
        gs.parse_args(["--lr", "fast"])


def test_preset_without_its_tokenizer_names_the_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(gs.PRESETS["reasoning"], "tokenizer", str(tmp_path / "absent"))
    with pytest.raises(SystemExit):
        gs.parse_args(["--preset", "reasoning"])
    err = capsys.readouterr().err
    assert "--tokenizer" in err and "absent" in err and "qerl-pretrained qwen2.5-coder-0.5b --tokenizer-only" in err
    with pytest.raises(SystemExit):
        gs.parse_args(["--tiny", "--tokenizer", str(_tok_dir(tmp_path))])
    assert "--tokenizer is for the random" in capsys.readouterr().err


def test_preset_checkpoint_gets_the_tokenizer(monkeypatch, tmp_path):
    written = []
    monkeypatch.setattr(gs, "write_random_checkpoint", lambda folder, shape, fmt, seed, tokenizer: written.append(
        (folder, fmt, tokenizer)) or folder)
    tok = _tok_dir(tmp_path)
    args = gs.parse_args(["--preset", "reasoning", "--variants", "lora", "--tokenizer", str(tok), "--ckpt-dir",
                          str(tmp_path / "ck")])
    gs.build_inputs(args, tmp_path / "work")
    assert written == [(tmp_path / "ck" / "7b" / "bf16", "bf16", tok)]


# vLLM 0.24.0's own format strings (vllm/v1/core/kv_cache_utils.py, get_kv_cache_configs, lines 2146-2151):
#   logger.info_once("GPU KV cache size: %s tokens", f"{num_tokens:,}")
#   logger.info_once("Maximum concurrency for %s tokens per request: %.2fx", f"{max_model_len:,}", max_concurrency)
VLLM_KV_FORMAT = "GPU KV cache size: %s tokens"
VLLM_CONCURRENCY_FORMAT = "Maximum concurrency for %s tokens per request: %.2fx"


def test_kv_cache_lines_are_read_in_vllms_own_wording():
    prefix = "(vLLMHttpServer pid=4242) (EngineCore_DP0 pid=4300) INFO 11-24 03:12:44 [kv_cache_utils.py:2146] "
    log = "\n".join([
        "noise", prefix + VLLM_KV_FORMAT % f"{1_234_567:,}",
        prefix + VLLM_CONCURRENCY_FORMAT % (f"{2184:,}", 565.2649),
        prefix + VLLM_KV_FORMAT % f"{988:,}", prefix + VLLM_CONCURRENCY_FORMAT % (f"{96:,}", 10.29),
    ])
    assert gs.kv_cache_report(log) == {"kv_cache_tokens": [1234567, 988], "max_concurrency": [565.26, 10.29],
                                       "max_concurrency_len": [2184, 96]}
    assert gs.kv_cache_report("no engine here") == {"kv_cache_tokens": [], "max_concurrency": [],
                                                    "max_concurrency_len": []}


def _write_steps(folder: Path, rollouts: list[list[int]], t0: float = 1000.0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    lines, t = [], t0
    for ms in rollouts:
        lines.append({"t": t, "gen": ms[0], "prompt": 70 * ms[0], "run": ms[0], "wait": 0, "pre": 0, "kv": 0.2})
        for m in ms[1:]:
            t += 0.02
            lines.append({"t": t, "gen": m, "prompt": 0, "run": m, "wait": 0, "pre": 0, "kv": 0.3})
        t += 0.02
        lines.append({"t": t, "event": "sleep", "level": 1})
        t += 100.0  # training
    (folder / "steps-1-0.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_decode_histogram_leaves_the_warmup_rollout_out(tmp_path):
    _write_steps(tmp_path / "d", [[256, 256, 9], [256] * 4 + [128] * 2, [256] * 3 + [1]])
    h = gs.decode_histogram(tmp_path / "d", steps_logged=3)
    assert [r["decode_steps_by_m"] for r in h["per_rollout"]] == [{9: 1, 256: 1}, {128: 2, 256: 3},
                                                                 {1: 1, 256: 2}]
    assert h["measured"]["decode_steps_by_m"] == {1: 1, 128: 2, 256: 5} and h["measured"]["rollouts"] == 2
    assert [(b["m"], b["decode_steps"]) for b in h["buckets"]] == [("1", 1), ("65-128", 2), ("256", 5)]
    assert "note" not in h
    assert "uncertain" in gs.decode_histogram(tmp_path / "d", steps_logged=4)["note"]
    assert gs.decode_histogram(tmp_path / "none", steps_logged=3) is None


def _preset_row(variant: str, step_s: float, gen_s: float, train_s: float) -> dict:
    steps = [{"training/global_step": i + 1, "timing_s/step": step_s, "timing_s/gen": gen_s,
              "timing_s/old_log_prob": train_s / 4, "timing_s/update_actor": train_s, "timing_s/update_weights": 1.0,
              "perf/total_num_tokens": 256 * 2114} for i in range(3)]
    return {"variant": variant, "qerl": gs.VARIANTS[variant], "gpus": 1, "rc": 0, "kv_cache_tokens": [1000],
            "max_concurrency": [2.0], **gs.summarize_run(steps, 1)}


def test_preset_targets_cover_step_gen_and_training_phases():
    rows = [_preset_row("qerl", 150.0, 28.0, 100.0), _preset_row("lora", 200.0, 50.0, 96.0)]
    rows[1]["kv_cache_tokens"], rows[1]["max_concurrency"] = [500], [1.0]
    ratios, targets = gs.compare(rows, "variants", phase_targets=gs.PRESET_TARGETS["reasoning"])
    got = {t["name"]: (round(t["measured"], 4), t["op"], t["target"]) for t in targets}
    assert got == {"grpo_step_time_ratio[qerl/lora]": (0.75, "<=", 0.80),
                   "gen_time_ratio[qerl/lora]": (0.56, "<=", 0.70),
                   "old_log_prob_time_ratio[qerl/lora]": (1.0417, "<=", 1.05),
                   "update_actor_time_ratio[qerl/lora]": (1.0417, "<=", 1.05)}
    assert [gs.target_status(t) for t in targets] == ["met"] * 4
    assert ratios["kv_cache_tokens_ratio[qerl/lora]"] == 2.0 and ratios["max_concurrency_ratio[qerl/lora]"] == 2.0
    rows[0]["update_actor_s"] = 96.0 * 1.06
    _, targets = gs.compare(rows, "variants", phase_targets=gs.PRESET_TARGETS["reasoning"])
    assert gs.target_status(next(t for t in targets if t["name"].startswith("update_actor"))) == "MISSED"


def test_preset_baseline_merges_one_variant_per_call(fake_runs, tmp_path, monkeypatch):
    """Call 1 runs BF16 LoRA, call 2 runs QeRL and merges it: preset targets over both rows. A baseline of another
    preset, tokenizer or of the plain workload is refused."""
    tok = str(_tok_dir(tmp_path))
    monkeypatch.setattr(gs, "run_one", lambda args, variant, gpus, gpu_ids, inputs, work: fake_runs.append(
        (variant, gpus, gpu_ids)) or _preset_row(variant, *((150.0, 28.0, 100.0) if variant == "qerl"
                                                           else (200.0, 50.0, 96.0))))
    rc, res1 = _main(tmp_path / "c1", ["--preset", "reasoning", "--variants", "lora", "--tokenizer", tok])
    assert rc == 0 and fake_runs == [("lora", 1, [0])]
    base = next((tmp_path / "c1" / "out").glob("grpo_step-7b-reasoning-variants-*.json"))
    assert res1["settings"]["lr"] == "paper" and res1["lr_per_variant"] == {"lora": 5e-6}
    rc, res = _main(tmp_path / "c2", ["--preset", "reasoning", "--variants", "qerl,lora", "--tokenizer", tok,
                                      "--baseline", str(base)])
    assert rc == 0 and fake_runs == [("lora", 1, [0]), ("qerl", 1, [0])]
    assert [r["variant"] for r in res["rows"]] == ["qerl", "lora"] and res["rows"][1]["from_baseline"] == str(base)
    assert {t["name"] for t in res["targets"]} == {"grpo_step_time_ratio[qerl/lora]", "gen_time_ratio[qerl/lora]",
                                                  "old_log_prob_time_ratio[qerl/lora]",
                                                  "update_actor_time_ratio[qerl/lora]"}
    rc, _ = _main(tmp_path / "c3", ["--variants", "qerl,lora", "--baseline", str(base)])
    assert rc == 2
    other = tmp_path / "tok2"
    other.mkdir()
    (other / "tokenizer.json").write_text("{}")
    rc, _ = _main(tmp_path / "c4", ["--preset", "reasoning", "--variants", "qerl,lora", "--tokenizer", str(other),
                                    "--baseline", str(base)])
    assert rc == 2


def test_machine_check_flags_a_slower_machine_and_a_missing_check():
    mc = load_script("benchmarks/machine_check.py", "machine_check")
    here = mc.measure()
    assert here["cpu_ms"] > 0
    same = {"cpu_ms": 100.0, "gemm_bf16_tflops": 700.0, "copy_tbps": 3.6}
    assert mc.mismatches(same, {**same, "cpu_ms": 108.0}) == []
    slow = mc.mismatches(same, {**same, "cpu_ms": 137.0, "gemm_bf16_tflops": 620.0})
    assert len(slow) == 2 and slow[0].startswith("cpu_ms") and "1.37x" in slow[0] and slow[1].startswith("gemm")
    assert "unknown" in mc.mismatches(same, None)[0]
    assert "unknown" in mc.mismatches({"error": "x"}, same)[0]
    sub = mc.measure_in_subprocess(timeout=120)
    assert sub.get("cpu_ms", 0) > 0, sub


def test_fast_path_records_reach_the_row_and_a_missed_fast_path_is_flagged(tmp_path):
    """What the engines' LoRA managers recorded (``decode_stats.write_fast_path_record``, written under
    ``QERL_DECODE_STATS_DIR`` as grpo_step.py sets it) becomes the row's ``lora_fast_path_layers``; an NVFP4 row
    whose rollout ran vLLM's own LoRA path on some engine gets a WARNING naming the reason, an older row a note,
    a BF16 row nothing."""
    from verl_qerl.vllm import decode_stats

    env = {decode_stats.ENV: str(tmp_path / "stats")}
    assert decode_stats.write_fast_path_record(196, "auto", None, environ=env).name.endswith(".json")
    decode_stats.write_fast_path_record(0, "auto", "the engine has 2 adapter slots (max_loras)", environ=env)
    assert decode_stats.write_fast_path_record(1, "auto", None, environ={}) is None  # recording off
    (tmp_path / "stats" / f"{decode_stats.FAST_PATH_PREFIX}junk.json").write_text("not json")
    recs = decode_stats.read_fast_path_records(tmp_path / "stats")
    assert not list((tmp_path / "stats").glob("*.tmp"))  # written whole, then renamed
    row = gs.fast_path_report(recs)
    assert row == {"lora_fast_path_layers": [196, 0],
                   "lora_fast_path_not_used": ["the engine has 2 adapter slots (max_loras)"]}
    rows = [{"variant": "qerl", "qerl": "nvfp4", **row},
            {"variant": "nvfp4", "qerl": "nvfp4_noaqn", "lora_fast_path_layers": [196]},
            {"variant": "old", "qerl": "nvfp4"},
            {"variant": "lora", "qerl": "bf16", "lora_fast_path_layers": [0]}]
    lines = gs.fast_path_warnings(rows)
    assert len(lines) == 2
    assert "WARNING: qerl" in lines[0] and "2 adapter slots" in lines[0] and "[196, 0]" in lines[0]
    assert "note: old" in lines[1]
    assert gs.fast_path_warnings([{"variant": "qerl", "qerl": "nvfp4", "lora_fast_path_layers": []}])[0].startswith(
        "[grpo_step] WARNING: qerl")


def test_cpu_split_gives_each_concurrent_run_its_own_cpus(monkeypatch, tmp_path):
    assert gs.cpu_share(0, 2, list(range(32))) == list(range(16))
    assert gs.cpu_share(1, 2, [5, 1, 3, 7, 9]) == [5, 7]  # sorted, equal shares, the remainder unused
    with pytest.raises(gs.StepBenchError, match="cannot share 1 CPUs"):
        gs.cpu_share(1, 2, [0])
    with pytest.raises(SystemExit):
        gs.parse_args(["--cpu-split"])  # without --concurrent
    args = gs.parse_args(["--variants", "qerl,lora", "--concurrent", "--cpu-split"])
    seen = []
    monkeypatch.setattr(gs, "run_one", lambda a, v, g, ids, inputs, work, cpus=None: seen.append((v, ids, cpus)) or {})
    monkeypatch.setattr(gs.os, "sched_getaffinity", lambda pid: set(range(8)))
    gs.execute(args, [("qerl", 1), ("lora", 1)], None, tmp_path)
    assert sorted(seen) == [("lora", [1], [4, 5, 6, 7]), ("qerl", [0], [0, 1, 2, 3])]
