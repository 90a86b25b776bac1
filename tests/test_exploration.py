"""The exploration study's pieces (examples/exploration): generator, SFT warm start, launcher, summary.

CPU only and small: the generator's answers are recomputed from the question text, verl's own GSM8K scorer
grades the gold solutions, a tiny SFT run lowers its loss and writes a loadable checkpoint, the launcher's planned
command lines differ exactly where they should, its process-tree kill reaps detached children, and the summary
turns synthetic metrics into a results JSON with targets and a PNG.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_qerl.testing import procs

HERE = Path(__file__).resolve().parents[1] / "examples" / "exploration"
sys.path.insert(0, str(HERE))

import problems  # noqa: E402
import run_arms  # noqa: E402
import summarize  # noqa: E402

_STEP = [
    (re.compile(r"^Then \w+ (?:finds|buys|gets) (\d+) more\.$"), lambda x, b: x + b),
    (re.compile(r"^Then \w+ (?:gives away|loses|sells) (\d+)\.$"), lambda x, b: x - b),
    (re.compile(r"^Then the \w+ are multiplied by (\d+)\.$"), lambda x, b: x * b),
    (re.compile(r"^Then \w+ ends up with (\d+) times as many\.$"), lambda x, b: x * b),
    (re.compile(r"^Then \w+ splits them into (\d+) equal groups and keeps one group\.$"), lambda x, b: x // b),
]


def solve_from_text(question: str) -> int:
    """An independent reading of the story: sentence by sentence, from the text alone."""
    sentences = re.findall(r"[^.?]+[.?]", question)
    x = int(re.match(r"^\w+ has (\d+) \w+\.$", sentences[0].strip()).group(1))
    for s in sentences[1:-1]:
        s = s.strip()
        for pat, fn in _STEP:
            m = pat.match(s)
            if m:
                x = fn(x, int(m.group(1)))
                break
        else:
            raise AssertionError(f"unparsed sentence {s!r}")
    assert sentences[-1].strip().startswith("How many")
    return x


def test_generator_answers_are_right_and_deterministic():
    d = problems.Difficulty(ops="+-*/")
    probs = problems.generate(400, "train", seed=3, difficulty=d)
    assert probs == problems.generate(400, "train", seed=3, difficulty=d)
    assert [p.question for p in probs] != [p.question for p in problems.generate(400, "train", seed=4, difficulty=d)]
    assert len({p.question for p in probs}) == len(probs)
    n_ops = set()
    for p in probs:
        assert solve_from_text(p.question) == p.answer
        lines = p.solution.split("\n")
        assert lines[-1] == f"#### {p.answer}"
        for line in lines[:-1]:  # every stated step is true arithmetic
            left, right = line.split(" = ")
            a, op, b = left.split(" ")
            assert problems.apply_op(int(a), op, int(b)) == int(right)
            assert 0 <= int(right) <= d.max_value
        n_ops.add(len(lines) - 1)
    assert n_ops == {2, 3, 4}


def test_difficulty_rejects_bad_settings():
    with pytest.raises(ValueError, match="min_ops"):
        problems.Difficulty(min_ops=3, max_ops=2)
    with pytest.raises(ValueError, match="ops="):
        problems.Difficulty(ops="+%")


def test_verl_gsm8k_scorer_grades_gold_and_wrong():
    from verl.utils import reward_score

    for p in problems.generate(30, "test", seed=0):
        gt = str(p.answer)
        assert reward_score.default_compute_score("openai/gsm8k", p.solution, gt) == 1.0
        wrong = p.solution.rsplit("#### ", 1)[0] + f"#### {p.answer + 1}"
        assert reward_score.default_compute_score("openai/gsm8k", wrong, gt) == 0.0
        for text in (p.solution, wrong, p.solution + ".", "no answer", f"#### {p.answer:,}"):
            ours = problems.gsm8k_strict_score(text, gt)
            assert ours == float(reward_score.default_compute_score("openai/gsm8k", text, gt)), text


def test_write_splits_schema_and_disjoint(tmp_path):
    import pandas as pd

    paths = problems.write_splits(tmp_path, n_sft=200, n_train=40, n_dev=20, n_test=20, seed=1)
    train, test = pd.read_parquet(paths["train"]), pd.read_parquet(paths["test"])
    assert list(train.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert set(train.data_source) == {"openai/gsm8k"}
    row = test.iloc[0]
    assert row.prompt[0]["role"] == "user" and row.prompt[0]["content"].endswith(problems.INSTRUCTION)
    assert row.reward_model["ground_truth"] == row.extra_info["answer"]
    sft = [json.loads(x) for x in paths["sft"].read_text().splitlines()]
    dev = [json.loads(x) for x in paths["dev"].read_text().splitlines()]
    seen = {r["prompt"][0]["content"] for r in sft} | set(train.prompt.map(lambda m: m[0]["content"]))
    held = set(test.prompt.map(lambda m: m[0]["content"])) | {r["prompt"][0]["content"] for r in dev}
    assert not seen & held and len(held) == 40
    assert all(r["response"].endswith("#### " + r["answer"]) for r in sft)


def test_sft_tiny_lowers_loss_and_saves_loadable_checkpoint(tmp_path):
    import sft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    problems.write_splits(tmp_path / "data", n_sft=400, n_train=8, n_dev=8, n_test=8, seed=0)
    out = tmp_path / "model"
    args = sft.parse_args(["--data", str(tmp_path / "data"), "--out", str(out), "--hidden", "128", "--layers", "1",
                           "--heads", "2", "--kv-heads", "2", "--intermediate", "256", "--vocab", "400",
                           "--batch-size", "8", "--max-steps", "12", "--lr", "3e-3", "--warmup", "1",
                           "--eval-every", "12", "--eval-n", "4", "--max-new-tokens", "6", "--log-every", "1"])
    log = sft.train(args)
    losses = [x["loss"] for x in log["loss"]]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    assert log["stopped_by"] == "max_steps" and log["eval"] and (out / "sft_log.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen2" and not model.config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == sft.render_prompt([{"role": "user", "content": "hi"}])
    assert tok.tokenize("123 + 45") == ["1", "2", "3", "Ġ+", "Ġ", "4", "5"]  # single-digit tokens


def test_sft_refuses_bad_args(tmp_path):
    import sft

    problems.write_splits(tmp_path / "d", n_sft=10, n_train=2, n_dev=2, n_test=2)
    base = ["--data", str(tmp_path / "d"), "--out", str(tmp_path / "m")]
    with pytest.raises(SystemExit, match="multiple of 128"):
        sft.parse_args([*base, "--hidden", "192", "--heads", "3", "--kv-heads", "3"])
    with pytest.raises(SystemExit, match="not divisible"):
        sft.parse_args([*base, "--heads", "3"])
    with pytest.raises(SystemExit, match="stop-acc"):
        sft.parse_args([*base, "--stop-acc", "1.5"])
    with pytest.raises(SystemExit, match="not found"):
        sft.parse_args(["--data", str(tmp_path), "--out", str(tmp_path / "m")])


def _plan(tmp_path, *extra):
    args = run_arms.parse_args(["--model", str(tmp_path / "m"), "--data", str(tmp_path / "d"),
                                "--out", str(tmp_path / "runs"), "--dry-run", *extra])
    return run_arms.plan(args)


def test_launcher_plans_distinct_runs(tmp_path, capsys):
    runs = _plan(tmp_path, "--gpus", "2", "--seeds", "3", "--steps", "30")
    assert [r.name for r in runs[:3]] == ["bf16-s0", "nvfp4_noaqn-s0", "nvfp4-s0"] and len(runs) == 9
    assert len({r.env["RAY_TMPDIR"] for r in runs}) == 9
    assert len({r.env["VERL_FILE_LOGGER_PATH"] for r in runs}) == 9
    assert len({r.env[run_arms.MARKER] for r in runs}) == 9
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in runs] == ["0", "1"] * 4 + ["0"]
    for r in runs:
        assert r.cmd[1:3] == ["-m", "verl.trainer.main_ppo"]
        o = r.cmd[3:]
        assert f"+qerl={r.arm}" in o
        for key in ("data.seed", "actor_rollout_ref.rollout.seed", "actor_rollout_ref.actor.data_loader_seed",
                    "actor_rollout_ref.actor.fsdp_config.seed"):
            assert f"{key}={r.seed}" in o
        assert (f"qerl.aqn.seed={r.seed}" in o) == (r.arm == "nvfp4")
        assert "trainer.val_before_train=True" in o and "actor_rollout_ref.rollout.n=8" in o
        assert "trainer.device=cpu" not in o and "actor_rollout_ref.rollout.enforce_eager=True" in o
        assert len(r.env["RAY_TMPDIR"]) < 40
    assert "qerl.aqn.num_stages=10" in runs[2].cmd
    # everything but the arm group, seeds and names is shared
    strip = re.compile(r"(seed=\d+|\+qerl=\w+|experiment_name=.*|default_local_dir=.*|qerl\.aqn\..*)$")
    assert len({tuple(x for x in r.cmd if not strip.search(x)) for r in runs}) == 1
    assert run_arms.main(["--model", "m", "--data", "d", "--out", str(tmp_path), "--dry-run", "--gpus", "2",
                          "--seeds", "1"]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if "main_ppo" in line]
    assert len(printed) == 3 and all("RAY_TMPDIR=/tmp/qxr/" in line for line in printed)


def test_launcher_cpu_mode_and_checks(tmp_path):
    (run,) = _plan(tmp_path, "--device", "cpu", "--arms", "nvfp4", "--seeds", "1", "--steps", "2")
    assert "trainer.device=cpu" in run.cmd and run.env["VERL_PLATFORM"] == "cpu"
    assert "qerl.aqn.num_stages=3" in run.cmd and "CUDA_VISIBLE_DEVICES" not in run.env
    with pytest.raises(SystemExit):
        _plan(tmp_path, "--arms", "fp8")
    with pytest.raises(SystemExit):
        run_arms.parse_args(["--model", "m", "--data", "d", "--out", "o", "--train-batch-size", "30"])
    with pytest.raises(SystemExit):
        run_arms.parse_args(["--model", "m", "--data", "d", "--out", "o", "--ray-tmp-root", "/tmp/" + "x" * 60])
    assert [run_arms.aqn_stages(s) for s in (2, 9, 12, 30, 300)] == [3, 3, 4, 10, 10]


def test_kill_runs_reaps_detached_children(tmp_path):
    marker = f"test-{os.getpid()}"
    env = {**os.environ, run_arms.MARKER: marker}
    # a child that leaves the process group and session, as Ray's daemons do
    proc = subprocess.Popen(["bash", "-c", "setsid sleep 300 & sleep 300"], env=env, start_new_session=True)
    run = run_arms.Run(name="x", arm="bf16", seed=0, gpu=None, run_dir=tmp_path, cmd=[], env={run_arms.MARKER: marker},
                       proc=proc)

    def tree() -> set[int]:
        return {proc.pid} | procs.descendants(proc.pid) | procs.marked_processes(run_arms.MARKER, marker)

    deadline = time.time() + 60  # generous: a loaded CI machine starts the three processes slowly
    while len(tree()) < 3 and time.time() < deadline:
        time.sleep(0.1)
    pids = tree()
    assert len(pids) >= 3
    run_arms.kill_runs([run], grace_s=2)
    assert proc.returncode is not None
    deadline = time.time() + 30  # the detached sleep is init's child now: a zombie until init reaps it
    while any(procs.is_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(procs.is_alive(p) for p in pids)


def _synthetic_runs(root: Path, steps: int = 9, cut: dict[str, int] | None = None) -> None:
    vk = "val-core/openai/gsm8k/acc/mean@1"  # as verl 0.9.1 logs it (CPU smoke run)
    rows = []
    for arm, ent, speed in (("bf16", 0.50, 0.02), ("nvfp4_noaqn", 0.60, 0.03), ("nvfp4", 0.70, 0.04)):
        for seed in range(2):
            d = root / f"{arm}-s{seed}"
            d.mkdir(parents=True)
            lines = [{"step": 0, "data": {vk: 0.30}}]
            for s in range(1, (cut or {}).get(d.name, steps) + 1):
                data = {"critic/score/mean": 0.2 + speed * s + 0.01 * seed, "actor/entropy": ent - 0.01 * s,
                        "rollout_corr/rollout_log_ppl": ent + 0.05, "qerl/aqn_sigma": 0.01 if arm == "nvfp4" else 0.0,
                        "response_length/mean": 40.0, "timing_s/step": 3.0}
                if s % 3 == 0:
                    data[vk] = 0.30 + speed * s
                lines.append({"step": s, "data": data})
            (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"step\": 9, \"da")
            rows.append({"name": d.name, "arm": arm, "seed": seed, "status": "ok", "wall_s": 100.0})
    (root / "runs.json").write_text(json.dumps({"runs": rows}))


def test_summarize_synthetic(tmp_path):
    runs = tmp_path / "runs"
    _synthetic_runs(runs)
    res = summarize.summarize(runs, tmp_path / "out", device="testdev", command="pytest")
    js = json.loads((tmp_path / "out" / "exploration-testdev.json").read_text())
    assert js == json.loads(json.dumps(res))
    for key in ("device", "versions", "command", "date", "targets", "runs", "arms"):
        assert key in js
    assert js["device"] == "testdev" and js["settings"]["val_metric"] == ["val-core/openai/gsm8k/acc/mean@1"]
    names = [t["name"] for t in js["targets"]]
    assert len(names) == 8 and all(set(t) == {"name", "measured", "op", "target"} for t in js["targets"])
    assert all(t["op"] in (">=", "<=") for t in js["targets"])
    ratio = next(t for t in js["targets"] if t["name"].startswith("early entropy ratio nvfp4/bf16"))
    k = js["settings"]["early_k"]
    assert k == 3 and ratio["measured"] == pytest.approx((0.70 - 0.02) / (0.50 - 0.02), rel=1e-3)
    steps = next(t for t in js["targets"] if t["name"].startswith("steps-to-reward-threshold ratio nvfp4/"))
    assert steps["measured"] is not None and steps["measured"] < 1.0
    assert js["runs"]["bf16-s0"]["curves"]["val_acc"][0] == [0, 0.30]
    assert js["arms"]["nvfp4"]["acc_final"]["mean"] == pytest.approx(0.30 + 0.04 * 9)
    assert (tmp_path / "out" / "exploration-testdev.png").stat().st_size > 10_000
    assert "NVFP4 LoRA + AQN" in (tmp_path / "out" / "exploration-testdev.md").read_text()


def test_summary_uses_the_common_horizon_and_pairs_by_seed(tmp_path):
    """Runs cut at different steps: statistics stop at the last step every run reached (the raw curves stay whole),
    --horizon 0 uses the whole curves, --seeds keeps a subset, and the paired differences are per seed."""
    runs = tmp_path / "runs"
    _synthetic_runs(runs, cut={"nvfp4-s1": 6})
    js = summarize.summarize(runs, tmp_path / "out", device="t", command="pytest")
    assert js["settings"]["horizon"] == 6 and js["settings"]["early_k"] == 3
    assert len(js["runs"]["bf16-s0"]["curves"]["reward"]) == 9  # raw curves kept
    st = js["runs"]["bf16-s0"]["stats"]
    assert st["last_step"] == 6 and st["logged_last_step"] == 9
    assert st["final_reward"] == pytest.approx(0.2 + 0.02 * 5)  # steps 4-6, not 7-9
    assert st["mean_reward"] == pytest.approx(0.2 + 0.02 * 3.5)
    assert st["acc_final"] == pytest.approx(0.30 + 0.02 * 6) and st["acc_final_step"] == 6
    pair = js["paired"]["nvfp4"]
    assert pair["seeds"] == [0, 1] and pair["final_reward"]["diffs"] == pytest.approx([0.02 * 5, 0.02 * 5])
    assert pair["mean_reward"]["mean"] == pytest.approx(0.02 * 3.5) and pair["mean_reward"]["t"] is None
    assert "paired by seed" in (tmp_path / "out" / "exploration-t.md").read_text()
    whole = summarize.summarize(runs, tmp_path / "whole", device="t", command="pytest", horizon=0)
    assert whole["settings"]["horizon"] == 0 and whole["runs"]["bf16-s0"]["stats"]["last_step"] == 9
    only0 = summarize.summarize(runs, tmp_path / "s0", device="t", command="pytest", seeds={0})
    assert only0["settings"]["seeds"] == [0] and only0["settings"]["horizon"] == 9
    assert set(only0["runs"]) == {"bf16-s0", "nvfp4_noaqn-s0", "nvfp4-s0"}
    with pytest.raises(SystemExit, match="seeds \\[7\\]"):
        summarize.summarize(runs, tmp_path / "none", device="t", seeds={7})
    with pytest.raises(SystemExit, match="--horizon -1"):
        summarize.summarize(runs, tmp_path / "neg", device="t", horizon=-1)


def test_status_keeps_runs_of_earlier_calls(tmp_path):
    """Seeds spread over GPU calls (--seed0, campaign KEEP_RUNS=1): a later call's runs.json keeps the earlier
    runs' rows (the summary reads their status from it) and replaces only the runs it launched again."""
    first = _plan(tmp_path, "--seeds", "1", "--gpus", "1")
    for r in first:
        r.status = "ok"
    args = run_arms.parse_args(["--model", "m", "--data", "d", "--out", str(tmp_path), "--dry-run"])
    run_arms.write_status(first, tmp_path, args)
    second = _plan(tmp_path, "--seeds", "1", "--seed0", "1", "--gpus", "1")
    second[0].name = first[0].name  # one run launched again
    second[0].status = "failed"
    run_arms.write_status(second, tmp_path, args)
    rows = {r["name"]: r["status"] for r in json.loads((tmp_path / "runs.json").read_text())["runs"]}
    assert set(rows) == {r.name for r in first} | {r.name for r in second} and len(rows) == 5
    assert rows[first[0].name] == "failed" and rows[first[1].name] == "ok" and rows["nvfp4-s1"] == "pending"


