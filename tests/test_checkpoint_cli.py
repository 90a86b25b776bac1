"""Checkpoint I/O and the ``qerl-quantize`` CLI on tiny local models."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from verl_qerl.checkpoint_conversion import DestinationError, quantize_checkpoint
from verl_qerl.nvfp4 import NVFP4FormatError, quantize
from verl_qerl.nvfp4.arch import fused_group
from verl_qerl.nvfp4.checkpoint import (
    FORMAT_BF16,
    FORMAT_CT,
    FORMAT_MODELOPT,
    CheckpointError,
    CheckpointReader,
)
from verl_qerl.testing.tiny import make_tiny_model

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def run_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "verl_qerl.cli.quantize", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_cli_output_loads_in_compressed_tensors_and_matches_our_dequant(tiny_bf16, tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    dst = tmp_path / "q"
    res = run_cli(str(tiny_bf16), str(dst))
    assert res.returncode == 0, res.stderr
    assert "14 Linear layers in NVFP4" in res.stdout
    reader = CheckpointReader(dst)
    assert reader.format == FORMAT_CT
    # the real compressed-tensors integration loads and decompresses it ...
    model = AutoModelForCausalLM.from_pretrained(
        dst, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.bfloat16
    )
    params = dict(model.named_parameters())
    modules = reader.nvfp4_modules()
    assert sorted(modules) == sorted(f"model.layers.{i}.{blk}.{p}" for i in range(2) for p in PROJ
                                     for blk in (["self_attn"] if p[0] in "qkvo" else ["mlp"]))
    for module in modules:  # ... to exactly our dequantized weights
        ours = reader.read_nvfp4(module).dequantize(torch.bfloat16)
        assert torch.equal(params[f"{module}.weight"].detach(), ours), module
    # lm_head and embeddings kept in bf16, identical to the source
    src = _all_tensors(tiny_bf16)
    out = _all_tensors(dst)
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], src[name])
    # tokenizer and generation config copied; quantization_config present; ignore names lm_head
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (dst / f).read_bytes() == (tiny_bf16 / f).read_bytes(), f
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized" and qc["ignore"] == ["lm_head"]
    assert oct(dst.stat().st_mode & 0o777) != oct(0o700)


def test_fused_layers_share_the_global_scale(tiny_nvfp4):
    reader = CheckpointReader(tiny_nvfp4)
    by_group: dict[str, set[float]] = {}
    for module in reader.nvfp4_modules():
        gs = float(reader.read_nvfp4(module).global_scale)
        by_group.setdefault(fused_group(module), set()).add(gs)
    assert any(k.endswith("qkv_proj") for k in by_group) and any(k.endswith("gate_up_proj") for k in by_group)
    assert all(len(v) == 1 for v in by_group.values()), by_group


def test_quantized_equals_in_memory_quantize(tiny_bf16, tiny_nvfp4):
    src = _all_tensors(tiny_bf16)
    reader = CheckpointReader(tiny_nvfp4)
    for module in reader.nvfp4_modules():
        stored = reader.read_nvfp4(module)
        again = quantize(src[f"{module}.weight"], stored.global_scale)
        assert torch.equal(again.packed, stored.packed)
        assert torch.equal(again.scale.view(torch.uint8), stored.scale.view(torch.uint8))


def test_scale_rule_option_is_applied_and_recorded(tiny_bf16, tiny_nvfp4, tmp_path):
    """``--scale-rule fp32`` writes the fp32 rule's bytes; the default is bf16; config.json says which."""
    from verl_qerl.nvfp4 import fused_global_scale
    from verl_qerl.nvfp4.checkpoint import SCALE_RULE_KEY, recorded_scale_rule

    dst = tmp_path / "fp32"
    res = run_cli(str(tiny_bf16), str(dst), "--scale-rule", "fp32")
    assert res.returncode == 0, res.stderr
    assert "scale rule fp32" in res.stdout
    src = _all_tensors(tiny_bf16)
    readers = {"fp32": CheckpointReader(dst), "bf16": CheckpointReader(tiny_nvfp4)}
    for rule, reader in readers.items():
        assert recorded_scale_rule(reader.config) == reader.config[SCALE_RULE_KEY] == rule
        groups: dict[str, list[str]] = {}
        for module in reader.nvfp4_modules():
            groups.setdefault(fused_group(module), []).append(module)
        for members in groups.values():
            gs = fused_global_scale([src[f"{m}.weight"] for m in members], rule=rule)
            for m in members:
                stored, want = reader.read_nvfp4(m), quantize(src[f"{m}.weight"], gs, rule=rule)
                assert torch.equal(stored.global_scale, want.global_scale), (rule, m)
                assert torch.equal(stored.packed, want.packed), (rule, m)
                assert torch.equal(stored.scale.view(torch.uint8), want.scale.view(torch.uint8)), (rule, m)
    gs = {r: [float(rd.read_nvfp4(m).global_scale) for m in rd.nvfp4_modules()] for r, rd in readers.items()}
    assert gs["fp32"] != gs["bf16"]
    bad = run_cli(str(tiny_bf16), str(tmp_path / "x"), "--scale-rule", "ct019")
    assert bad.returncode == 2 and "invalid choice: 'ct019'" in bad.stderr and not (tmp_path / "x").exists()


