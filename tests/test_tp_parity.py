"""benchmarks/tp_parity.py on CPU: its comparison and target pieces (fast), and the --tiny run end to end (slow)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from verl_qerl.testing.scripts import load_script

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "tp_parity.py"


@pytest.fixture(scope="module")
def tpp():
    return load_script("benchmarks/tp_parity.py", "tp_parity_bench")


@pytest.fixture(scope="module")
def cmp():
    """The comparison half (benchmarks/tp_parity_compare.py), as tp_parity.py imports it."""
    return load_script("benchmarks/tp_parity_compare.py", "tp_parity_compare")


def _lp(logprob: float, rank: int) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank)


def test_token_records_margin_is_the_gap_to_the_best_other_token(cmp):
    steps = [
        {5: _lp(-1.0, 1), 7: _lp(-1.5, 2)},               # argmax: margin = gap to the runner-up
        {5: _lp(-2.0, 3), 1: _lp(-1.0, 1), 2: _lp(-1.2, 2)},  # not the argmax: negative margin
        {5: _lp(-0.5, 1)},                                 # nothing else seen
    ]
    recs = cmp.token_records([5, 5, 5], steps)
    assert recs[0] == [-1.0, 1, 0.5]
    assert recs[1] == [-2.0, 3, -1.0]
    assert recs[2][:2] == [-0.5, 1] and math.isinf(recs[2][2])
    assert cmp.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert cmp.first_divergence([1, 2], [1, 2]) == 2


def _row(kind: str, tp: int, prompt: list[int], completion: list[int], tf: list[list[float]],
         decode_lp: list[float] | None = None, checksum: str = "n", ranks: int = 1) -> dict:
    """A minimal engine row: one prompt, ``tf`` records for positions 1..L-1."""
    seq = prompt + completion
    assert len(tf) == len(seq) - 1
    aqn = {"setup": [{"clean_checksum": "c", "names": ["a", "b"]}] * ranks,
           "apply": [{"checksum": checksum}] * ranks, "restore": [{"checksum": "c"}] * ranks}
    return {"kind": kind, "tp": tp, "prompt_lens": [len(prompt)], "seqs": [seq],
            "greedy": [{"tokens": completion, "logprobs": decode_lp or [r[0] for r in tf[len(prompt) - 1:]]}],
            "tf": [tf], "tf_noisy": [[[r[0] + 0.1, r[1], r[2]] for r in tf]], "aqn": aqn,
            "summary": [{"layers": {"m.qkv_proj": {"global_scale": [2.0], "shape": [64, 32]},
                                    "m.o_proj": {"global_scale": [3.0], "shape": [32, 32]},
                                    "m.embed": {"method": "Unquantized"}}}] * ranks}


def test_compare_separates_near_tie_flips_from_real_ones(cmp):
    prompt = [1, 2, 3]
    completion = [4, 5, 6, 7]
    # TP=1: positions 1..6; completion tokens are records 2..5; margins: big, near-tie (0.01), big, big
    tf1 = [[-1.0, 1, 1.0], [-1.0, 1, 1.0], [-1.0, 1, 0.5], [-1.0, 1, 0.01], [-1.0, 1, 0.5], [-1.0, 1, 0.5]]
    tp1 = _row("bf16", 1, prompt, completion, tf1, checksum="n1")
    # TP=2: a flip at the near-tie (completion index 1) and one outside (index 3); its own greedy run diverges at 1
    tf2 = [[-1.001, 1, 1.0], [-1.0, 1, 1.0], [-1.005, 1, 0.5], [-1.0, 2, -0.01], [-1.0, 1, 0.5], [-1.03, 2, -0.1]]
    tp2 = _row("bf16", 2, prompt, [4, 9, 6, 8], tf2, decode_lp=[-1.002, -1.0, -1.0, -1.0], checksum="n1", ranks=2)
    tp2["seqs"] = tp1["seqs"]  # TP=2 scores TP=1's sequences
    c = cmp.compare(tp1, tp2)
    assert c["logprob"]["completion"]["max"] == pytest.approx(0.03)
    assert c["logprob"]["prompt"]["max"] == pytest.approx(0.001)
    assert c["logprob_aqn"]["completion"]["max"] == pytest.approx(0.03)
    assert c["greedy_token_match_fraction"] == 0.5 and c["first_divergence"] == [1]
    assert c["near_tie_free_prefix_fraction"] == 0.25  # one token before the first near-tie, of 4
    assert c["tp1_near_ties"] == 1
    assert c["teacher_forced_argmax_flips"] == 2 and c["argmax_flips_outside_near_ties"] == 1
    assert c["flips_outside_near_ties"][0]["position"] == 3
    assert c["decode_logprob_diff_shared_prefix"]["max"] == pytest.approx(0.002)
    assert c["tp1_decode_vs_teacher_forced"]["max"] == 0.0
    assert c["aqn_logprob_shift_tp1"]["max"] == pytest.approx(0.1)
    assert c["aqn"]["equal"] is True  # same noisy checksum on TP=1 and both TP=2 ranks, restored to clean
    targets = {t["name"]: t for t in cmp.make_targets({"bf16": c}, ["bf16"])}
    assert targets["tp2_vs_tp1_logprob_max_abs_diff[bf16-ckpt]"]["measured"] == pytest.approx(0.03)
    assert targets["greedy_token_match_fraction[bf16-ckpt]"]["target"] == 0.25
    assert targets["argmax_flips_outside_near_ties[bf16-ckpt]"]["measured"] == 1
    # the layer shapes of the fake TP=2 summary are not halved: flagged
    assert targets["layers_tp2_consistent_with_tp1[bf16-ckpt]"]["measured"] == 0


def test_layer_and_aqn_consistency(cmp):
    tp1 = {"layers": {"m.qkv_proj": {"global_scale": [2.0], "shape": [64, 32]},
                      "m.down_proj": {"global_scale": [3.0], "shape": [32, 64]}, "m.lm_head": {"method": "U"}}}
    good = {"layers": {"m.qkv_proj": {"global_scale": [2.0], "shape": [32, 32]},
                       "m.down_proj": {"global_scale": [3.0], "shape": [32, 32]}}}
    bad = {"layers": {"m.qkv_proj": {"global_scale": [2.5], "shape": [32, 32]},
                      "m.down_proj": {"global_scale": [3.0], "shape": [16, 64]}}}
    assert cmp.layer_consistency([tp1], [good, good]) | {"mismatches": []} == {
        "layers": 2, "consistent": 2, "fraction": 1.0, "mismatches": []}
    res = cmp.layer_consistency([tp1], [good, bad])
    assert res["consistent"] == 0 and {m["layer"] for m in res["mismatches"]} == {"m.qkv_proj", "m.down_proj"}

    def aqn(clean: str, noisy: list[str], restored: str) -> dict:
        return {"tp": len(noisy), "aqn": {"setup": [{"clean_checksum": clean, "names": ["x"]}] * len(noisy),
                                          "apply": [{"checksum": c} for c in noisy],
                                          "restore": [{"checksum": restored}] * len(noisy)}}

    assert cmp.aqn_consistency(aqn("c", ["n"], "c"), aqn("c", ["n", "n"], "c"))["equal"] is True
    assert cmp.aqn_consistency(aqn("c", ["n"], "c"), aqn("c", ["n", "m"], "c"))["equal"] is False  # ranks differ
    assert cmp.aqn_consistency(aqn("c", ["n"], "c"), aqn("c", ["m", "m"], "c"))["equal"] is False  # TP=1 differs
    assert cmp.aqn_consistency(aqn("c", ["c"], "c"), aqn("c", ["c", "c"], "c"))["equal"] is False  # no noise landed
    assert cmp.aqn_consistency(aqn("c", ["n"], "c"), aqn("c", ["n", "n"], "x"))["equal"] is False  # not restored


def test_targets_format_and_missing_kinds(cmp):
    targets = cmp.make_targets({}, ["bf16", "nvfp4"], {"nvfp4": "nvfp4-ckpt TP=2 failed: rc=1"})
    assert all(set(t) >= {"name", "measured", "op", "target"} for t in targets)
    assert all(t["op"] in ("<=", ">=") and isinstance(t["target"], float) for t in targets)
    assert all(t["measured"] is None and t["note"] for t in targets)
    names = [t["name"] for t in targets]
    for lab in ("bf16-ckpt", "nvfp4-ckpt"):
        assert f"tp2_vs_tp1_logprob_max_abs_diff[{lab}]" in names
        assert f"greedy_token_match_fraction[{lab}]" in names
    assert names[-1] == "aqn_checksum_equal_ranks"
    assert any("failed: rc=1" in t["note"] for t in targets if "nvfp4" in t["name"])


def test_control_scales_ours_and_has_no_targets_of_its_own(cmp):
    """The stock-vLLM BF16 control (kind 'plain') turns each kind's TP diff into a ratio to vLLM's own."""
    def comp(max_diff: float) -> dict:
        return {"logprob": {"completion": {"max": max_diff}}, "logprob_aqn": {"completion": {"max": max_diff}},
                "greedy_token_match_fraction": 1.0, "near_tie_free_prefix_fraction": 1.0, "tp1_near_ties": 0,
                "greedy_tokens": 4, "first_divergence": [4], "argmax_flips_outside_near_ties": 0,
                "teacher_forced_argmax_flips": 0, "layers": {"fraction": 1.0}, "aqn": {"equal": True}}

    targets = cmp.make_targets({"nvfp4": comp(0.3), "plain": comp(0.25)}, ["nvfp4", "plain"])
    names = [t["name"] for t in targets]
    assert not any("control" in n and "over_control" not in n for n in names)  # no own targets for the control
    ratio = {t["name"]: t for t in targets}["tp2_vs_tp1_logprob_max_abs_diff_over_control[nvfp4-ckpt]"]
    assert ratio["measured"] == pytest.approx(1.2) and ratio["op"] == "<=" and ratio["target"] == 1.5
    # without the control's comparison, no ratio target (rather than a wrong one)
    assert not any("over_control" in t["name"] for t in cmp.make_targets({"nvfp4": comp(0.3)}, ["nvfp4", "plain"]))


def _run(args: list[str], timeout: float, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **env)
    full.pop("OUT", None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=full, capture_output=True, text=True,
                          timeout=timeout)


def test_bad_arguments_are_clear_errors():
    proc = _run(["--tiny", "--kinds", "bf16,fp8"], 120)
    assert proc.returncode == 2 and "unknown checkpoint kind" in proc.stderr and "fp8" in proc.stderr


@pytest.mark.parametrize("n_gpu, needle", [(0, "found 0"), (1, "nvidia-smi lists 1")])
def test_missing_gpus_are_clear_errors(tpp, monkeypatch, capsys, n_gpu, needle):
    """The 7B run (no --tiny) on a machine with fewer than 2 GPUs: exit 2 with the reason, before any work.

    The GPU count is nvidia-smi's (CUDA_VISIBLE_DEVICES does not hide GPUs from it), so it is set here rather
    than hidden: on any machine, GPUs or not, without starting the real run where 2 GPUs are present."""
    monkeypatch.setattr(tpp, "gpu_count", lambda: n_gpu)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])
    with pytest.raises(SystemExit) as exc:
        tpp.rb.child_cli(tpp.main, tpp._child_main, (tpp.TPError, tpp.rb.BenchError))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "needs 2 GPUs" in err and needle in err and "--tiny" in err, err


@pytest.mark.slow
def test_tiny_tp_parity_end_to_end(tmp_path):
    """The whole pipeline on CPU (gloo, 2 vLLM CPU workers), NVFP4 checkpoint quantized from the BF16 one.

    One checkpoint kind only (the bf16 kind's TP=2 path is covered by tests/test_vllm.py): 2 engine starts,
    120 s on the 2-core CI machine (both kinds, 4 engines: 6.4 min there with other jobs running).
    """
    out = tmp_path / "out"
    proc = _run(["--tiny", "--kinds", "nvfp4", "--nvfp4-from", "quantize", "--work-dir", str(tmp_path / "work"),
                 "--out", str(out)], 800, VLLM_CPU_KVCACHE_SPACE="1")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    files = list(out.glob("tp_parity-*.json"))
    assert len(files) == 1, files
    res = json.loads(files[0].read_text())
    for key in ("device", "versions", "command", "date", "rows", "targets", "comparisons"):
        assert key in res, key
    assert {(r["kind"], r["tp"]) for r in res["rows"]} == {("nvfp4", 1), ("nvfp4", 2)}
    tp2 = next(r for r in res["rows"] if r["tp"] == 2)
    assert len(tp2["summary"]) == 2 and tp2["summary"][0]["pid"] != tp2["summary"][1]["pid"]
    assert tp2["llm_kwargs"]["enable_lora"] and tp2["llm_kwargs"]["tensor_parallel_size"] == 2
    c = res["comparisons"]["nvfp4"]
    assert c["logprob"]["completion"]["max"] <= 1e-4  # fp32 on CPU: far inside 2e-2
    assert c["aqn_logprob_shift_tp1"]["max"] > 1e-3  # the noise reached the outputs
    targets = {t["name"]: t for t in res["targets"]}
    assert set(targets) == {"tp2_vs_tp1_logprob_max_abs_diff[nvfp4-ckpt]",
                            "tp2_vs_tp1_logprob_max_abs_diff[nvfp4-ckpt, aqn]",
                            "greedy_token_match_fraction[nvfp4-ckpt]", "argmax_flips_outside_near_ties[nvfp4-ckpt]",
                            "layers_tp2_consistent_with_tp1[nvfp4-ckpt]", "aqn_checksum_equal_ranks"}
    for t in targets.values():
        m = t["measured"]
        assert m is not None and (m <= t["target"] if t["op"] == "<=" else m >= t["target"]), t
    assert "targets:" in proc.stdout and "MISSED" not in proc.stdout