def test_entropy_probe_pieces_are_exact_on_hand_made_logits():
    import entropy_probe as ep
    import torch

    vocab = 8
    ref = torch.zeros(1, 4, vocab)  # uniform: entropy log(8) at every position
    other = ref.clone()
    other[0, :, 3] = 5.0  # peaked on token 3
    labels = torch.tensor([[-100, -100, 3, 1]])  # completion = the last two tokens (predicted at positions 1, 2)
    same = ep.position_stats(ref, ref, labels)
    assert same["n"].item() == 2 and same["kl_from_bf16"].abs().max() < 1e-6 and same["top1_agree"].item() == 2
    assert abs(same["entropy"].item() - 2 * math.log(vocab)) < 1e-5
    assert abs(same["ref_nll"].item() - 2 * math.log(vocab)) < 1e-5
    peaked = ep.position_stats(ref, other, labels)
    assert peaked["entropy"].item() < same["entropy"].item() and peaked["kl_from_bf16"].item() > 0
    z = math.exp(5.0) + vocab - 1  # softmax denominator of the peaked rows: label 3 likely, label 1 not
    assert abs(peaked["ref_nll"].item() - (-(5.0 - math.log(z)) + math.log(z))) < 1e-4
    ratio, lo, hi = ep.bootstrap_ratio(torch.tensor([2.0, 4.0, 6.0]), torch.tensor([1.0, 2.0, 3.0]))
    assert ratio == 2.0 and abs(lo - 2.0) < 1e-9 and abs(hi - 2.0) < 1e-9  # every resample has ratio 2


