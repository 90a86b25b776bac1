"""User-facing defects of ``qerl-quantize`` / ``qerl-pretrained`` (markers, ``~``, ``--no-progress``, SIGTERM at the
swap, dtype wording, cached paths), each on tiny local checkpoints: a tiny BF16 model and a synthetic GGUF shipped
by a fake installed distribution, as in ``tests/test_checkpoint_cli.py`` and ``tests/test_pretrained.py``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from verl_qerl import checkpoint_conversion, pretrained
from verl_qerl.checkpoint_conversion import quantize_checkpoint
from verl_qerl.nvfp4.checkpoint import FORMAT_BF16, FORMAT_CT, CheckpointReader
from verl_qerl.pretrained import GGUFPart, PretrainedModel

GGUF_BARS = ("Converting and de-quantizing GGUF tensors", "Loading weights", "Writing model shards")


@pytest.fixture
def fake_model(tiny_gguf, tmp_path, monkeypatch) -> PretrainedModel:
    """``tiny-test``: the tiny GGUF as the one file of a fake installed distribution ``qerl-fake-one``."""
    site = tmp_path / "site"
    rel = "qerl_fake_one/data/model.gguf"
    data = tiny_gguf.read_bytes()
    (site / rel).parent.mkdir(parents=True)
    (site / rel).write_bytes(data)
    info = site / "qerl_fake_one-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: qerl-fake-one\nVersion: 0.1.0\n")
    (info / "RECORD").write_text(f"{rel},,{len(data)}\n")
    monkeypatch.syspath_prepend(str(site))
    model = PretrainedModel(key="tiny-test", title="Tiny GGUF test model",
                            parts=(GGUFPart("qerl-fake-one", "0.1.0", rel, len(data)),),
                            sha256=hashlib.sha256(data).hexdigest(), architecture="qwen2",
                            general_name="Tiny GGUF Test Model", gguf_name="tiny-test.gguf")
    monkeypatch.setitem(pretrained.MODELS, model.key, model)
    return model


def _pretrained_cli(*args: str) -> int:
    from verl_qerl.cli.pretrained import main

    return main(["tiny-test", *args])


# --- 1. tool markers are not copied; an NVFP4 folder is never a finished BF16 conversion; --force rebuilds ---------

def test_quantize_does_not_copy_tool_markers(tiny_bf16, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_bf16, src)
    (src / pretrained.DONE_MARKER).write_text(json.dumps({"kind": "model"}))
    (src / ".complete").write_text("{}")
    quantize_checkpoint(src, tmp_path / "q")
    names = {p.name for p in (tmp_path / "q").iterdir()}
    assert pretrained.DONE_MARKER not in names and ".complete" not in names, names
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names, names


def test_an_nvfp4_folder_is_not_a_finished_conversion_and_force_rebuilds_it(fake_model, tmp_path, capsys):
    bf16 = pretrained.prepare("tiny-test", tmp_path / "hf", progress=False)
    q = tmp_path / "q"
    quantize_checkpoint(bf16, q)
    shutil.copy2(bf16 / pretrained.DONE_MARKER, q / pretrained.DONE_MARKER)  # as older qerl-quantize runs left it
    assert CheckpointReader(q).format == FORMAT_CT
    assert not pretrained.is_prepared(q, fake_model)  # a quantization_config: not the BF16 model, whatever DONE says

    capsys.readouterr()
    assert _pretrained_cli("--out", str(q), "--no-progress") == 2  # not finished: refused without --force
    assert "no matching DONE" in capsys.readouterr().err and CheckpointReader(q).format == FORMAT_CT
    assert _pretrained_cli("--out", str(q), "--force", "--no-progress") == 0
    err = capsys.readouterr().err
    assert "already there" not in err, err
    assert CheckpointReader(q).format == FORMAT_BF16 and pretrained.is_prepared(q, fake_model)
    assert "quantization_config" not in json.loads((q / "config.json").read_text())


def test_force_rebuilds_a_finished_conversion(fake_model, tmp_path, capsys):
    out = pretrained.prepare("tiny-test", tmp_path / "hf", progress=False)
    (out / "stale.txt").write_text("left by hand")
    assert _pretrained_cli("--out", str(out), "--no-progress") == 0  # no --force: reused as is
    assert "already there" in capsys.readouterr().err and (out / "stale.txt").exists()
    assert _pretrained_cli("--out", str(out), "--force", "--no-progress") == 0
    err = capsys.readouterr().err
    assert "already there" not in err and "converted in" in err, err
    assert not (out / "stale.txt").exists() and pretrained.is_prepared(out, fake_model)


# --- 2. ``~`` is expanded in SRC, DST, --out and QERL_PRETRAINED_CACHE; printed paths are absolute ------------------

@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fake $HOME, and a working directory elsewhere (where a literal ``~`` folder would appear)."""
    home = (tmp_path / "home").resolve()
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    return home


