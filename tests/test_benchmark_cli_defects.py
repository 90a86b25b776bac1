"""User-facing defects of the benchmark command lines, on CPU: bad sizes and lists refused with the argument named,
input files that are not what the script needs named instead of a traceback, labels that follow --no-lora, and
results files written whole (a write that fails midway keeps the previous file, never a truncated one)."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from verl_qerl.testing.scripts import load_script

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"


@pytest.fixture(scope="module")
def rb():
    return load_script("benchmarks/rollout.py", "rollout_cli_defects")


@pytest.fixture(scope="module")
def gs():
    return load_script("benchmarks/grpo_step.py", "grpo_step_cli_defects")


@pytest.fixture(scope="module")
def kb():
    return load_script("benchmarks/kernel.py", "kernel_cli_defects")


@pytest.fixture(scope="module")
def kr():
    return load_script("benchmarks/kernel_retable.py", "kernel_retable_cli_defects")


@pytest.fixture(scope="module")
def kab():
    return load_script("benchmarks/kernel_ab.py", "kernel_ab_cli_defects")


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("OUT", None)
    return env


def _run(argv: list[str], cwd: Path, max_file_bytes: int | None = None) -> subprocess.CompletedProcess:
    """A benchmark script in a child; ``max_file_bytes``: no file it writes may grow past that (RLIMIT_FSIZE, as a
    full disk or quota would stop it), so a write of more fails midway."""
    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the child
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    return subprocess.run([sys.executable, *argv], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=200,
                          preexec_fn=limit if max_file_bytes else None)


def _error_line(err: str) -> str:
    """The message of argparse's ``error:`` line (the usage above it names every option anyway)."""
    return [ln for ln in err.splitlines() if ": error: " in ln][-1].split(": error: ", 1)[1]


def _assert_kept_whole(path: Path, before: str, proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode != 0, "the limited write was expected to fail"
    assert "File too large" in proc.stderr, proc.stderr[-3000:]
    assert path.read_text() == before  # the previous results, whole; not the first bytes of the new ones
    json.loads(path.read_text())
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left beside it


# ------------------------------------------------------------------------------------------------
# benchmarks/rollout.py
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "named"), [
    (["--batches", "64,,256"], "--batches"),   # was: ValueError "invalid literal for int()", a traceback
    (["--batches", "1,-8"], "--batches"),
    (["--prompt-tokens", "0"], "--prompt-tokens"),  # was: silently the default, 256
    (["--new-tokens", "0"], "--new-tokens"),        # was: silently the default, 1024
    (["--timeout", "-1"], "--timeout"),             # was: accepted; every engine then "timed out" at once
])
def test_rollout_bad_sizes_are_refused_naming_the_argument(rb, capsys, argv, named):
    with pytest.raises(SystemExit) as exc:
        rb.parse_args(argv)
    assert exc.value.code == 2
    assert named in _error_line(capsys.readouterr().err)
    args = rb.parse_args(["--batches", "1, 8", "--prompt-tokens", "3"])  # good values still pass
    assert args.batches == [1, 8] and args.prompt_tokens == 3 and args.new_tokens == 1024


def test_rollout_no_lora_run_without_rows_is_not_labelled_lora(tmp_path):
    """--no-lora where nothing was measured (here: only GPU backends, skipped on CPU): the targets and the table
    said "(LoRA)" / "r32"."""
    out = tmp_path / "out"
    proc = _run([str(BENCH / "rollout.py"), "--tiny", "--no-lora", "--backends", "ct_marlin,nf4", "--out", str(out),
                 "--work-dir", str(tmp_path / "work")], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "rollout-cpu-tiny.json").read_text())
    names = [t["name"] for t in res["targets"]]
    assert names and all(n.endswith("(no LoRA)") for n in names), names
    table = [ln for ln in proc.stdout.splitlines() if ln.startswith("| tiny |")]
    assert table and all("| off |" in ln and "r32" not in ln for ln in table), table