def test_multi_shard_source_and_ignore_patterns(tmp_path):
    src = make_tiny_model(tmp_path / "src", arch="llama", num_hidden_layers=3)
    # re-shard the single file into three shards + index, as big hub checkpoints are
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(3):
        part = {n: tensors[n] for n in names[i::3]}
        save_file(part, src / f"model-0000{i + 1}-of-00003.safetensors", metadata={"format": "pt"})
        weight_map.update({n: f"model-0000{i + 1}-of-00003.safetensors" for n in part})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    dst = tmp_path / "dst"
    report = quantize_checkpoint(src, dst, ignore=["down_proj", "re:model\\.layers\\.2\\..*"])
    reader = CheckpointReader(dst)
    assert len(reader.shards) == 3 and (dst / "model.safetensors.index.json").is_file()
    mods = set(reader.nvfp4_modules())
    assert not any(m.endswith("down_proj") or m.startswith("model.layers.2.") for m in mods)
    assert len(mods) == len(report.quantized) == 2 * 6
    assert reader.get("model.layers.2.self_attn.q_proj.weight").dtype == torch.bfloat16
    # fused groups spanning shards still share one scale
    gs = {float(reader.read_nvfp4(f"model.layers.0.self_attn.{p}").global_scale) for p in ("q_proj", "k_proj",
                                                                                               "v_proj")}
    assert len(gs) == 1


def test_refuses_to_overwrite_and_force_replaces(tiny_bf16, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    keep = dst / "precious.txt"
    keep.write_text("mine")
    res = run_cli(str(tiny_bf16), str(dst))
    assert res.returncode == 2 and "exists and is not empty" in res.stderr and "--force" in res.stderr
    assert keep.read_text() == "mine" and sorted(p.name for p in dst.iterdir()) == ["precious.txt"]
    res = run_cli(str(tiny_bf16), str(dst), "--force")
    assert res.returncode == 0, res.stderr
    assert not keep.exists() and CheckpointReader(dst).format == FORMAT_CT
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".dst")]  # no temp folders left
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli(str(tiny_bf16), str(empty)).returncode == 0