def test_quantize_expands_tilde_and_prints_the_absolute_destination(tiny_bf16, home, capsys):
    from verl_qerl.cli.quantize import main

    shutil.copytree(tiny_bf16, home / "src")
    assert main(["~/src", "~/q"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert CheckpointReader(home / "q").format == FORMAT_CT
    assert list(Path.cwd().iterdir()) == []  # no ./~ folder
    assert f"wrote {home / 'q'}:" in out, out


def test_pretrained_expands_tilde_in_out_and_cache(fake_model, home, monkeypatch, capsys):
    assert _pretrained_cli("--out=~/hf", "--no-progress") == 0
    assert capsys.readouterr().out.strip() == str(home / "hf")
    assert pretrained.is_prepared(home / "hf", fake_model) and list(Path.cwd().iterdir()) == []

    monkeypatch.setenv("QERL_PRETRAINED_CACHE", "~/cache")
    assert pretrained.default_cache_dir() == home / "cache"
    assert _pretrained_cli("--no-progress") == 0
    assert capsys.readouterr().out.strip() == str(home / "cache" / "tiny-test")
    assert list(Path.cwd().iterdir()) == []


# --- 3. --no-progress silences transformers' own bars, and restores their state after -------------------------------

def test_no_progress_silences_transformers_bars(fake_model, tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled()
    capfd.readouterr()
    assert _pretrained_cli("--out", str(tmp_path / "hf"), "--no-progress") == 0
    err = capfd.readouterr().err
    assert not [bar for bar in GGUF_BARS if bar in err], err
    assert hf_logging.is_progress_bar_enabled() == before
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from tqdm.auto import tqdm

    assert gguf_utils.tqdm is tqdm  # the module's own bar is restored too


# --- 4. SIGTERM during the final swap: the message says DST was written --------------------------------------------

class _SignalWhileOldIsRemoved:
    """Stand-in for checkpoint_conversion's ``shutil``: SIGTERM arrives while replace_dir removes the old DST,
    i.e. after the new output was renamed into place."""

    def __init__(self) -> None:
        self.sent = False

    def __getattr__(self, name: str):
        return getattr(shutil, name)

    def rmtree(self, path, *args, **kwargs):
        if not self.sent and ".old-" in str(path):
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return shutil.rmtree(path, *args, **kwargs)


@pytest.mark.parametrize("tool", ["qerl-quantize", "qerl-pretrained"])
def test_sigterm_during_the_swap_reports_the_written_destination(tool, tiny_bf16, fake_model, tmp_path, monkeypatch,
                                                                 capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("previous output")
    stand_in = _SignalWhileOldIsRemoved()
    monkeypatch.setattr(checkpoint_conversion, "shutil", stand_in)
    if tool == "qerl-quantize":
        from verl_qerl.cli.quantize import main

        rc = main([str(tiny_bf16), str(dst), "--force"])
        want = FORMAT_CT
    else:
        rc = _pretrained_cli("--out", str(dst), "--force", "--no-progress")
        want = FORMAT_BF16
    err = capsys.readouterr().err
    assert stand_in.sent
    assert CheckpointReader(dst).format == want and not (dst / "old.txt").exists()  # DST was replaced
    assert rc == 128 + signal.SIGTERM, (rc, err)
    assert "no partial output left behind" not in err, err
    assert f"{dst.resolve()} written, then stopped by SIGTERM" in err, err


# --- 5. the help says what happens to lm_head / embeddings of a non-BF16 source; cached paths are absolute ---------

def test_help_matches_what_a_float32_source_keeps(tmp_path, capsys):
    from verl_qerl.cli.quantize import main
    from verl_qerl.testing.tiny import make_tiny_model

    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    src = make_tiny_model(tmp_path / "fp32", dtype=torch.float32)
    assert main([str(src), str(tmp_path / "q")]) == 0
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys() if "embed_tokens" in n or n.startswith("lm_head")}
    assert dtypes and set(dtypes.values()) == {"F32"}, dtypes  # kept as stored, as llm-compressor does
    assert "embeddings stay in BF16" not in help_text, help_text
    assert "in the source's dtype" in help_text, help_text


def test_cached_folder_is_printed_as_an_absolute_path(fake_model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _pretrained_cli("--out", "hf", "--no-progress") == 0
    fresh = capsys.readouterr().out.strip()
    assert _pretrained_cli("--out", "hf", "--no-progress") == 0
    captured = capsys.readouterr()
    assert "already there" in captured.err
    assert captured.out.strip() == fresh == str((tmp_path / "hf").resolve())


def test_a_tilde_checkpoint_path_is_read_in_the_workers_too(tiny_nvfp4, home):
    """`qerl.quantized_checkpoint=~/models/x` passed the driver's checks (which expand `~`) and then failed in the
    training worker, whose reader took `~` literally ("no such folder"), after Ray and vLLM had started."""
    shutil.copytree(tiny_nvfp4, home / "models" / "twin")
    reader = CheckpointReader("~/models/twin")
    assert reader.folder == home / "models" / "twin" and reader.format == FORMAT_CT


def test_an_adapter_saved_on_an_nvfp4_base_names_its_base(tiny_nvfp4, tmp_path):
    """peft records the base model's name in a saved adapter; from load_nvfp4_model it was None, so
    AutoPeftModelForCausalLM looked for a hub repository called "None"."""
    from verl_qerl.modeling import get_lora_model, load_nvfp4_model

    model = get_lora_model(load_nvfp4_model(tiny_nvfp4, dtype=torch.float32), r=4)
    model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(Path(tiny_nvfp4).resolve())


# --- the source's declared scale rule -------------------------------------------------------------------------------

def test_quantize_uses_the_sources_declared_scale_rule_and_refuses_another(tiny_bf16, tmp_path, capsys):
    """A BF16 source whose config.json declares ``{"quant_method": "qerl_nvfp4", "scale_rule": "fp32"}``: vLLM and
    load_nvfp4_model quantize it with fp32, while ``qerl-quantize SRC DST`` used its own default (bf16), so the
    "bit-identical to quantizing at load" folder held other bytes."""
    from verl_qerl.cli.quantize import main
    from verl_qerl.modeling import NVFP4Linear, load_nvfp4_model
    from verl_qerl.nvfp4.checkpoint import recorded_scale_rule

    src = tmp_path / "src"
    shutil.copytree(tiny_bf16, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "qerl_nvfp4", "scale_rule": "fp32"}
    (src / "config.json").write_text(json.dumps(cfg))

    capsys.readouterr()
    assert main([str(src), str(tmp_path / "q")]) == 0
    assert "scale rule fp32" in capsys.readouterr().out
    reader = CheckpointReader(tmp_path / "q")
    assert recorded_scale_rule(reader.config) == "fp32"
    model = load_nvfp4_model(src, dtype=torch.float32)  # what vLLM's quantize-at-load makes of src, too
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    assert len(layers) == 14
    for name, mod in layers:
        assert torch.equal(mod.dequantize_weight(torch.float32), reader.read_nvfp4(name).dequantize(torch.float32))

    assert main([str(src), str(tmp_path / "x"), "--scale-rule", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "config.json: quantization_config.scale_rule='fp32' but scale_rule='bf16' (--scale-rule)" in err, err
    assert not (tmp_path / "x").exists()
    assert quantize_checkpoint(src, tmp_path / "same", scale_rule="fp32").scale_rule == "fp32"


def assert_ct_readers_see_the_stored_layers(folder: Path) -> None:
    """compressed-tensors' own ignore matcher (what vLLM's stock loader and transformers apply) on the written
    ``quantization_config.ignore``: it takes every Linear stored dense as ignored and no NVFP4-stored one."""
    from compressed_tensors.utils.match import match_name

    reader = CheckpointReader(folder)
    ignore = reader.config["quantization_config"]["ignore"]
    nvfp4 = set(reader.nvfp4_modules())
    dense = [n.removesuffix(".weight") for n in reader.names()
             if n.endswith("proj.weight") or n == "lm_head.weight"]
    assert nvfp4 and dense
    for name in dense:
        assert any(match_name(name, p) for p in ignore), (name, ignore)
    for name in nvfp4:
        assert not any(match_name(name, p) for p in ignore), (name, ignore)


def test_quantize_writes_an_ignore_list_compressed_tensors_readers_match(tiny_bf16, tmp_path):
    """``--ignore down_proj`` (a dotted suffix to verl-qerl) was written verbatim into quantization_config.ignore;
    compressed-tensors, vLLM's stock loader and transformers match ignore entries exactly (or ``re:``), so they took
    the BF16 down_proj layers for NVFP4 ones (transformers left them random: NaN logits)."""
    quantize_checkpoint(tiny_bf16, tmp_path / "q", ignore=["down_proj"])
    assert_ct_readers_see_the_stored_layers(tmp_path / "q")
    assert sorted(CheckpointReader(tmp_path / "q").quant_config["ignore"]) == [
        "lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    quantize_checkpoint(tiny_bf16, tmp_path / "re", ignore=["re:.*self_attn.*"])
    assert_ct_readers_see_the_stored_layers(tmp_path / "re")