def test_rollout_no_lora_label_from_the_workload_in_merge(rb):
    result = {"workload": {"prompt_tokens": 16, "new_tokens": 8, "lora_rank": None, "seed": 0, "batches": [1]},
              "models": {}, "rows": [], "skipped": [], "errors": [], "targets": []}
    names = [t["name"] for t in rb.merge_previous(result, [], ["tiny"], [1])["targets"]]
    assert names and not [n for n in names if "(LoRA)" in n]
    with_lora = {**result, "workload": {**result["workload"], "lora_rank": 32}}
    assert all(t["name"].endswith("(LoRA)") for t in rb.merge_previous(with_lora, [], ["tiny"], [1])["targets"])


def test_rollout_results_file_is_never_left_half_written(tmp_path):
    argv = [str(BENCH / "rollout.py"), "--tiny", "--backends", "ct_marlin,nf4", "--out", str(tmp_path / "out"),
            "--work-dir", str(tmp_path / "work")]
    first = _run(argv, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    path = tmp_path / "out" / "rollout-cpu-tiny.json"
    before = path.read_text()
    assert len(before) > 1500
    _assert_kept_whole(path, before, _run(argv, tmp_path, max_file_bytes=1000))


# ------------------------------------------------------------------------------------------------
# benchmarks/grpo_step.py
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "named"), [
    (["--micro-batch", "0"], "--micro-batch"),      # was: ZeroDivisionError, a traceback
    (["--batch", "0"], "--batch"),                  # was: accepted
    (["--n", "-8", "--micro-batch", "8"], "--n"),   # was: accepted
    (["--steps", "0"], "--steps"),                  # was: accepted
    (["--tp", "0"], "--tp"),
    (["--timeout", "0"], "--timeout"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--compare", "gpus", "--gpus", "1"], "--gpus"),  # was: the 1-GPU run compared with itself, ratio 1.0
    (["--variants", "qerl,qerl"], "--variants"),       # was: run twice, one row kept, compared with itself
])
def test_grpo_step_bad_sizes_are_refused_naming_the_argument(gs, capsys, argv, named):
    with pytest.raises(SystemExit) as exc:
        gs.parse_args(argv)
    assert exc.value.code == 2
    assert named in _error_line(capsys.readouterr().err)


def _grpo_baseline(gs, tmp_path: Path, variant: str, device: str = "NVIDIA H200") -> str:
    args = gs.parse_args(["--variants", variant])
    steps = [{"training/global_step": i + 1, "timing_s/step": 3.0 if variant == "qerl" else 4.0,
              "timing_s/gen": 1.0, "timing_s/update_actor": 1.0, "perf/total_num_tokens": 900} for i in range(4)]
    row = {"variant": variant, "qerl": gs.VARIANTS[variant], "gpus": 1, "rc": 0, **gs.summarize_run(steps, 1)}
    res = {"benchmark": "grpo_step", "device": device, "versions": {}, "rows": [row],
           "settings": {k: v for k, v in vars(args).items() if k != "extra"}}
    path = tmp_path / f"base-{variant}.json"
    path.write_text(json.dumps(res, default=str))
    return str(path)


def test_grpo_step_merge_only_baseline_that_is_not_an_object_is_named(gs, tmp_path, capsys):
    bad = tmp_path / "list.json"
    bad.write_text("[]")  # was: AttributeError: 'list' object has no attribute 'get'
    rc = gs.main(["--merge-only", "--baseline", str(bad), "--out", str(tmp_path / "out")])
    assert rc == 2 and str(bad) in capsys.readouterr().err
    assert not list((tmp_path / "out").glob("*.json"))