def test_failure_midway_writes_nothing(tiny_bf16, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_bf16, src)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    dst = tmp_path / "dst"
    res = run_cli(str(src), str(dst))
    assert res.returncode == 2
    assert "model.layers.1.mlp.up_proj.weight: contains 1 NaN/Inf" in res.stderr
    assert not dst.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_bad_sources_are_named(tiny_bf16, tiny_nvfp4, tmp_path):
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(tiny_nvfp4, tmp_path / "x")
    with pytest.raises(CheckpointError, match="config.json"):
        quantize_checkpoint(tmp_path, tmp_path / "y")
    # unsupported architecture
    odd = tmp_path / "odd"
    shutil.copytree(tiny_bf16, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="model_type='gpt2' is not supported"):
        quantize_checkpoint(odd, tmp_path / "z")
    # pytorch .bin weights only
    binonly = tmp_path / "bin"
    binonly.mkdir()
    shutil.copy(tiny_bf16 / "config.json", binonly)
    torch.save({}, binonly / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="convert to safetensors"):
        quantize_checkpoint(binonly, tmp_path / "w")


def _rewrite(folder: Path, fn) -> None:
    tensors = load_file(folder / "model.safetensors")
    fn(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_reader_errors_name_the_tensor(tiny_nvfp4, tmp_path):
    mod = "model.layers.0.self_attn.o_proj"
    missing = tmp_path / "missing"
    shutil.copytree(tiny_nvfp4, missing)
    _rewrite(missing, lambda t: t.pop(f"{mod}.weight_scale"))
    with pytest.raises(CheckpointError, match=rf"lacks tensor '{mod}\.weight_scale'"):
        CheckpointReader(missing).read_nvfp4(mod)

    misshaped = tmp_path / "misshaped"
    shutil.copytree(tiny_nvfp4, misshaped)
    _rewrite(misshaped, lambda t: t.__setitem__(f"{mod}.weight_scale", t[f"{mod}.weight_scale"][:, :4].contiguous()))
    with pytest.raises(NVFP4FormatError, match=rf"{mod}\.weight_scale: shape \(128, 4\) does not fit"):
        CheckpointReader(misshaped).read_nvfp4(mod)

    group32 = tmp_path / "group32"
    shutil.copytree(tiny_nvfp4, group32)
    cfg = json.loads((group32 / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32
    (group32 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="group_size=32; NVFP4 needs 16"):
        CheckpointReader(group32)

    reader = CheckpointReader(tiny_nvfp4)
    with pytest.raises(NVFP4FormatError, match="model expects"):
        from verl_qerl.nvfp4.checkpoint import validate_nvfp4

        q = reader.read_nvfp4(mod)
        validate_nvfp4(mod, q.packed, q.scale, q.global_scale, expected_shape=(128, 256))
    with pytest.raises(CheckpointError, match="'nope.weight' is missing"):
        reader.get("nope.weight")


@pytest.mark.parametrize("where", ["config", "hf_quant_config"])
def test_modelopt_layout_reads_to_the_same_weights(tiny_nvfp4, tmp_path, where):
    ct = CheckpointReader(tiny_nvfp4)
    out = {}
    for name in ct.names():
        if not name.endswith(("weight_packed", "weight_scale", "weight_global_scale")):
            out[name] = ct.get(name)
    for module in ct.nvfp4_modules():
        q = ct.read_nvfp4(module)
        out[f"{module}.weight"] = q.packed
        out[f"{module}.weight_scale"] = q.scale
        out[f"{module}.weight_scale_2"] = torch.reciprocal(q.global_scale).reshape(())  # a multiplier
        out[f"{module}.input_scale"] = torch.ones(())  # W4A4 checkpoints carry these; ignored for W4A16
    mo = tmp_path / "modelopt"
    mo.mkdir()
    save_file(out, mo / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tiny_nvfp4 / "config.json").read_text())
    del cfg["quantization_config"]
    modelopt_qc = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    if where == "config":
        cfg["quantization_config"] = {"quant_method": "modelopt", **modelopt_qc}
    else:
        (mo / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
                                                              "quantization": modelopt_qc}))
    (mo / "config.json").write_text(json.dumps(cfg))
    reader = CheckpointReader(mo)
    assert reader.format == FORMAT_MODELOPT
    assert sorted(reader.nvfp4_modules()) == sorted(ct.nvfp4_modules())
    for module in ct.nvfp4_modules():
        a = ct.read_nvfp4(module).dequantize(torch.float32)
        b = reader.read_nvfp4(module).dequantize(torch.float32)
        torch.testing.assert_close(b, a, rtol=2e-7, atol=0)  # 1/(1/g) may differ from g in the last bit


