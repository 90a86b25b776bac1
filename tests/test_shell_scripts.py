"""The example shell launchers, run with a stand-in python: what they delete, which files they read back, and the
hydra overrides they build from paths."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from verl_qerl.testing.scripts import REPO
from verl_qerl.verl.launch import path_value


def _fake_python(tmp_path: Path, real_for_c: bool = False) -> tuple[Path, Path]:
    """A python that records each call (one line of %q-quoted args) and succeeds; with ``real_for_c`` its ``-c``
    snippets run in the real interpreter (the scripts quote paths for hydra through verl_qerl there)."""
    calls, fake = tmp_path / "calls.txt", tmp_path / "bin" / "python"
    fake.parent.mkdir(exist_ok=True)
    real = f'if [ "$1" = -c ]; then exec {shlex.quote(sys.executable)} "$@"; fi\n' if real_for_c else ""
    log = shlex.quote(str(calls))
    fake.write_text(f"#!/usr/bin/env bash\n{real}for a in \"$@\"; do printf '%q ' \"$a\"; done >> {log}\n"
                    f"echo >> {log}\nexit 0\n")
    fake.chmod(0o755)
    return fake, calls


def _calls(calls: Path) -> list[list[str]]:
    return [shlex.split(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def _run(args, env, cwd=REPO):
    return subprocess.run(["bash", *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


# ---- examples/exploration/campaign.sh: WORKDIR cleaning ----

CAMPAIGN = REPO / "examples" / "exploration" / "campaign.sh"


def _campaign_env(tmp_path, out, work, phases="problems"):
    fake, _ = _fake_python(tmp_path)
    return dict(os.environ, OUT=str(out), WORKDIR=str(work), PYTHON=str(fake), QERL_DEVICE="cpu", PHASES=phases)


def test_campaign_refuses_an_out_inside_the_workdir_it_starts_afresh(tmp_path):
    """`rm -rf "$WORKDIR"` after `mkdir -p "$OUT"`: an OUT inside WORKDIR (and every other file there) was wiped,
    and the script still exited 0."""
    work = tmp_path / "qx"
    (work / "out").mkdir(parents=True)
    (work / "out" / "exploration-nvidia-h200.md").write_text("precious")
    (work / "notes.txt").write_text("keep")
    res = _run([CAMPAIGN], _campaign_env(tmp_path, work / "out", work))
    assert res.returncode == 2, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    assert "inside WORKDIR" in res.stderr
    assert (work / "out" / "exploration-nvidia-h200.md").read_text() == "precious"
    assert (work / "notes.txt").read_text() == "keep"


def test_campaign_removes_only_its_own_entries(tmp_path):
    """A WORKDIR such as `.` or $HOME: its `data` (not made by the script) is refused, not deleted; in a WORKDIR the
    script made, only its own entries go and the caller's files stay."""
    work, out = tmp_path / "home", tmp_path / "out"
    (work / "data").mkdir(parents=True)
    (work / "data" / "mine.parquet").write_text("user data")
    res = _run([CAMPAIGN], _campaign_env(tmp_path, out, work))
    assert res.returncode == 2 and "not made by this script" in res.stderr, (res.returncode, res.stderr[-2000:])
    assert (work / "data" / "mine.parquet").read_text() == "user data"

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "notes.txt").write_text("keep")
    env = _campaign_env(tmp_path, out, fresh)
    assert _run([CAMPAIGN], env).returncode == 0
    for d in ("data", "model", "runs/a"):
        (fresh / d).mkdir(parents=True, exist_ok=True)
    (fresh / "probe.json").write_text("{}")
    res = _run([CAMPAIGN], env)  # a second call on the script's own WORKDIR starts it afresh
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(p.name for p in fresh.iterdir()) == [".qerl-campaign", "logs", "notes.txt", "runs"]
    assert not list((fresh / "runs").iterdir())


# ---- examples/run_default.sh: the metrics it summarizes ----

def test_run_default_summarizes_the_metrics_file_grpo_wrote(tmp_path):
    """run_default.sh summarized $WORKDIR/metrics-nvfp4.jsonl with .venv/bin/python, while grpo.sh writes the metrics
    to $VERL_FILE_LOGGER_PATH when given and runs $PYTHON; relative paths are the caller's, not the repository's."""
    fake, calls = _fake_python(tmp_path)
    caller = tmp_path / "caller"
    caller.mkdir()
    env = dict(os.environ, PYTHON=str(fake), WORKDIR="w", VERL_FILE_LOGGER_PATH="new.jsonl", QERL_DEVICE="gpu",
               RAY_TMPDIR=str(tmp_path / "ray"))
    res = _run([REPO / "examples" / "run_default.sh"], env, cwd=caller)
    assert res.returncode == 0, res.stderr[-2000:]
    got = _calls(calls)
    assert ["examples/tiny/summarize.py", str(caller / "new.jsonl")] in got  # run by $PYTHON, on grpo.sh's file
    assert ["examples/tiny/prepare.py", str(caller / "w")] in got