def test_grpo_step_results_file_is_never_left_half_written(gs, tmp_path):
    q, lo = _grpo_baseline(gs, tmp_path, "qerl"), _grpo_baseline(gs, tmp_path, "lora")
    out = tmp_path / "out"
    argv = [str(BENCH / "grpo_step.py"), "--variants", "qerl,lora", "--merge-only", "--baseline", q, "--baseline", lo,
            "--out", str(out)]
    first = _run(argv, tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    (path,) = out.glob("grpo_step-*.json")
    before = path.read_text()
    assert json.loads(before)["targets"][0]["measured"] == pytest.approx(0.75)
    assert len(before) > 3000
    _assert_kept_whole(path, before, _run(argv, tmp_path, max_file_bytes=2000))


# ------------------------------------------------------------------------------------------------
# benchmarks/kernel.py (argument parsing only), kernel_retable.py, kernel_ab.py
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "named"), [
    (["--ms", "64,,256"], "--ms"),  # was: "invalid literal for int() with base 10: ''", not naming --ms
    (["--ms", "0"], "--ms"),        # was: accepted (on CPU it went on to the extension)
    (["--profile", "--profile-m", "1,,2"], "--profile-m"),    # was: ValueError traceback
    (["--profile", "--profile-nk", "3584x"], "--profile-nk"),  # was: ValueError traceback
])
def test_kernel_bad_lists_are_refused_naming_the_argument(kb, monkeypatch, capsys, argv, named):
    monkeypatch.setattr(sys, "argv", ["kernel.py", *argv])
    with pytest.raises(SystemExit) as exc:
        kb.main()
    assert exc.value.code == 2
    assert named in _error_line(capsys.readouterr().err)


def _retable_inputs(tmp_path: Path) -> tuple[Path, Path]:
    rows = [{"model": "qwen2.5-7b", "layer": "qkv", "N": 4608, "K": 3584, "M": 128, "bf16_graph_ms": 0.013,
             "ours_graph_ms": 0.019, "kernel_wgmma_rs_graph_ms": 0.019},
            {"model": "qwen2.5-7b", "layer": "sum", "M": 128, "bf16_graph_ms": 0.013, "ours_graph_ms": 0.019}]
    res, tab = tmp_path / "kernel-h200.json", tmp_path / "gemm_dispatch-h200.json"
    res.write_text(json.dumps({"device": "NVIDIA H200", "rows": rows, "targets": []}))
    tab.write_text(json.dumps({"command": "kernel.py", "points": [[4608, 3584, 128, "wgmma_rs"]]}))
    return res, tab


def test_retable_refuses_to_overwrite_its_dispatch_table(kr, tmp_path, capsys):
    res, tab = _retable_inputs(tmp_path)
    before = tab.read_text()
    with pytest.raises(SystemExit):  # was: "wrote gemm_dispatch-h200.json", the table replaced by results
        kr.main([str(res), str(tab), "--out", str(tab)])
    assert "--out" in _error_line(capsys.readouterr().err) and tab.read_text() == before


def test_retable_names_an_input_that_is_not_what_it_needs(kr, tmp_path, capsys):
    res, tab = _retable_inputs(tmp_path)
    broken = tmp_path / "broken.json"
    broken.write_text('{"rows": [')
    out = str(tmp_path / "o.json")
    for argv, named in (([str(broken), str(tab)], str(broken)),          # was: JSONDecodeError traceback
                        ([str(tab), str(res)], "'rows'"),                 # was: KeyError: 'rows'
                        ([str(res), str(tmp_path / "missing.json")], "missing.json")):  # was: FileNotFoundError
        with pytest.raises(SystemExit):
            kr.main([*argv, "--out", out])
        assert named in _error_line(capsys.readouterr().err)
    tab.write_text(json.dumps({"points": [[1, 2, 3, "wgmma_rs"]]}))
    with pytest.raises(SystemExit):  # was: ValueError traceback
        kr.main([str(res), str(tab), "--out", out])
    assert "no point" in _error_line(capsys.readouterr().err) and not Path(out).exists()


def test_retable_output_is_never_left_half_written(kr, tmp_path):
    res, tab = _retable_inputs(tmp_path)
    out = tmp_path / "o" / "retabled.json"
    out.parent.mkdir()
    argv = [str(BENCH / "kernel_retable.py"), str(res), str(tab), "--out", str(out)]
    first = _run(argv, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = out.read_text()
    assert len(before) > 600
    _assert_kept_whole(out, before, _run(argv, tmp_path, max_file_bytes=400))


def test_kernel_ab_names_a_file_that_is_not_json(kab, tmp_path, capsys):
    bad = tmp_path / "h1-truncated.json"
    bad.write_text('{"rows": [{"model": ')
    with pytest.raises(SystemExit):
        kab.main(["--head", str(bad), "--cand", str(bad)])  # was: "Expecting value: ...", no file named
    assert "h1-truncated.json" in _error_line(capsys.readouterr().err)