def test_reader_on_bf16(tiny_bf16):
    reader = CheckpointReader(tiny_bf16)
    assert reader.format == FORMAT_BF16 and reader.nvfp4_modules() == []
    dtype, shape = reader.metadata("model.embed_tokens.weight")
    assert dtype == torch.bfloat16 and shape == (512, 128)


def _write_big_sharded_model(src: Path, h: int = 1024, i: int = 4096, layers: int = 8) -> int:
    src.mkdir()
    cfg = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=h, intermediate_size=i,
               num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8, vocab_size=256,
               tie_word_embeddings=False, torch_dtype="bfloat16", max_position_embeddings=512)
    (src / "config.json").write_text(json.dumps(cfg))
    weight_map, total = {}, 0
    gen = torch.Generator().manual_seed(0)
    for layer in range(layers):
        t: dict[str, torch.Tensor] = {}
        p = f"model.layers.{layer}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{n}.weight"] = torch.randn(h, h, generator=gen).to(torch.bfloat16)
        for n in ("q_proj", "k_proj", "v_proj"):
            t[p + f"self_attn.{n}.bias"] = torch.zeros(h, dtype=torch.bfloat16)
        t[p + "mlp.gate_proj.weight"] = torch.randn(i, h, generator=gen).to(torch.bfloat16)
        t[p + "mlp.up_proj.weight"] = torch.randn(i, h, generator=gen).to(torch.bfloat16)
        t[p + "mlp.down_proj.weight"] = torch.randn(h, i, generator=gen).to(torch.bfloat16)
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        if layer == 0:
            t["model.embed_tokens.weight"] = torch.randn(256, h, generator=gen).to(torch.bfloat16)
            t["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
            t["lm_head.weight"] = torch.randn(256, h, generator=gen).to(torch.bfloat16)
        name = f"model-{layer:05d}.safetensors"
        save_file(t, src / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in t})
        total += sum(v.numel() * 2 for v in t.values())
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


@pytest.mark.slow
def test_peak_memory_is_about_one_shard_not_the_model(tmp_path):
    """Convert a ~220 MB 8-shard checkpoint in a fresh process; its peak RSS growth must stay far below that."""
    model_bytes = _write_big_sharded_model(tmp_path / "src")
    script = r"""
import json, resource, sys
import verl_qerl.checkpoint_conversion as c
cfg = json.load(open(sys.argv[1] + "/config.json"))
c.linear_module_names(cfg)  # import transformers and build the meta model before measuring
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
c.quantize_checkpoint(sys.argv[1], sys.argv[2])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"growth": peak - base}))
"""
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path / "src"), str(tmp_path / "dst")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    growth = json.loads(res.stdout.strip().splitlines()[-1])["growth"]
    shard = model_bytes / 8
    # one bf16 shard in (~27 MB), its quantized copy out, fp32 working copies of one 8 MB weight: a few
    # shards' worth at most, far below the model (a whole-model load would grow by >= model_bytes)
    assert growth < 4 * shard, (growth, shard, model_bytes)
    assert growth < 0.5 * model_bytes


# ------------------------------------------------------------------------------------------------
# Bad input: nothing the user had is lost, no half-written output, errors name the file or option


