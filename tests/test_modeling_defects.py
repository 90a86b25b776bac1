"""Reproduced defects of the modeling entry points (LoRA targets, ``~`` paths, dtype arguments, NF4, NVFP4Linear
construction, fused target groups) and of ``qerl-pretrained``'s DONE marker; each test failed before its fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from verl_qerl.nvfp4 import NVFP4FormatError, NVFP4Weight, quantize

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _qwen(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A random in-memory Qwen2 causal LM (2 layers, K multiples of 16), biases non-zero."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.05)
    return model.to(dtype).eval()


def _lora_leaves(model: nn.Module) -> list[str]:
    from peft.tuners.lora import LoraLayer

    return sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, LoraLayer)})


def _layer_types(model: nn.Module) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules() if n.endswith("_proj") or n.endswith("lm_head")}


# ------------------------------------------------------------------------------------------------
# 1. "all-linear" must not silently skip the NVFP4 layers


def test_nvfp4_lora_config_refuses_all_linear_and_names_the_way_that_resolves_it():
    from peft import LoraConfig

    from verl_qerl.modeling import nvfp4_lora_config
    from verl_qerl.modeling.lora import register_nvfp4_lora

    for spelled in ("all-linear", "ALL-LINEAR"):
        with pytest.raises(ValueError, match=r"all-linear.*get_lora_model.*resolve_target_modules\(model"):
            nvfp4_lora_config(r=4, lora_alpha=8, target_modules=spelled)
    with pytest.raises(ValueError, match="resolve_target_modules"):
        register_nvfp4_lora(LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    assert nvfp4_lora_config(r=4, target_modules=["q_proj"]).target_modules == {"q_proj"}


def test_all_linear_inside_peft_custom_modules_puts_lora_on_the_nvfp4_layers():
    from peft import LoraConfig, get_peft_model

    from verl_qerl.modeling import get_lora_model, quantize_model
    from verl_qerl.modeling.lora import peft_custom_modules

    want = sorted(PROJ)
    mixed = quantize_model(_qwen(), "nvfp4", ignore=["lm_head", "down_proj"])  # down_proj stays nn.Linear
    with peft_custom_modules():
        pm = get_peft_model(mixed, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    assert _lora_leaves(pm) == want
    assert _lora_leaves(get_lora_model(quantize_model(_qwen(), "nvfp4", ignore=["lm_head", "down_proj"]), r=4,
                                       target_modules="all-linear")) == want
    # every decoder Linear in NVFP4: peft alone found no layer at all (NoMatchingPeftModuleError)
    with peft_custom_modules():
        pm = get_peft_model(quantize_model(_qwen(), "nvfp4"), LoraConfig(r=4, lora_alpha=8,
                                                                         target_modules="all-linear"))
    assert _lora_leaves(pm) == want
    # the patch lasts only as long as the block
    import peft.tuners.tuners_utils as tu

    assert not hasattr(tu._maybe_include_all_linear_layers, "_qerl_original")


# ------------------------------------------------------------------------------------------------
# 2. load_nvfp4_model("~/...") keeps generation_config.json


def test_load_nvfp4_model_reads_generation_config_under_a_tilde_path(tmp_path, monkeypatch):
    from transformers import GenerationConfig

    from verl_qerl.modeling import load_nvfp4_model

    monkeypatch.setenv("HOME", str(tmp_path))
    model = _qwen(dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(max_new_tokens=7, temperature=0.3, do_sample=True, eos_token_id=[5, 6])
    model.save_pretrained(tmp_path / "ckpt")
    loaded = load_nvfp4_model("~/ckpt")
    assert loaded.generation_config.max_new_tokens == 7
    assert loaded.generation_config.eos_token_id == [5, 6]


# ------------------------------------------------------------------------------------------------
# 3. export_merged("~/merged", tokenizer="~/tok") writes under $HOME


def test_export_merged_expands_tilde_for_out_dir_and_tokenizer(tiny_bf16, tmp_path, monkeypatch):
    from verl_qerl.modeling import export_merged, get_lora_model, quantize_model

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    (home / "tok").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(Path(tiny_bf16) / name, home / "tok" / name)
    pm = get_lora_model(quantize_model(_qwen(), "nvfp4"), r=4, lora_alpha=8)
    out = export_merged(pm, "~/merged", tokenizer="~/tok")
    assert Path(out) == home / "merged" and (home / "merged" / "config.json").is_file()
    assert (home / "merged" / "tokenizer.json").is_file()
    assert not (cwd / "~").exists()


# ------------------------------------------------------------------------------------------------
# 4. qerl-pretrained: a DONE file that is JSON but not an object is someone else's


@pytest.mark.parametrize("content", ["1700000000", '["x"]', '"done"', "null"])
def test_a_foreign_done_marker_is_not_a_finished_folder(tmp_path, monkeypatch, capsys, content):
    from verl_qerl import pretrained
    from verl_qerl.cli.pretrained import main
    from verl_qerl.pretrained import PretrainedModel

    model = PretrainedModel(key="tiny-none", title="Tiny test model without parts", parts=(), sha256="0" * 64,
                            architecture="qwen2", general_name="Tiny", gguf_name="tiny.gguf")
    monkeypatch.setitem(pretrained.MODELS, model.key, model)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / pretrained.DONE_MARKER).write_text(content + "\n")
    (foreign / "config.json").write_text("{}")
    assert pretrained.read_done(foreign) is None
    assert not pretrained.is_prepared(foreign, model) and not pretrained.is_tokenizer_prepared(foreign, model)
    for extra in ([], ["--tokenizer-only"]):
        assert main(["tiny-none", "--out", str(foreign), "--no-progress", *extra]) == 2
        assert "not a finished" in capsys.readouterr().err
    assert (foreign / pretrained.DONE_MARKER).read_text() == content + "\n"


# ------------------------------------------------------------------------------------------------
# 5. mode="nf4": a refused conversion leaves the model as it was


def _nf4_refused_unchanged(model: nn.Module, match: str) -> None:
    from verl_qerl.modeling import ModelConversionError, quantize_model

    before = {n: m for n, m in model.named_modules()}
    with pytest.raises(ModelConversionError, match=match):
        quantize_model(model, "nf4")
    after = {n: m for n, m in model.named_modules()}
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert not getattr(model, "is_loaded_in_4bit", False)


def test_nf4_checks_every_layer_before_replacing_any():
    pytest.importorskip("bitsandbytes")
    model = _qwen(dtype=torch.bfloat16)
    model.model.layers[1].mlp.down_proj.weight = nn.Parameter(torch.empty(64, 128, device="meta",
                                                                          dtype=torch.bfloat16))
    _nf4_refused_unchanged(model, r"model\.layers\.1\.mlp\.down_proj\.weight.*meta")
    model = _qwen(dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    _nf4_refused_unchanged(model, r"model\.layers\.1\.mlp\.down_proj\.weight.*NaN")
    model = _qwen(dtype=torch.bfloat16)
    model.model.layers[1].mlp.up_proj.weight = nn.Parameter(torch.zeros(128, 64, dtype=torch.int32),
                                                            requires_grad=False)
    _nf4_refused_unchanged(model, r"model\.layers\.1\.mlp\.up_proj\.weight.*int32")


def test_nf4_backend_failure_comes_before_any_layer_is_replaced(monkeypatch):
    """A bitsandbytes that cannot quantize on the weights' device fails on the first layer: nothing replaced yet. (A
    failure further on is not rolled back: keeping the dense layers for it would double the peak memory.)"""
    bnb = pytest.importorskip("bitsandbytes")
    from verl_qerl.modeling import NF4UnavailableError, quantize_model

    model = _qwen(dtype=torch.bfloat16)
    before = {n: m for n, m in model.named_modules()}

    def failing(*args, **kwargs):  # as on a device bitsandbytes has no backend for
        raise RuntimeError("no backend")

    monkeypatch.setattr(bnb.nn, "Params4bit", failing)
    with pytest.raises(NF4UnavailableError, match="no backend"):
        quantize_model(model, "nf4")
    after = {n: m for n, m in model.named_modules()}
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert not getattr(model, "is_loaded_in_4bit", False)


# ------------------------------------------------------------------------------------------------
# 6. dtype arguments: a string name where a torch.dtype is expected, and the reverse


def test_quantize_and_load_take_a_dtype_name_and_name_a_bad_dtype(tmp_path):
    from verl_qerl.modeling import ModelConversionError, NVFP4Linear, load_nvfp4_model, quantize_model

    model = quantize_model(_qwen(), "nvfp4", dtype="bfloat16")
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, NVFP4Linear) and q.compute_dtype == torch.bfloat16
    assert quantize_model(_qwen(), "nvfp4", dtype="torch.float16").model.layers[0].mlp.up_proj.compute_dtype == (
        torch.float16)
    for bad in ("bf17", "int8", 16, "auto"):
        with pytest.raises(ModelConversionError, match=r"quantize_model: dtype="):
            quantize_model(_qwen(), "nvfp4", dtype=bad)
    _qwen().save_pretrained(tmp_path / "ckpt")
    loaded = load_nvfp4_model(tmp_path / "ckpt", dtype="float32")
    assert loaded.model.embed_tokens.weight.dtype == torch.float32
    assert loaded.model.layers[0].self_attn.q_proj.compute_dtype == torch.float32
    for bad in (torch.int32, "bfloat"):
        with pytest.raises(ModelConversionError, match=r"load_nvfp4_model: dtype="):
            load_nvfp4_model(tmp_path / "ckpt", dtype=bad)


def test_export_merged_takes_a_torch_dtype_and_names_a_bad_one(tmp_path):
    from safetensors.torch import load_file

    from verl_qerl.modeling import export_merged, get_lora_model, quantize_model

    pm = get_lora_model(quantize_model(_qwen(), "nvfp4"), r=4)
    by_key = load_file(export_merged(pm, tmp_path / "key", dtype="fp16") / "model.safetensors")
    by_dtype = load_file(export_merged(pm, tmp_path / "dtype", dtype=torch.float16) / "model.safetensors")
    assert by_key.keys() == by_dtype.keys() and all(torch.equal(by_key[k], by_dtype[k]) for k in by_key)
    for bad in (torch.int8, None, 16):
        with pytest.raises(ValueError, match=r"export_merged: dtype="):
            export_merged(pm, tmp_path / "bad", dtype=bad)
    assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------------------------------------------
# 7. NVFP4Linear.from_nvfp4 / set_nvfp4 check the tensors they store


def _bad_weights() -> dict[str, NVFP4Weight]:
    torch.manual_seed(0)
    w = quantize(torch.randn(32, 64))
    return {
        r"weight\.scale.*\(32, 2\)": NVFP4Weight(w.packed, w.scale[:, :2], w.global_scale),
        r"weight\.scale.*float32": NVFP4Weight(w.packed, w.scale.float(), w.global_scale),
        r"weight\.global_scale.*one float value": NVFP4Weight(w.packed, w.scale, w.global_scale.repeat(2)),
        r"weight\.packed.*int8": NVFP4Weight(w.packed.to(torch.int8), w.scale, w.global_scale),
        r"weight\.packed.*\(1024,\)": NVFP4Weight(w.packed.reshape(-1), w.scale, w.global_scale),
    }


def test_from_nvfp4_and_set_nvfp4_refuse_malformed_tensors_before_storing():
    from verl_qerl.modeling import NVFP4Linear

    torch.manual_seed(0)
    good = quantize(torch.randn(32, 64))
    for match, bad in _bad_weights().items():
        with pytest.raises(NVFP4FormatError, match=match):
            NVFP4Linear.from_nvfp4(bad)
        with pytest.raises(NVFP4FormatError, match=r"model\.q_proj"):
            NVFP4Linear.from_nvfp4(bad, name="model.q_proj")
        layer = NVFP4Linear.from_nvfp4(good)
        state = {k: v.clone() for k, v in layer.state_dict().items()}
        with pytest.raises(NVFP4FormatError, match=match):
            layer.set_nvfp4(bad)
        assert all(torch.equal(layer.state_dict()[k], v) and layer.state_dict()[k].dtype == v.dtype
                   for k, v in state.items())
    # the stored byte view of the block scales is accepted as well
    as_bytes = NVFP4Linear.from_nvfp4(NVFP4Weight(good.packed, good.scale.view(torch.uint8), good.global_scale))
    assert torch.equal(as_bytes.dequantize_weight(torch.float32), good.dequantize(torch.float32))


# ------------------------------------------------------------------------------------------------
# 8. targets= may not split a fused group (q/k/v, gate/up), as ignore= may not


@pytest.mark.parametrize("targets, member", [(["q_proj"], "k_proj"), (["up_proj"], "gate_proj"),
                                             (["model.layers.0.self_attn.v_proj"], "q_proj")])
def test_targets_that_split_a_fused_group_are_refused(targets, member):
    from verl_qerl.modeling import ModelConversionError, quantize_model

    model = _qwen()
    before = _layer_types(model)
    with pytest.raises(ModelConversionError, match=rf"targets.*{member}.*one fused layer"):
        quantize_model(model, "nvfp4", targets=targets)
    assert _layer_types(model) == before


def test_targets_of_whole_fused_groups_are_quantized():
    from verl_qerl.modeling import NVFP4Linear, quantize_model

    model = quantize_model(_qwen(), "nvfp4", targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(isinstance(getattr(attn, p), NVFP4Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert all(type(getattr(mlp, p)) is nn.Linear for p in ("gate_proj", "up_proj", "down_proj"))
    # a second call completing the model: the groups already in NVFP4 count as selected
    quantize_model(model, "nvfp4", targets=["gate_proj", "up_proj"])
    assert isinstance(mlp.up_proj, NVFP4Linear) and type(mlp.down_proj) is nn.Linear


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_export_merged_refuses_a_shard_size_that_is_not_a_positive_int(tmp_path, bad):
    """Before: 0 or -5 was accepted and wrote one shard per tensor."""
    from verl_qerl.modeling import export_merged

    with pytest.raises(ValueError, match="max_shard_bytes"):
        export_merged(nn.Linear(4, 4), tmp_path / "out", max_shard_bytes=bad)
    assert not (tmp_path / "out").exists()
