"""Inputs the format and model layers used to accept with a silent wrong result (each test failed before its fix):
a tied checkpoint missing Linear weights, a checkpoint's declared ignore list replacing the default or read as
characters, misspelled ignore patterns in the Python API, a save_pretrained folder of a quantized model, NVFP4 layers
in peft's modules_to_save, integer inputs, NaN block scales, an N that does not fit the kernel layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from verl_qerl import kernels
from verl_qerl.checkpoint_conversion import quantize_checkpoint
from verl_qerl.modeling import NVFP4Linear, get_lora_model, load_nvfp4_model, quantize_model
from verl_qerl.modeling.model_conversion import ModelConversionError
from verl_qerl.nvfp4 import quantize
from verl_qerl.nvfp4.checkpoint import CheckpointError
from verl_qerl.nvfp4.quant_config import quantize_at_load_layers
from verl_qerl.nvfp4.quantize import NVFP4FormatError


def _copy(src: Path, dst: Path, edit_config=None, edit_tensors=None) -> Path:
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        for f in dst.glob("*.safetensors"):
            save_file(edit_tensors(load_file(f)), f, metadata={"format": "pt"})
    if edit_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _dense(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_a_tied_checkpoint_missing_linear_weights_is_refused(tiny_bf16, tmp_path):
    def drop(sd):
        sd.pop("model.layers.1.mlp.down_proj.weight")
        sd.pop("lm_head.weight", None)
        return sd

    src = _copy(tiny_bf16, tmp_path / "src", lambda c: c.update(tie_word_embeddings=True), drop)
    with pytest.raises(CheckpointError, match=r"Linear weight\(s\) missing.*model.layers.1.mlp.down_proj.weight"):
        quantize_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _declare(ignore):
    return lambda c: c.update(quantization_config={"quant_method": "qerl_nvfp4", "ignore": ignore})


@pytest.mark.parametrize("declared", [["down_proj"], "down_proj"], ids=["list", "string"])
def test_a_declared_ignore_list_adds_to_the_default(tiny_bf16, tmp_path, declared):
    src = _copy(tiny_bf16, tmp_path / "src", _declare(declared))
    assert quantize_at_load_layers(json.loads((src / "config.json").read_text())["quantization_config"])[0] == [
        "down_proj"]
    model = load_nvfp4_model(src, dtype=torch.float32)
    assert not isinstance(model.lm_head, NVFP4Linear)  # the default stays: vLLM never quantizes its LM head
    assert not isinstance(model.model.layers[0].mlp.down_proj, NVFP4Linear)
    assert isinstance(model.model.layers[0].mlp.up_proj, NVFP4Linear)


def test_a_misspelled_ignore_pattern_is_refused_by_the_api(tiny_bf16):
    with pytest.raises(ModelConversionError, match=r"'donw_proj' matches no Linear layer"):
        quantize_model(_dense(tiny_bf16), "nvfp4", ignore=["lm_head", "donw_proj"])
    model = quantize_model(_dense(tiny_bf16), "nvfp4", ignore=["lm_head", "down_proj"])
    assert not isinstance(model.model.layers[0].mlp.down_proj, NVFP4Linear)


def test_a_checkpoints_own_ignore_patterns_need_not_match(tiny_bf16, tmp_path):
    # other tools declare patterns for modules this architecture lacks (an MoE router): not the user's typo
    src = _copy(tiny_bf16, tmp_path / "src", _declare(["lm_head", "re:.*mlp.gate$"]))
    assert isinstance(load_nvfp4_model(src, dtype=torch.float32).model.layers[0].mlp.down_proj, NVFP4Linear)


def test_a_save_pretrained_folder_of_a_quantized_model_is_named(tiny_bf16, tmp_path):
    model = quantize_model(_dense(tiny_bf16), "nvfp4")
    model.save_pretrained(tmp_path / "saved")
    with pytest.raises(CheckpointError, match=r"has NVFP4 tensors .* declares no NVFP4 quantization_config"):
        load_nvfp4_model(tmp_path / "saved")


def test_modules_to_save_on_an_nvfp4_layer_is_refused(tiny_bf16):
    model = quantize_model(_dense(tiny_bf16), "nvfp4")
    with pytest.raises(ValueError, match=r"modules_to_save \['down_proj'\] names NVFP4 layer"):
        get_lora_model(model, r=4, target_modules=["o_proj"], modules_to_save=["down_proj"])


def test_integer_inputs_are_refused():
    q = quantize(torch.randn(32, 64))
    with pytest.raises(TypeError, match=r"x must be a floating-point tensor .* got torch.int64"):
        kernels.linear(torch.randint(-3, 3, (2, 64)), q.packed, q.scale, q.global_scale)


def test_nan_block_scales_are_refused(tiny_nvfp4, tmp_path):
    def poison(sd):
        name = "model.layers.0.mlp.down_proj.weight_scale"
        if name in sd:
            s = sd[name].view(torch.uint8).clone()
            s.view(-1)[0] = 0x7F
            sd[name] = s.view(torch.float8_e4m3fn)
        return sd

    src = _copy(tiny_nvfp4, tmp_path / "src", edit_tensors=poison)
    with pytest.raises(NVFP4FormatError, match=r"down_proj.weight_scale: 1 block scale\(s\) are NaN"):
        load_nvfp4_model(src, dtype=torch.float32)


def test_an_n_outside_the_kernel_layout_is_refused():
    q = quantize(torch.randn(48, 128))
    rw = kernels.repack(q.packed, q.scale)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    assert kernels.linear(x, None, None, q.global_scale, kernel_weight=rw, n=48).shape == (2, 48)
    fits = r"n=300 does not fit the weight's 128 padded rows \(n must be a multiple of 16 in \(0, 128\]\)"
    with pytest.raises(ValueError, match=fits):
        kernels.linear(x, None, None, q.global_scale, kernel_weight=rw, n=300)


def test_a_bad_global_scale_or_an_empty_weight_is_named():
    q = quantize(torch.randn(32, 64))
    with pytest.raises(ValueError, match=r"dequantize: global_scale must hold one value, got shape \(2,\)"):
        kernels.dequantize(q.packed, q.scale, torch.ones(2))
    with pytest.raises(ValueError, match=r"dequantize: global_scale must be finite and > 0, got 0.0"):
        kernels.dequantize(q.packed, q.scale, torch.zeros(1))
    with pytest.raises(NVFP4FormatError, match=r"an empty weight \(0, 16\) has no scale"):
        quantize(torch.zeros(0, 16))


def test_negative_block_scales_are_refused(tiny_nvfp4, tmp_path):
    """A block scale with the sign bit set (never written by a quantizer: amax / 6 >= 0) negated its block's weights
    silently on load; now an error naming the tensor. -0 (0x80) is a zero block and still loads."""
    from verl_qerl.nvfp4 import block_scale_problem

    def negate(sd):
        name = "model.layers.0.mlp.down_proj.weight_scale"
        if name in sd:
            sd[name] = (sd[name].view(torch.uint8) | 0x80).view(torch.float8_e4m3fn)
        return sd

    src = _copy(tiny_nvfp4, tmp_path / "src", edit_tensors=negate)
    with pytest.raises(NVFP4FormatError, match=r"down_proj.weight_scale: \d+ block scale\(s\) are negative"):
        load_nvfp4_model(src, dtype=torch.float32)
    bits = torch.tensor([0x00, 0x80, 0x38, 0x7E], dtype=torch.uint8)
    assert block_scale_problem(bits) is None  # zero, minus zero, 1.0, the largest finite
    assert "1 block scale(s) are negative" in block_scale_problem(torch.tensor([0x38, 0xB8], dtype=torch.uint8))
    assert "are NaN" in block_scale_problem(torch.tensor([0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn))
    assert block_scale_problem(torch.empty(4, 2, dtype=torch.float8_e4m3fn, device="meta")) is None