def _tree(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder`` (relative path -> file bytes, or the target of a symlink), symlinks not followed."""
    out: dict[str, bytes | str] = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            rel = str(path.relative_to(folder))
            if path.is_symlink():
                out[rel] = f"-> {os.readlink(path)}"
            elif path.is_file():
                out[rel] = path.read_bytes()
            else:
                out[rel] = "<dir>"
    return out


def test_force_never_replaces_a_folder_holding_the_source(tiny_bf16, tmp_path):
    root = tmp_path / "models"
    src = root / "bf16"
    shutil.copytree(tiny_bf16, src)
    (root / "other").mkdir()
    (root / "other" / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(root)
    before = _tree(tmp_path)
    res = run_cli(str(src), str(root), "--force")  # DST = SRC's parent: must refuse, not delete both
    assert res.returncode == 2, (res.stdout, res.stderr[-2000:])
    assert "contains the source" in res.stderr and str(root) in res.stderr and "Traceback" not in res.stderr
    assert _tree(tmp_path) == before
    for dst, why in [(tmp_path, "contains the source"), (tmp_path / "link", "contains the source"),
                     (src / "q", "inside the source"), (src / "a" / "b", "inside the source"),
                     (tmp_path / "link" / "bf16" / "q", "inside the source"), (src, "is the source")]:
        with pytest.raises(DestinationError, match=why):
            quantize_checkpoint(src, dst, force=True)
        assert _tree(tmp_path) == before, dst


def test_force_never_replaces_the_target_of_a_linked_source_file(tiny_bf16, tmp_path):
    """A source whose shard is a symlink into another folder (a Hugging Face cache: snapshots/<rev>/x ->
    blobs/<hash>): replacing that folder with --force would delete the source's weights through the link."""
    raw, src = tmp_path / "blobs" / "raw", tmp_path / "snapshot"
    shutil.copytree(tiny_bf16, src)
    raw.mkdir(parents=True)
    for shard in sorted(src.glob("*.safetensors")):
        shard.rename(raw / shard.name)
        shard.symlink_to(raw / shard.name)
    before = _tree(tmp_path)
    res = run_cli(str(src), str(raw), "--force")
    assert res.returncode == 2, (res.stdout, res.stderr[-2000:])
    assert "the target of the source's link" in res.stderr and "Traceback" not in res.stderr
    assert _tree(tmp_path) == before
    with pytest.raises(DestinationError, match="replacing it would delete it"):
        quantize_checkpoint(src, tmp_path / "blobs", force=True)  # a folder above the link's target too
    assert quantize_checkpoint(src, tmp_path / "out").quantized  # the linked source itself converts as usual


def test_force_never_replaces_a_file(tiny_bf16, tmp_path):
    dst = tmp_path / "out"
    dst.write_text("mine")
    (tmp_path / "out-link").symlink_to(dst)
    before = _tree(tmp_path)
    res = run_cli(str(tiny_bf16), str(dst), "--force")
    assert res.returncode == 2, (res.stdout, res.stderr[-2000:])
    assert "is not a folder" in res.stderr and str(dst) in res.stderr and "Traceback" not in res.stderr
    assert _tree(tmp_path) == before  # the file kept, no DST.old-<pid>, no temp folder
    for d in (dst, tmp_path / "out-link", dst / "sub"):
        with pytest.raises(DestinationError, match="is not a folder"):
            quantize_checkpoint(tiny_bf16, d, force=True)
    assert _tree(tmp_path) == before


def _corrupt(src: Path, how: str) -> None:
    shard = src / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if how == "truncated" else bytes(range(256)) * 8)


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_a_corrupt_shard_is_named(tiny_bf16, tiny_nvfp4, tmp_path, how):
    from verl_qerl.modeling import load_nvfp4_model

    src = tmp_path / "src"
    shutil.copytree(tiny_bf16, src)
    _corrupt(src, how)
    res = run_cli(str(src), str(tmp_path / "dst"))
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"{src / 'model.safetensors'}: not a readable safetensors file" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    q = tmp_path / "q"
    shutil.copytree(tiny_nvfp4, q)
    _corrupt(q, how)
    with pytest.raises(CheckpointError, match=f"{q / 'model.safetensors'}: not a readable safetensors file"):
        load_nvfp4_model(q)