def test_entropy_probe_on_a_tiny_sft_model(tmp_path):
    import entropy_probe as ep
    import sft

    problems.write_splits(tmp_path / "data", n_sft=200, n_train=8, n_dev=12, n_test=8, seed=0)
    out = tmp_path / "model"
    sft.train(sft.parse_args(["--data", str(tmp_path / "data"), "--out", str(out), "--hidden", "128", "--layers", "1",
                              "--heads", "2", "--kv-heads", "2", "--intermediate", "256", "--vocab", "400",
                              "--batch-size", "8", "--max-steps", "4", "--warmup", "1", "--eval-every", "4",
                              "--eval-n", "2", "--max-new-tokens", "4", "--device", "cpu"]))
    res_file = tmp_path / "probe.json"
    assert ep.main(["--model", str(out), "--data", str(tmp_path / "data"), "--out", str(res_file), "--n", "10",
                    "--sigmas", "0.05", "--batch-size", "4", "--device", "cpu", "--bf16-aqn"]) == 0
    res = json.loads(res_file.read_text())
    v = res["variants"]
    assert list(v) == ["bf16", "nvfp4", "nvfp4+aqn@0.05", "bf16+aqn@0.05"]
    assert res["n_problems"] == 10 and res["aqn_norms"] >= 2
    assert 0 < v["bf16+aqn@0.05"]["kl_from_bf16"] != v["nvfp4+aqn@0.05"]["kl_from_bf16"]  # noise on the clean model
    assert v["bf16"]["kl_from_bf16"] == 0 and v["bf16"]["top1_agree"] == 1.0
    assert v["nvfp4"]["kl_from_bf16"] > 0  # 4-bit weights change the distribution
    assert v["nvfp4+aqn@0.05"]["kl_from_bf16"] != v["nvfp4"]["kl_from_bf16"]  # the noise reached the forward
    for name, r in res["entropy_ratio_to_bf16"].items():
        assert r["ci95"][0] <= r["ratio"] <= r["ci95"][1], name
        assert abs(r["ratio"] - v[name]["entropy"] / v["bf16"]["entropy"]) < 1e-6
    assert [t["op"] for t in res["targets"]] == [">=", ">=", ">="] and res["command"].startswith("python ")
    with pytest.raises(SystemExit):
        ep.main(["--model", str(out), "--data", str(tmp_path / "data"), "--out", str(tmp_path), "--n", "2"])


