"""Reproduced defects of example scripts: each test failed before its fix.

* ``examples/quantize_tiny.py`` deleted the whole ``--workdir`` (a user's other files with it); it now replaces
  only its own ``tiny-bf16`` / ``tiny-nvfp4`` folders, once both new ones are complete.
* ``examples/exploration/summarize.py`` let meta.json's ``seeds`` (campaign.sh's per-call seed *count*) overwrite
  ``settings.seeds``, the list of seeds summarized.
* ``examples/exploration/run_arms.py`` passed ``trainer.default_local_dir`` to hydra unquoted: a run folder such as
  ``/runs/lr2e-4,seed0`` failed to parse, a ``${...}`` in it was interpolated.
* ``examples/pretrained/base_accuracy.py`` found a bad ``--levels`` / ``--n`` only after loading the model and
  scoring earlier levels, and wrote ``--out`` only at the very end.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from verl_qerl.testing.scripts import REPO, load_script

qt = load_script("examples/quantize_tiny.py", "quantize_tiny")
summarize = load_script("examples/exploration/summarize.py", "_defects_summarize")
run_arms = load_script("examples/exploration/run_arms.py", "_defects_run_arms")
ba = load_script("examples/pretrained/base_accuracy.py", "_defects_base_accuracy")


# --- quantize_tiny.py: --workdir keeps the user's files ---------------------------------------------------------

def test_quantize_tiny_keeps_other_files_in_workdir(tmp_path):
    """The script end to end (a tiny model, ~20 s on a CPU): a file of the user's in --workdir survives, and an
    earlier run's outputs are replaced."""
    work = tmp_path / "work"
    (work / "tiny-bf16").mkdir(parents=True)
    (work / "tiny-bf16" / "stale.txt").write_text("an earlier run")
    (work / "keep.txt").write_text("my notes")
    done = subprocess.run([sys.executable, str(REPO / "examples" / "quantize_tiny.py"), "--workdir", str(work)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (work / "keep.txt").read_text() == "my notes"
    assert not (work / "tiny-bf16" / "stale.txt").exists()
    assert sorted(p.name for p in work.iterdir()) == ["keep.txt", "tiny-bf16", "tiny-nvfp4"]
    assert (work / "tiny-nvfp4" / "config.json").is_file()


def _fake_build(tag: str):
    def build(staging: Path) -> None:
        for name in qt.OUTPUTS:
            (staging / name).mkdir()
            (staging / name / "model.txt").write_text(tag)
    return build


def test_quantize_tiny_replaces_only_its_outputs_and_only_when_complete(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    (work / "other").mkdir()
    assert qt.write_outputs(work, _fake_build("old")) == (work / "tiny-bf16", work / "tiny-nvfp4")
    assert qt.write_outputs(work, _fake_build("new")) == (work / "tiny-bf16", work / "tiny-nvfp4")
    assert sorted(p.name for p in work.iterdir()) == ["keep.txt", "other", "tiny-bf16", "tiny-nvfp4"]
    assert [(work / n / "model.txt").read_text() for n in qt.OUTPUTS] == ["new", "new"]

    def half(staging: Path) -> None:  # dies after writing one of the two
        (staging / "tiny-bf16").mkdir()
        (staging / "tiny-bf16" / "model.txt").write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        qt.write_outputs(work, half)
    # the previous complete outputs are untouched, and no staging folder is left behind
    assert sorted(p.name for p in work.iterdir()) == ["keep.txt", "other", "tiny-bf16", "tiny-nvfp4"]
    assert [(work / n / "model.txt").read_text() for n in qt.OUTPUTS] == ["new", "new"]
    # a new folder is created as before
    qt.write_outputs(tmp_path / "fresh" / "sub", _fake_build("x"))
    assert sorted(p.name for p in (tmp_path / "fresh" / "sub").iterdir()) == ["tiny-bf16", "tiny-nvfp4"]


# --- summarize.py: settings.seeds is the seeds summarized ---------------------------------------------------------

def _runs(root: Path, seeds=(0, 1, 2)) -> None:
    vk = "val-core/openai/gsm8k/acc/mean@1"
    for seed in seeds:
        for arm in ("bf16", "nvfp4_noaqn", "nvfp4"):
            d = root / f"{arm}-s{seed}"
            d.mkdir(parents=True)
            lines = [{"step": 0, "data": {vk: 0.4}}]
            lines += [{"step": s, "data": {"critic/score/mean": 0.3 + 0.01 * s + 0.01 * seed, "actor/entropy": 0.08,
                                           "rollout_corr/rollout_log_ppl": 0.07, "timing_s/step": 10.0,
                                           **({vk: 0.45} if s % 5 == 0 else {})}} for s in range(1, 11)]
            (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    # as campaign.sh writes it: "seeds" is the seed count of the (last) launcher call
    (root / "meta.json").write_text(json.dumps({"device": "cpu", "seeds": 1, "steps": 25, "budget_s": 435,
                                                "launcher": "examples/exploration/campaign.sh"}))


def test_summary_seeds_are_the_runs_not_meta_json(tmp_path):
    _runs(tmp_path / "runs")
    res = summarize.summarize(tmp_path / "runs", tmp_path / "out", device="t", command="pytest")
    js = json.loads((tmp_path / "out" / "exploration-t.json").read_text())
    assert res["settings"]["seeds"] == js["settings"]["seeds"] == [0, 1, 2]
    assert js["campaign_meta"] == {"seeds": 1, "steps": 25, "budget_s": 435,
                                   "launcher": "examples/exploration/campaign.sh"}
    only = summarize.summarize(tmp_path / "runs", tmp_path / "o2", device="t", command="pytest", seeds={0, 2})
    assert only["settings"]["seeds"] == [0, 2]


# --- run_arms.py: the checkpoint folder survives hydra -------------------------------------------------------------

@pytest.mark.parametrize("out", ["/tmp/audit/runs/lr2e-4,seed0", "/tmp/runs/${USER}/x", "/tmp/r/a b[1]=2",
                                 "/tmp/plain/runs"])
def test_run_arms_checkpoint_dir_parses_back_exactly(out):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    args = run_arms.parse_args(["--model", "/m", "--data", "/d", "--out", out, "--dry-run", "--device", "cpu",
                                "--seeds", "1", "--arms", "bf16"])
    (run,) = run_arms.plan(args)
    ov = [a for a in run.cmd if "=" in a and not a.startswith("-")]
    parsed = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(ov)}
    cfg = OmegaConf.create({"d": parsed["trainer.default_local_dir"]})
    assert cfg.d == str(Path(out).resolve() / "bf16-s0" / "ckpt")


@pytest.mark.parametrize("project", ["qerl,exploration", "runs-${USER}", "1e-5", "plain-name"])
def test_run_arms_project_name_parses_back_exactly(project):
    """``--project`` reached ``trainer.project_name`` unquoted: a ``,`` split the override, ``${USER}`` was resolved
    and ``1e-5`` became a float."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    args = run_arms.parse_args(["--model", "/m", "--data", "/d", "--out", "/tmp/o", "--dry-run", "--device", "cpu",
                                "--seeds", "1", "--arms", "bf16", "--project", project])
    (run,) = run_arms.plan(args)
    ov = [a for a in run.cmd if "=" in a and not a.startswith("-")]
    parsed = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(ov)}
    cfg = OmegaConf.create({"p": parsed["trainer.project_name"]})
    assert cfg.p == project and isinstance(cfg.p, str)


# --- base_accuracy.py: arguments checked before the model loads, --out written per level -----------------------

@pytest.mark.parametrize(("argv", "message"), [
    (["--levels", "L1,l2"], r"--levels 'L1,l2': unknown level\(s\) \['l2'\]"),
    (["--levels", "L1,L9"], r"--levels .*\['L9'\]"),
    (["--levels", "L1,,L2"], r"--levels 'L1,,L2'"),
    (["--levels", "L1,L1"], r"--levels .*more than once"),
    (["--n", "0"], r"--n 0: must be >= 1"),
    (["--batch", "0"], r"--batch 0: must be >= 1"),
])
def test_base_accuracy_bad_args_stop_before_loading(tmp_path, capsys, argv, message):
    """The model folder does not exist: before the fix, loading it (or scoring) failed first with a traceback."""
    with pytest.raises(SystemExit) as exc:
        ba.main([str(tmp_path / "no-model"), *argv, "--out", str(tmp_path / "r.json")])
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_base_accuracy_levels_allow_spaces():
    assert ba.parse_args(["m", "--levels", " L1, L3 "]).levels == ["L1", "L3"]


def test_base_accuracy_writes_out_after_each_level(tmp_path, monkeypatch):
    """A run stopped during its second level keeps the first level's results in --out."""
    import transformers

    loaded = SimpleNamespace(eval=lambda: loaded)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: object())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loaded)
    calls = []

    def score(model, tok, problems, max_new_tokens, batch, label=""):
        calls.append(label)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return {"n": len(problems), "strict": 0.5, "lenient": 0.5, "boxed": 0.5, "numeric": 0.5,
                "mean_tokens": 3.0, "samples": []}

    monkeypatch.setattr(ba, "score_level", score)
    out = tmp_path / "r.json"
    with pytest.raises(KeyboardInterrupt):
        ba.main(["m", "--n", "2", "--levels", "L1, L2", "--out", str(out)])
    assert calls == ["L1", "L2"]
    js = json.loads(out.read_text())
    assert list(js["levels"]) == ["L1"] and js["levels"]["L1"]["strict"] == 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary file left