@pytest.mark.parametrize("text, what", [("{\"model_type\": \"qwen2\",", "not valid JSON"),
                                        ("[1, 2]", "not a JSON object"), ("", "not valid JSON")])
def test_a_bad_config_json_is_named(tiny_bf16, tiny_nvfp4, tmp_path, text, what):
    from verl_qerl.modeling import load_nvfp4_model

    src = tmp_path / "src"
    shutil.copytree(tiny_bf16, src)
    (src / "config.json").write_text(text)
    res = run_cli(str(src), str(tmp_path / "dst"))
    assert res.returncode == 2 and f"{src / 'config.json'}: {what}" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    q = tmp_path / "q"
    shutil.copytree(tiny_nvfp4, q)
    (q / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=f"{q / 'config.json'}: {what}"):
        load_nvfp4_model(q)
    (q / "config.json").write_bytes((tiny_nvfp4 / "config.json").read_bytes())
    (q / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match=f"{q / 'model.safetensors.index.json'}: {what}"):
        CheckpointReader(q)


def _unwritable_parent(tmp_path: Path, kind: str) -> Path:
    """A DST whose parent cannot be written to."""
    if kind == "read-only folder":
        if os.geteuid() == 0:
            pytest.skip("root ignores permission bits (the 'sysfs' case covers root)")
        parent = tmp_path / "ro"
        parent.mkdir()
        parent.chmod(0o555)
        return parent / "q"
    if kind == "file as parent":
        (tmp_path / "plain").write_text("x")
        return tmp_path / "plain" / "sub" / "q"
    if not Path("/sys/kernel").is_dir():
        pytest.skip("no sysfs here")
    return Path("/sys/qerl-test-unwritable/q")  # sysfs refuses mkdir even to root


@pytest.mark.parametrize("kind", ["read-only folder", "file as parent", "sysfs"])
def test_an_unwritable_destination_fails_before_any_weight_is_read(tiny_bf16, tmp_path, kind, monkeypatch):
    dst = _unwritable_parent(tmp_path, kind)
    before = _tree(tmp_path)
    read = []
    monkeypatch.setattr(CheckpointReader, "get", lambda self, name: read.append(name))
    monkeypatch.setattr(CheckpointReader, "iter_shard", lambda self, shard: read.append(shard) or iter(()))
    with pytest.raises(DestinationError, match="cannot write") as err:
        quantize_checkpoint(tiny_bf16, dst)
    assert read == [], "weights were read before the destination was checked"
    assert ".tmp-" not in str(err.value) and _tree(tmp_path) == before
    assert not dst.exists()


def test_cli_names_an_unwritable_destination(tiny_bf16, tmp_path):
    (tmp_path / "plain").write_text("x")
    res = run_cli(str(tiny_bf16), str(tmp_path / "plain" / "q"))
    assert res.returncode == 2 and "cannot write" in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]


def test_bad_ignore_regex_is_named(tiny_bf16, tmp_path):
    res = run_cli(str(tiny_bf16), str(tmp_path / "dst"), "--ignore", "re:((")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--ignore: 're:((' is not a valid regular expression" in res.stderr
    assert "Traceback" not in res.stderr and list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"ignore: 're:\(\(' is not a valid regular expression"):
        quantize_checkpoint(tiny_bf16, tmp_path / "dst", ignore=["re:(("])
    assert list(tmp_path.iterdir()) == []


