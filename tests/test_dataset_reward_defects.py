"""Regressions for user-facing defects in data preparation (examples/data/prepare.py, verl_qerl.datasets), the
numeric reward (verl_qerl.verl.reward) and the launch overrides (verl_qerl.verl.launch). Local files only."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from verl_qerl import datasets as ds
from verl_qerl.testing.scripts import load_script
from verl_qerl.verl import reward as R
from verl_qerl.verl.launch import grpo_overrides

prepare = load_script("examples/data/prepare.py", "prepare_defects")


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _gsm(n: int, tag: str = "") -> list[dict]:
    return [{"question": f"{tag}What is {i}+{i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"} for i in range(n)]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = prepare.main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# --- 1. a local --source respects the split ------------------------------------------------------------------


def test_single_file_for_two_splits_is_refused_unless_the_split_is_named(tmp_path, capsys):
    one = _jsonl(tmp_path / "one.jsonl", _gsm(5))
    rc, _, err = _run(capsys, "gsm8k", "--source", one, "--out", tmp_path / "o")
    assert rc == 2 and "--test-source" in err and "one.jsonl" in err
    assert not (tmp_path / "o").exists()
    test = _jsonl(tmp_path / "held_out.jsonl", _gsm(2, "T: "))
    rc, _, err = _run(capsys, "gsm8k", "--train-source", one, "--test-source", test, "--out", tmp_path / "o")
    assert rc == 0, err
    assert len(pd.read_parquet(tmp_path / "o/train.parquet")) == 5
    te = pd.read_parquet(tmp_path / "o/test.parquet")
    assert len(te) == 2 and all(q.startswith("T: ") for q in te.extra_info.map(lambda x: x["question"]))
    rc, _, err = _run(capsys, "math500", "--train-source", one, "--out", tmp_path / "m")
    assert rc == 2 and "math500" in err


def test_help_documents_the_per_split_sources(capsys):
    with pytest.raises(SystemExit):
        prepare.main(["--help"])
    out = capsys.readouterr().out
    assert "--train-source" in out and "--test-source" in out


def test_folder_source_keeps_only_the_split_files(tmp_path, capsys):
    _jsonl(tmp_path / "d/train.jsonl", [{"problem": f"train q{i}", "answer": str(i)} for i in range(7)])
    _jsonl(tmp_path / "d/test.jsonl", [{"problem": f"test q{i}", "answer": str(i)} for i in range(3)])
    rc, _, err = _run(capsys, "math500", "--source", tmp_path / "d", "--out", tmp_path / "o")
    assert rc == 0, err
    assert len(pd.read_parquet(tmp_path / "o/test.parquet")) == 3
    _jsonl(tmp_path / "e/data.jsonl", [{"problem": "q", "answer": "1"}])
    rc, _, err = _run(capsys, "math500", "--source", tmp_path / "e", "--out", tmp_path / "o2")
    assert rc == 2 and "'test'" in err and "data.jsonl" in err


# --- 2. the reward reads correct boxed answers ----------------------------------------------------------------


@pytest.mark.parametrize("text, truth", [
    ("So 3+4=7.\n\n\\boxed{7}\n\nI hope this answer is helpful!", "7"),
    ("Total is \\boxed{7}.\nAnswer: see above", "7"),
    ("\\boxed{42}\n#### Explanation\nWe added.", "42"),
    ("The total is \\boxed{1{,}200}", "1200"),
    ("##### 42", "42"),
])
def test_reward_reads_the_boxed_answer_past_wordy_markers(text, truth):
    assert R.compute_score("openai/gsm8k", text, truth) == 1.0
    assert R.compute_score("openai/gsm8k", text, str(int(truth) + 1)) == 0.0


def test_reward_answer_is_needs_word_boundaries():
    assert R.find_answers("The answer issue: 3", ["answer_is"]) == []
    assert R.find_answers("my nonanswer is 3", ["answer_is"]) == []
    assert R.final_answer("The answer is: 3") == 3
    assert R.final_answer("#### about 12") is None
    assert R.final_answer(r"\boxed{12} and then \boxed{x}") is None  # a boxed statement still counts


# --- 3. no tracebacks, no half output ---------------------------------------------------------------------------


def test_empty_file_is_a_named_error(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    rc, _, err = _run(capsys, "math500", "--source", tmp_path / "empty.jsonl", "--out", tmp_path / "o")
    assert rc == 2 and "empty.jsonl" in err and "empty" in err
    assert not (tmp_path / "o").exists()


def test_numeric_gsm8k_answer_is_a_named_error(tmp_path, capsys):
    _jsonl(tmp_path / "d/train.jsonl", [{"question": "q", "answer": 42}])
    _jsonl(tmp_path / "d/test.jsonl", _gsm(1))
    rc, _, err = _run(capsys, "gsm8k", "--source", tmp_path / "d", "--out", tmp_path / "o")
    assert rc == 2 and "'answer'" in err and "train.jsonl" in err and "row 0" in err


@pytest.mark.parametrize("src", ["./no/such/train.jsonl", "data/gsm8k_local/", "typo.jsonl", "a/b/c"])
def test_path_like_source_is_local_only(tmp_path, capsys, monkeypatch, src):
    monkeypatch.chdir(tmp_path)
    import datasets

    def no_hub(*a, **k):
        raise AssertionError("tried the hub")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    rc, _, err = _run(capsys, "math500", "--source", src, "--out", tmp_path / "o")
    assert rc == 2 and "no such file" in err and src.rstrip("/") in err


def test_out_that_is_a_file_is_an_error(tmp_path, capsys):
    src = _jsonl(tmp_path / "m.jsonl", [{"problem": "p", "answer": "1"}])
    (tmp_path / "afile").write_text("x")
    rc, _, err = _run(capsys, "math500", "--source", src, "--out", tmp_path / "afile")
    assert rc == 2 and "afile" in err and "not a folder" in err
    assert (tmp_path / "afile").read_text() == "x"


def test_a_failing_split_leaves_nothing_half_written(tmp_path, capsys):
    _jsonl(tmp_path / "d/train.jsonl", _gsm(3))
    _jsonl(tmp_path / "d/test.jsonl", [{"question": "q", "answer": "no marker"}])
    rc, _, err = _run(capsys, "gsm8k", "--source", tmp_path / "d", "--out", tmp_path / "out/new")
    assert rc == 2 and "no '#### <number>'" in err
    assert not (tmp_path / "out/new").exists()
    assert not (tmp_path / "out").exists()  # nor the parent it would have made
    # an existing output folder keeps its old files when a new run fails
    old = tmp_path / "old"
    old.mkdir()
    (old / "train.parquet").write_bytes(b"old")
    rc, _, _ = _run(capsys, "gsm8k", "--source", tmp_path / "d", "--out", old)
    assert rc == 2 and (old / "train.parquet").read_bytes() == b"old" and sorted(p.name for p in old.iterdir()) == [
        "train.parquet"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "old"]  # no temporary folder left behind
    _jsonl(tmp_path / "d/test.jsonl", _gsm(1))
    rc, _, err = _run(capsys, "gsm8k", "--source", tmp_path / "d", "--out", old)
    assert rc == 0, err
    assert len(pd.read_parquet(old / "train.parquet")) == 3 and len(pd.read_parquet(old / "test.parquet")) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "old"]  # no temporary folder left behind


# --- 4. a save_to_disk DatasetDict ------------------------------------------------------------------------------


def test_dataset_dict_folder_is_read_by_split(tmp_path, capsys):
    import datasets

    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"problem": f"tr{i}", "answer": "1"} for i in range(4)]),
        "test": datasets.Dataset.from_list([{"problem": f"te{i}", "answer": "2"} for i in range(2)])})
    dd.save_to_disk(str(tmp_path / "dd"))
    rc, _, err = _run(capsys, "math500", "--source", tmp_path / "dd", "--out", tmp_path / "o")
    assert rc == 0, err
    assert len(pd.read_parquet(tmp_path / "o/test.parquet")) == 2
    datasets.DatasetDict({"train": dd["train"]}).save_to_disk(str(tmp_path / "tr_only"))
    rc, _, err = _run(capsys, "math500", "--source", tmp_path / "tr_only", "--out", tmp_path / "o2")
    assert rc == 2 and "'test'" in err and "['train']" in err


# --- 5. degenerate rows ------------------------------------------------------------------------------------------


def test_gsm8k_answer_without_digits_is_rejected():
    with pytest.raises(ds.DatasetFormatError, match="####"):
        ds.gsm8k_answer("blah #### .")
    assert ds.gsm8k_answer("#### 1,234.") == "1234" and ds.gsm8k_answer("#### -.5") == "-.5"


def test_empty_fields_are_rejected_with_row_and_field(tmp_path, capsys):
    src = _jsonl(tmp_path / "m.jsonl", [{"problem": "p", "answer": "1"}, {"problem": " ", "answer": "2"}])
    rc, _, err = _run(capsys, "math500", "--source", src, "--out", tmp_path / "o")
    assert rc == 2 and "row 1" in err and "'problem'" in err and "m.jsonl" in err
    src = _jsonl(tmp_path / "m2.jsonl", [{"problem": "p", "answer": ""}])
    rc, _, err = _run(capsys, "math500", "--source", src, "--out", tmp_path / "o")
    assert rc == 2 and "row 0" in err and "'answer'" in err
    assert not (tmp_path / "o").exists()


def test_duplicate_prompts_are_dropped_and_counted(tmp_path, capsys):
    rows = [{"problem": "same q", "answer": "1"}] * 3 + [{"problem": "q2", "answer": "2"}]
    src = _jsonl(tmp_path / "dup.jsonl", rows)
    rc, out, err = _run(capsys, "math500", "--source", src, "--out", tmp_path / "o")
    assert rc == 0, err
    assert len(pd.read_parquet(tmp_path / "o/test.parquet")) == 2
    assert "2 duplicate" in out + err


# --- 6. bigmath --levels -----------------------------------------------------------------------------------------


def test_levels_are_validated(tmp_path, capsys):
    src = _jsonl(tmp_path / "bm.jsonl", [{"prompt": "Compute 6*7.", "solution": "42"}])
    for bad in ("3", "4,6", "high"):
        rc, _, err = _run(capsys, "bigmath", "--levels", bad, "--source", src, "--out", tmp_path / "o")
        assert rc == 2 and "--levels" in err and "4,5" in err, bad
    rc, _, err = _run(capsys, "bigmath", "--levels", "4,5", "--source", src, "--out", tmp_path / "o")
    assert rc == 2 and "'level'" in err
    assert not (tmp_path / "o").exists()


def test_levels_filter_a_local_level_column(tmp_path, capsys):
    rows = [{"prompt": f"q{lv}", "solution": "1", "level": lv} for lv in (1, 3, 4, 5)]
    src = _jsonl(tmp_path / "bm.jsonl", rows)
    rc, _, err = _run(capsys, "bigmath", "--levels", "4,5", "--source", src, "--out", tmp_path / "o")
    assert rc == 0, err
    kept = pd.read_parquet(tmp_path / "o/train.parquet")
    assert sorted(p[0]["content"].split("q")[-1][0] for p in kept.prompt) == ["4", "5"]
    rc, _, err = _run(capsys, "bigmath", "--source", src, "--out", tmp_path / "all")
    assert rc == 0, err
    assert len(pd.read_parquet(tmp_path / "all/train.parquet")) == 4  # no --levels: the local rows as given


# --- 7. launch overrides quote paths -----------------------------------------------------------------------------

KW = dict(qerl="nvfp4", train_batch_size=8, max_prompt_length=256, max_response_length=256, n=4, lora_rank=8,
          lora_alpha=16, lr=1e-5, mini_batch_size=4, micro_batch_size=2, gpu_memory_utilization=0.5, seed=1, steps=2)


@pytest.mark.parametrize("path", ["/runs/lr1e-5,seed1/model", "/m/qwen=7b", "/m/a[1]", "/m/it's", "/m/back\\",
                                  "/m/a\\'b", "/data/My Models/qwen", "/m/{x}", "/m/null", "/m/1e5",
                                  "/runs/${USER}/m", "/m/$HOME/x", "/m/a\\${x}", "/m/${a}${b}"])
def test_launch_paths_parse_back_exactly(path):
    """Each path as verl reads it: hydra's override parser, then OmegaConf's resolution of the composed config (a
    ``${...}`` in a path was an interpolation there: `/runs/${USER}/m` failed or became another path)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parser = OverridesParser.create()
    ov = grpo_overrides(model=path, train_files=path + "/t.parquet", val_files=Path(path) / "v.parquet", **KW)
    parsed = {o.key_or_group.replace(".", "_"): o.value() for o in parser.parse_overrides(ov)}
    cfg = OmegaConf.create({k: v for k, v in parsed.items() if isinstance(v, str)})
    got = {"actor_rollout_ref.model.path": cfg["actor_rollout_ref_model_path"],
           "data.train_files": cfg["data_train_files"], "data.val_files": cfg["data_val_files"]}
    assert got["actor_rollout_ref.model.path"] == path
    assert got["data.train_files"] == path + "/t.parquet"
    assert got["data.val_files"] == str(Path(path) / "v.parquet")


def test_launch_expands_home_and_keeps_plain_paths(monkeypatch, tmp_path):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    monkeypatch.setenv("HOME", str(tmp_path))
    ov = grpo_overrides(model="~/models/qwen", train_files="~/d/train.parquet", val_files="/d/test.parquet", **KW)
    got = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(ov)}
    assert got["actor_rollout_ref.model.path"] == f"{tmp_path}/models/qwen"
    assert got["data.train_files"] == f"{tmp_path}/d/train.parquet"
    assert "data.val_files=/d/test.parquet" in ov  # a plain path stays as it was
    assert "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct" in grpo_overrides(
        model="Qwen/Qwen2.5-7B-Instruct", train_files="/t", val_files="/v", **KW)


def test_a_hub_source_that_cannot_load_is_a_named_error(monkeypatch):
    """Offline (HF_HUB_OFFLINE, as in CI) or a misspelled hub name: an error naming the source and the way out, not
    the hub client's traceback."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ds.DatasetFormatError, match=r"qerl-no-such-owner/no-such-set: could not load split 'train' "
                                                 r"from the Hugging Face hub .*--source"):
        ds.load_rows("qerl-no-such-owner/no-such-set", "train")