# ---- paths in hydra overrides ----

ODD_PATHS = ["/data,v2", "/m(1)", "/it's", "/runs/${USER}/m", "/a b=c"]


def _parse(overrides: list[str]) -> dict[str, str]:
    """Each override value as verl reads it: hydra's override parser, then OmegaConf's resolution."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parsed = {o.key_or_group.replace(".", "_"): o.value() for o in OverridesParser.create().parse_overrides(overrides)}
    cfg = OmegaConf.create({k: v for k, v in parsed.items() if isinstance(v, str)})
    return {k: cfg[k] for k in cfg}


def _launched(calls: Path) -> list[str]:
    launch = [c for c in _calls(calls) if "verl.trainer.main_ppo" in c]
    assert len(launch) == 1, launch
    return launch[0][launch[0].index("verl.trainer.main_ppo") + 1:]


@pytest.mark.parametrize("odd", ODD_PATHS)
@pytest.mark.parametrize("script", ["gsm8k_grpo.sh", "bigmath_dapo.sh"])
def test_paper_scripts_pass_paths_to_hydra_intact(script, odd, tmp_path):
    """`data.train_files=$DATA/train.parquet` unquoted: a ',' or '(' is a hydra syntax error, a `${...}` an
    OmegaConf interpolation."""
    fake, calls = _fake_python(tmp_path, real_for_c=True)
    data, model = str(tmp_path) + odd, str(tmp_path) + odd + "/model"
    env = dict(os.environ, PYTHON=str(fake), DATA_DIR=data, MODEL_PATH=model)
    res = _run([REPO / "examples" / "qerl" / script, "7B", "qerl"], env)
    assert res.returncode == 0, res.stderr[-2000:]
    got = _parse(_launched(calls))
    assert got["actor_rollout_ref_model_path"] == model
    sub = ("gsm8k/train.parquet", "gsm8k/test.parquet") if script == "gsm8k_grpo.sh" else (
        "bigmath/train.parquet", "math500/test.parquet")
    assert (got["data_train_files"], got["data_val_files"]) == (f"{data}/{sub[0]}", f"{data}/{sub[1]}")


@pytest.mark.parametrize("odd", ODD_PATHS)
def test_tiny_grpo_passes_paths_to_hydra_intact(odd, tmp_path):
    fake, calls = _fake_python(tmp_path, real_for_c=True)
    work = Path(str(tmp_path / "w") + odd.replace("/", "_"))
    work.mkdir()
    env = dict(os.environ, PYTHON=str(fake), WORKDIR=str(work), QERL_DEVICE="gpu", RAY_TMPDIR=str(tmp_path / "ray"))
    res = _run([REPO / "examples" / "tiny" / "grpo.sh", "nvfp4"], env)
    assert res.returncode == 0, res.stderr[-2000:]
    got = _parse(_launched(calls))
    assert got["actor_rollout_ref_model_path"] == f"{work}/model"
    assert (got["data_train_files"], got["data_val_files"]) == (f"{work}/data/train.parquet",
                                                                f"{work}/data/test.parquet")
    assert got["reward_custom_reward_function_path"] == str(REPO / "examples" / "tiny" / "reward.py")


@pytest.mark.parametrize("path", ["/m", "/home/u/models/Qwen2.5-7B-Instruct", "/a/b@c/d%e+f_g.h-i", *ODD_PATHS,
                                  "Qwen/Qwen2.5-7B-Instruct", "1.5", "true", "~/m"])
def test_shell_path_quoting_matches_launch_py(path):
    """common.sh's qerl_hydra_path answers plain absolute paths itself (no interpreter: PYTHON=false would fail);
    every answer is path_value's."""
    python = "false" if path.startswith("/") and path_value(path) == path else sys.executable
    script = f'source "{REPO}/examples/qerl/common.sh"; PYTHON={shlex.quote(python)} qerl_hydra_path "$1"'
    res = subprocess.run(["bash", "-c", script, "bash", path], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == path_value(path) + "\n"