def test_ignore_patterns_that_match_nothing_or_split_a_fused_layer_are_refused(tiny_bf16, tmp_path):
    """A misspelled --ignore quantized the layers it meant without a word; q_proj alone wrote a checkpoint that vLLM
    refused at load (q/k/v are one fused layer there). Both are refused before anything is written."""
    for args, why in ((["--ignore", "donw_proj"], "'donw_proj' matches no Linear layer of the model"),
                      (["--ignore", "q_proj"], "keeps model.layers.0.self_attn.q_proj in BF16 but not "
                                               "model.layers.0.self_attn.k_proj: q_proj/k_proj/v_proj are one fused"),
                      (["--ignore", "re:.*layers\\.1\\.mlp\\.up_proj"], "gate_proj/up_proj are one fused layer")):
        res = run_cli(str(tiny_bf16), str(tmp_path / "dst"), *args)
        assert res.returncode == 2, (args, res.stderr[-2000:])
        assert why in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert list(tmp_path.iterdir()) == []
    report = quantize_checkpoint(tiny_bf16, tmp_path / "dst", ignore=["q_proj", "k_proj", "v_proj"])
    assert report.quantized and not any(m.endswith(("q_proj", "k_proj", "v_proj")) for m in report.quantized)


def test_a_missing_source_or_a_file_as_source_is_named(tiny_bf16, tmp_path):
    res = run_cli(str(tmp_path / "nope"), str(tmp_path / "dst"))
    assert res.returncode == 2 and "nope: no such folder" in res.stderr and "Traceback" not in res.stderr
    res = run_cli(str(tiny_bf16 / "config.json"), str(tmp_path / "dst"))
    assert res.returncode == 2 and "config.json: not a directory" in res.stderr and "Traceback" not in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_weight_whose_shape_disagrees_with_config_json_is_refused(tiny_bf16, tmp_path):
    """Before, a transposed (or wrong-size) Linear weight was quantized and written; the error came only at load."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(tiny_bf16, src)
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].t().contiguous()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    res = run_cli(str(src), str(tmp_path / "dst"))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert f"tensor {name} is {list(tensors[name].shape)} but config.json's architecture has" in res.stderr
    assert not (tmp_path / "dst").exists()


def test_a_stale_shard_index_is_named(tiny_bf16, tmp_path):
    """An index that disagrees with the shards' headers (a tensor moved, one left out) is refused naming the index,
    not read as a damaged shard or lost: before, one case was an AssertionError, the other advised re-downloading an
    intact shard."""
    import json

    from safetensors.torch import load_file, save_file

    from verl_qerl.nvfp4.checkpoint import CheckpointError, CheckpointReader

    src = tmp_path / "src"
    shutil.copytree(tiny_bf16, src)
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    half = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, part in half.items():
        save_file({n: tensors[n] for n in part}, src / shard, metadata={"format": "pt"})
    good = {n: shard for shard, part in half.items() for n in part}
    index = src / "model.safetensors.index.json"

    def write_index(weight_map: dict) -> None:
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    write_index(good)
    assert sorted(CheckpointReader(src).names()) == names
    moved = names[0]
    write_index({**good, moved: "model-00002-of-00002.safetensors"})
    with pytest.raises(CheckpointError, match=rf"lists '{re.escape(moved)}' in 'model-00002-of-00002.safetensors', "
                                              r"but it is in 'model-00001-of-00002.safetensors': the index is stale"):
        CheckpointReader(src)
    write_index({n: s for n, s in good.items() if n != moved})
    res = run_cli(str(src), str(tmp_path / "dst"))
    assert res.returncode == 2 and "does not list 1 tensor(s)" in res.stderr and "Traceback" not in res.stderr, \
        res.stderr[-2000:]


def test_a_full_disk_is_an_error_line_and_leaves_nothing(tiny_bf16, tmp_path):
    """A write error inside safetensors (its own error type, not OSError) reaches the CLI as an error line naming
    the file, and the temporary folder is removed (ulimit -f stands in for a full disk)."""
    dst = tmp_path / "dst"
    cmd = f"ulimit -f 20; exec {shlex.quote(sys.executable)} -m verl_qerl.cli.quantize {shlex.quote(str(tiny_bf16))} " \
          f"{shlex.quote(str(dst))}"
    res = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, (res.returncode, res.stderr[-2000:])
    assert "qerl-quantize: error:" in res.stderr and "cannot write" in res.stderr and "Traceback" not in res.stderr
    assert list(tmp_path.iterdir()) == []


_PAUSING_CLI = r"""
import shutil, sys, time
from pathlib import Path
import verl_qerl.checkpoint_conversion as conversion
from verl_qerl.cli.quantize import main