def test_summary_embeds_the_entropy_probe(tmp_path):
    runs = tmp_path / "runs"
    _synthetic_runs(runs)
    probe = {"variants": {"bf16": {"entropy": 0.1, "kl_from_bf16": 0.0, "top1_agree": 1.0, "ref_nll": 0.2},
                          "nvfp4": {"entropy": 0.11, "kl_from_bf16": 1e-3, "top1_agree": 0.99, "ref_nll": 0.21}},
             "entropy_ratio_to_bf16": {"nvfp4": {"ratio": 1.1, "ci95": [1.05, 1.15]}}, "n_problems": 4,
             "n_tokens": 100, "targets": [{"name": "step0_entropy_ratio[nvfp4/bf16]", "measured": 1.1, "op": ">=",
                                           "target": 1.0}]}
    (tmp_path / "probe.json").write_text(json.dumps(probe))
    res = summarize.summarize(runs, tmp_path / "out", device="testdev", probe=tmp_path / "probe.json")
    assert res["entropy_probe"] == probe and res["targets"][-1]["name"] == "step0_entropy_ratio[nvfp4/bf16]"
    md = (tmp_path / "out" / "exploration-testdev.md").read_text()
    assert "Step-0 entropy probe" in md and "| nvfp4 | 0.1100 | 1.00e-03 | 0.9900 | 1.1000 [1.0500, 1.1500] |" in md
    # a campaign whose probe did not run still summarizes
    assert "entropy_probe" not in summarize.summarize(runs, tmp_path / "o2", device="d", probe=tmp_path / "none")