where, marker = sys.argv[1], Path(sys.argv[2])
write_shard, remove_tree = conversion.write_safetensors, shutil.rmtree

def save_file_then_wait(tensors, path, *args, **kwargs):
    write_shard(tensors, path, *args, **kwargs)  # the temp folder now holds a written shard
    marker.write_text(str(path))
    time.sleep(120)

def rmtree_after_a_pause(path, *args, **kwargs):
    if ".old-" in str(path):  # DST was swapped for the new output; the old one is being removed
        marker.write_text(str(path))
        time.sleep(3)
    return remove_tree(path, *args, **kwargs)

if where == "write":
    conversion.write_safetensors = save_file_then_wait
else:
    shutil.rmtree = rmtree_after_a_pause
sys.exit(main(sys.argv[3:]))
"""


def _sigterm_at(where: str, marker: Path, *args: str) -> tuple[int, str]:
    """Run the CLI, send SIGTERM once it reaches ``where`` (the marker appears); its exit status and stderr."""
    from verl_qerl.testing.procs import signal_at_marker

    return signal_at_marker([sys.executable, "-c", _PAUSING_CLI, where, str(marker), *args], marker)


@pytest.mark.parametrize("force", [False, True])
def test_sigterm_mid_write_leaves_no_temp_folder(tiny_bf16, tmp_path, force):
    src = tmp_path / "src"
    shutil.copytree(tiny_bf16, src)
    dst = tmp_path / "dst"
    if force:  # an existing DST must survive an interrupted --force run untouched
        dst.mkdir()
        (dst / "old.txt").write_text("previous output")
    before = _tree(tmp_path)
    marker = tmp_path.parent / f"{tmp_path.name}-written"
    rc, err = _sigterm_at("write", marker, str(src), str(dst), *(["--force"] if force else []))
    assert ".tmp-" in marker.read_text()  # it was writing into the hidden temp folder
    assert rc == 128 + signal.SIGTERM and "stopped by SIGTERM" in err, (rc, err[-2000:])
    assert _tree(tmp_path) == before, sorted(_tree(tmp_path))  # no .tmp-* folder, SRC and DST as they were


def test_sigterm_while_dst_is_swapped_waits_for_the_swap(tiny_bf16, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("previous output")
    marker = tmp_path.parent / f"{tmp_path.name}-swapping"
    rc, err = _sigterm_at("swap", marker, str(tiny_bf16), str(dst), "--force")
    assert ".old-" in marker.read_text()
    assert rc == 128 + signal.SIGTERM, (rc, err[-2000:])
    # the swap finished before the signal was acted on: DST is the complete new output, the old one is gone
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]
    assert CheckpointReader(dst).format == FORMAT_CT and not (dst / "old.txt").exists()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])])
def test_device_option_writes_the_same_bytes(tiny_bf16, tiny_nvfp4, tmp_path, device):
    """``--device``: weights quantized there, the files byte-identical to the default CPU run's."""
    res = run_cli(str(tiny_bf16), str(tmp_path / "q"), "--device", device)
    assert res.returncode == 0, res.stderr[-2000:]
    want, got = _all_tensors(tiny_nvfp4), _all_tensors(tmp_path / "q")
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k].view(torch.uint8) if got[k].dtype.itemsize == 1 else got[k],
                           v.view(torch.uint8) if v.dtype.itemsize == 1 else v), k


def test_a_device_that_cannot_hold_tensors_is_named_before_anything_is_written(tiny_bf16, tmp_path):
    res = run_cli(str(tiny_bf16), str(tmp_path / "q"), "--device", "nonsense:7")
    assert res.returncode == 2 and "device='nonsense:7'" in res.stderr and "Traceback" not in res.stderr, \
        res.stderr[-2000:]
    assert not (tmp_path / "q").exists()
