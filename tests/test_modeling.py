"""The trainable NVFP4 policy on CPU: NVFP4Linear, quantize_model, peft LoRA, export_merged."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from verl_qerl.nvfp4 import NVFP4FormatError, fused_global_scale, quantize
from verl_qerl.nvfp4.arch import fused_group
from verl_qerl.nvfp4.checkpoint import CheckpointError, CheckpointReader

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hf(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def _ids(seed: int = 0, batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _randomize_lora(model: nn.Module, seed: int = 1) -> None:
    """peft initializes B = 0; make both factors non-zero so every gradient path is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.fixture(scope="module")
def nvfp4_fp32(tiny_bf16):
    """The tiny model in float32, quantized in memory (NVFP4 layers, fp32 compute)."""
    from verl_qerl.modeling import quantize_model

    return quantize_model(_hf(tiny_bf16), "nvfp4")


# ------------------------------------------------------------------------------------------------
# NVFP4Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_equals_dequantized_reference(dtype, bias):
    from verl_qerl.modeling import NVFP4Linear

    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=bias).to(dtype)
    layer = NVFP4Linear.from_linear(lin)
    q = quantize(lin.weight)
    assert torch.equal(layer.weight_packed, q.packed)
    assert torch.equal(layer.weight_scale, q.scale.view(torch.uint8))
    assert torch.equal(layer.global_scale, q.global_scale)
    x = torch.randn(3, 5, 96, dtype=dtype)
    ref = F.linear(x, q.dequantize(dtype), lin.bias)
    assert torch.equal(layer(x), ref)
    assert layer(x).dtype == dtype


def test_state_is_uint8_buffers_only_and_survives_casts():
    from verl_qerl.modeling import NVFP4Linear

    torch.manual_seed(0)
    layer = NVFP4Linear.from_linear(nn.Linear(64, 32).to(torch.bfloat16))
    assert not hasattr(layer, "weight")  # no float copy of the base
    assert {n: b.dtype for n, b in layer.named_buffers()} == dict.fromkeys(
        ("weight_packed", "weight_scale", "weight_global_scale"), torch.uint8)
    assert NVFP4Linear.STORED == tuple(n for n, _ in layer.named_buffers())  # what FSDP's byte count iterates
    assert [n for n, _ in layer.named_parameters()] == ["bias"] and not layer.bias.requires_grad
    before = {n: b.clone() for n, b in layer.named_buffers()}
    gs = layer.global_scale.clone()
    for cast in (lambda m: m.float(), lambda m: m.half(), lambda m: m.to(torch.bfloat16)):
        cast(layer)
        assert all(torch.equal(b, before[n]) for n, b in layer.named_buffers())
    assert torch.equal(layer.global_scale, gs) and layer.global_scale.dtype == torch.float32
    assert layer.compute_dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    # peft's device/dtype probes: qweight for the device, compute_dtype for the adapters' dtype
    assert layer.qweight is layer.weight_packed
    no_bias = NVFP4Linear(64, 32, bias=False, dtype=torch.bfloat16).float()
    assert no_bias.compute_dtype == torch.float32


def test_state_dict_round_trip_accepts_compressed_tensors_dtypes():
    from verl_qerl.modeling import NVFP4Linear

    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    layer = NVFP4Linear.from_linear(lin)
    fresh = NVFP4Linear(64, 32, dtype=torch.float32)
    fresh.load_state_dict(layer.state_dict())
    x = torch.randn(4, 64)
    assert torch.equal(fresh(x), layer(x))
    q = quantize(lin.weight)  # on-disk dtypes: fp8 block scales, fp32 [1] divisor
    other = NVFP4Linear(64, 32, dtype=torch.float32)
    other.load_state_dict({"weight_packed": q.packed, "weight_scale": q.scale, "weight_global_scale": q.global_scale,
                           "bias": lin.bias.detach()})
    assert torch.equal(other(x), layer(x))


def test_backward_gives_input_grad_from_dequantized_weight_and_keeps_no_dense_copy():
    from verl_qerl.modeling import NVFP4Linear

    torch.manual_seed(0)
    layer = NVFP4Linear.from_linear(nn.Linear(128, 48))
    w = layer.dequantize_weight(torch.float32)
    x = torch.randn(6, 128, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    g = torch.randn(6, 48)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    y.backward(g)
    F.linear(x_ref, w, layer.bias).backward(g)
    assert torch.allclose(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    # only the quantized state (uint8 + the fp32 [1] global scale) is saved for backward: no dense
    # float weight outlives the op
    assert sorted((str(t.dtype), tuple(t.shape)) for t in saved) == sorted(
        [("torch.uint8", (48, 64)), ("torch.uint8", (48, 8)), ("torch.float32", (1,))])
    assert layer.bias.grad is None
    # a bias made trainable gets its gradient
    layer.bias.requires_grad_(True)
    layer(x.detach()).backward(g)
    assert torch.allclose(layer.bias.grad, g.sum(0))


def test_bad_layer_shapes_are_refused():
    from verl_qerl.modeling import NVFP4Linear

    with pytest.raises(NVFP4FormatError, match="multiple of the block size 16"):
        NVFP4Linear(40, 32)
    with pytest.raises(NVFP4FormatError, match="bad.weight.*multiple of the NVFP4 block size"):
        NVFP4Linear.from_linear(nn.Linear(40, 32), name="bad")
    layer = NVFP4Linear(64, 32)
    with pytest.raises(ValueError, match="input has 32 features, expected 64"):
        layer(torch.randn(2, 32, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------------
# quantize_model / load_nvfp4_model


def test_quantize_model_is_within_quantization_error_and_exact_against_fake_quant(tiny_bf16, nvfp4_fp32):
    from verl_qerl.modeling import NVFP4Linear

    original = _hf(tiny_bf16)
    modules = dict(nvfp4_fp32.named_modules())
    converted = sorted(n for n, m in modules.items() if isinstance(m, NVFP4Linear))
    assert converted == sorted(f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}"
                               for i in range(2) for p in PROJ)
    assert type(modules["lm_head"]) is nn.Linear  # ignored by default; embeddings untouched
    # fused q/k/v and gate/up share one global scale (what vLLM's fused GEMMs use)
    for i in range(2):
        gs = {fused_group(n): modules[n].global_scale for n in converted if f"layers.{i}." in n}
        for n in converted:
            if f"layers.{i}." in n:
                assert torch.equal(modules[n].global_scale, gs[fused_group(n)])
    # the reference: the dense model with each weight replaced by its NVFP4 round trip
    fake = copy.deepcopy(original)
    dense = dict(fake.named_modules())
    groups: dict[str, list[str]] = {}
    for n in converted:
        groups.setdefault(fused_group(n), []).append(n)
    with torch.no_grad():
        for names in groups.values():
            gs = fused_global_scale([dense[n].weight for n in names])
            for n in names:
                dense[n].weight.copy_(quantize(dense[n].weight, gs).dequantize(torch.float32))
    ids = _ids()
    with torch.no_grad():
        ref, fq, out = original(ids).logits, fake(ids).logits, nvfp4_fp32(ids).logits
    assert torch.allclose(out, fq, rtol=1e-5, atol=1e-5)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.3, rel  # 4-bit weights: visibly lossy, but the model is the same model


@pytest.mark.parametrize("rows, cols, chunk", [(37, 64, 5 * 64), (40, 128, 1), (97, 32, 2048 + 16)])
@pytest.mark.parametrize("given_scale", [True, False])
def test_quantize_rows_in_chunks_is_bit_exact(rows, cols, chunk, given_scale):
    """Chunks of whole rows (a ragged last one; one row per chunk; chunks not a multiple of the row) give the
    bytes of one unchunked quantize: the global scale is the whole weight's, so rows are independent."""
    from verl_qerl.modeling import linear

    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 0.05
    w[3, :16] *= 40  # an outlier row sets the global scale; other chunks must use it too
    gs = fused_global_scale([w]) if given_scale else None
    whole = quantize(w, gs)
    calls = []
    original = linear.quantize

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    linear.quantize = counting
    try:
        got = linear.quantize_rows(w, gs, chunk_elements=chunk)
    finally:
        linear.quantize = original
    assert len(calls) > 1 and sum(calls) == rows  # the chunked path ran, over every row once
    assert torch.equal(got.packed, whole.packed)
    assert torch.equal(got.scale.view(torch.uint8), whole.scale.view(torch.uint8))
    assert torch.equal(got.global_scale, whole.global_scale)


def test_quantize_model_in_chunks_gives_the_unchunked_buffers(tiny_bf16, nvfp4_fp32, monkeypatch):
    """``quantize_model`` with the chunk lowered below every layer's size: the same buffers, byte for byte."""
    from verl_qerl.modeling import linear, quantize_model

    monkeypatch.setattr(linear, "QUANTIZE_CHUNK_ELEMENTS", 8 * 128)  # 8 rows of K=128, 4 of K=256
    calls = []
    original = linear.quantize
    monkeypatch.setattr(linear, "quantize", lambda w, *a, **k: calls.append(w.shape[0]) or original(w, *a, **k))
    chunked = quantize_model(_hf(tiny_bf16), "nvfp4").state_dict()
    assert len(calls) > 14 and max(calls) <= 8  # every layer went through several chunks
    expected = nvfp4_fp32.state_dict()
    assert sorted(chunked) == sorted(expected)
    for k, v in expected.items():
        assert chunked[k].dtype == v.dtype and torch.equal(chunked[k], v), k


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])])
def test_quantize_model_on_a_compute_device_gives_the_same_bytes_on_the_layers_device(tiny_bf16, nvfp4_fp32,
                                                                                     monkeypatch, device):
    """What verl's actor hook does (its model is on the CPU, the worker has a GPU): the dense weights quantized on
    ``compute_device``, the NVFP4 buffers back on the CPU, byte for byte those of quantizing on the CPU."""
    from verl_qerl.modeling import model_conversion, quantize_model

    seen = []
    original = model_conversion.quantize_rows
    monkeypatch.setattr(model_conversion, "quantize_rows",
                        lambda w, *a, **k: seen.append(w.device.type) or original(w, *a, **k))
    got = quantize_model(_hf(tiny_bf16), "nvfp4", compute_device=device).state_dict()
    assert len(seen) == 14 and set(seen) == {device}
    expected = nvfp4_fp32.state_dict()
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert got[k].device.type == "cpu" and got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_checkpoint_and_in_memory_quantization_give_identical_buffers(tiny_bf16, tiny_nvfp4, nvfp4_fp32):
    from verl_qerl.modeling import load_nvfp4_model, quantize_model

    expected = nvfp4_fp32.state_dict()
    from_ct = load_nvfp4_model(tiny_nvfp4, dtype=torch.float32)  # qerl-quantize output, no dense weights
    from_bf16 = load_nvfp4_model(tiny_bf16, dtype=torch.float32)  # quantized on load from the bf16 folder
    onto_model = quantize_model(_hf(tiny_bf16), checkpoint=tiny_nvfp4)  # existing model, NVFP4 tensors from disk
    for model in (from_ct, from_bf16, onto_model):
        sd = model.state_dict()
        assert sorted(sd) == sorted(expected)
        for k, v in expected.items():
            assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(from_ct(ids).logits, nvfp4_fp32(ids).logits)


def test_scale_rule_reaches_every_quantizing_path(tiny_bf16, tmp_path):
    """quantize_model, load_nvfp4_model of a BF16 folder and qerl-quantize agree under the fp32 rule too."""
    from verl_qerl.checkpoint_conversion import quantize_checkpoint
    from verl_qerl.modeling import ModelConversionError, load_nvfp4_model, quantize_model

    ckpt = quantize_checkpoint(tiny_bf16, tmp_path / "fp32", scale_rule="fp32").dst
    expected = load_nvfp4_model(ckpt, dtype=torch.float32).state_dict()
    in_memory = quantize_model(_hf(tiny_bf16), "nvfp4", scale_rule="fp32")
    from_folder = load_nvfp4_model(tiny_bf16, dtype=torch.float32, scale_rule="fp32")
    for model in (in_memory, from_folder):
        sd = model.state_dict()
        for k, v in expected.items():
            assert torch.equal(sd[k], v), k
    default = quantize_model(_hf(tiny_bf16), "nvfp4").state_dict()
    gs = [k for k in expected if k.endswith("weight_global_scale")]
    assert len(gs) == 14 and sum(not torch.equal(default[k], expected[k]) for k in gs) >= 7
    with pytest.raises(ModelConversionError, match=r"scale_rule='fp16': unknown NVFP4 scale rule"):
        quantize_model(_hf(tiny_bf16), "nvfp4", scale_rule="fp16")


def test_load_nvfp4_model_builds_no_dense_linear_weights(tiny_nvfp4, monkeypatch):
    from verl_qerl.modeling import NVFP4Linear, load_nvfp4_model, params_on_meta

    with params_on_meta():
        lin = nn.Linear(1024, 1024)
    assert lin.weight.is_meta
    seen = []
    original = NVFP4Linear.from_linear
    monkeypatch.setattr(NVFP4Linear, "from_linear", lambda *a, **k: seen.append(1) or original(*a, **k))
    model = load_nvfp4_model(tiny_nvfp4, dtype=torch.bfloat16)
    assert not seen
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, NVFP4Linear) and q.bias.dtype == torch.bfloat16 and q.weight_packed.dtype == torch.uint8


def test_meta_model_gets_meta_shells_filled_by_state_dict(tiny_bf16, nvfp4_fp32):
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_qerl.modeling import NVFP4Linear, quantize_model

    config = AutoConfig.from_pretrained(tiny_bf16)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    quantize_model(meta)  # what verl's non-zero ranks do before rank 0's broadcast
    q = meta.model.layers[0].self_attn.q_proj
    assert isinstance(q, NVFP4Linear) and q.weight_packed.is_meta and q.weight_packed.dtype == torch.uint8
    assert sorted(meta.state_dict()) == sorted(nvfp4_fp32.state_dict())
    meta.load_state_dict(nvfp4_fp32.state_dict(), assign=True)
    assert torch.equal(meta.model.layers[0].mlp.up_proj.global_scale,
                       nvfp4_fp32.model.layers[0].mlp.up_proj.global_scale)


def test_bf16_mode_is_a_no_op_and_nf4_without_bitsandbytes_says_so(tiny_bf16, monkeypatch):
    import sys

    from verl_qerl.modeling import NF4UnavailableError, quantize_model

    model = _hf(tiny_bf16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert quantize_model(model, "bf16") is model
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed: import fails
    with pytest.raises(NF4UnavailableError, match="needs bitsandbytes"):
        quantize_model(model, "nf4")
    with pytest.raises(ValueError, match="mode='int8'"):
        quantize_model(_hf(tiny_bf16), "int8")


#: NF4's 16 levels (QLoRA, Dettmers et al. 2023, appendix E): the normal-quantile code, -1 ... 1 with an exact 0.
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)


def test_nf4_mode_is_nf4_and_computes_with_its_dequantized_weight(tiny_bf16):
    """The QLoRA baseline (bitsandbytes' CPU build): every projection becomes an NF4 Linear4bit (blocks of 64,
    double-quantized absmax); each weight element is the NF4 level nearest to w / absmax(block), decoded here
    from the packed nibbles; the model computes exactly what the dense model with those weights computes, and
    a LoRA adapter on it what the same adapter on that dense model computes."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_f
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from verl_qerl.modeling import get_lora_model, quantize_model

    original = _hf(tiny_bf16)
    dense_w = {n: m.weight.detach().clone() for n, m in original.named_modules() if isinstance(m, nn.Linear)}
    model = quantize_model(copy.deepcopy(original), "nf4")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert sorted(layers) == sorted(f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}"
                                    for i in range(2) for p in PROJ)
    assert type(model.lm_head) is nn.Linear and model.is_loaded_in_4bit
    levels = torch.tensor(NF4_LEVELS)
    reference = copy.deepcopy(original)
    ref_mods = dict(reference.named_modules())
    for name, layer in layers.items():
        qs = layer.weight.quant_state
        assert qs.quant_type == "nf4" and qs.blocksize == 64 and qs.nested
        w = dense_w[name]
        byte = layer.weight.data.reshape(-1).to(torch.int64)
        codes = torch.stack([byte >> 4, byte & 0xF], -1).reshape(-1, 64)  # first element in the high nibble
        absmax = (bnb_f.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset).float().reshape(-1, 1)
        deq = bnb_f.dequantize_4bit(layer.weight.data, qs)
        assert deq.shape == w.shape and torch.equal(deq, (levels[codes] * absmax).reshape(w.shape)), name
        blocks = w.reshape(-1, 64)
        true_absmax = blocks.abs().amax(1, keepdim=True)
        nearest = (blocks.unsqueeze(-1) / true_absmax.unsqueeze(-1) - levels).abs().argmin(-1)
        assert torch.equal(codes, nearest), name
        assert float(((absmax - true_absmax).abs() / true_absmax).max()) < 1e-2  # 8-bit double quantization
        with torch.no_grad():
            ref_mods[name].weight.copy_(deq)
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(len(name)))
        with torch.no_grad():
            assert torch.equal(layer(x), F.linear(x, deq, layer.bias)), name
    ids = _ids()
    with torch.no_grad():
        out, ref, dense = model(ids).logits, reference(ids).logits, original(ids).logits
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert 0 < float((out - dense).norm() / dense.norm()) < 0.3  # 4-bit: lossy, but the same model
    # QLoRA: peft's bitsandbytes LoRA layer on the NF4 base = the same adapter on the dequantized dense model
    lora, lora_ref = get_lora_model(model, r=8, lora_alpha=16), get_lora_model(reference, r=8, lora_alpha=16)
    _randomize_lora(lora)
    set_peft_model_state_dict(lora_ref, get_peft_model_state_dict(lora))
    with torch.no_grad():
        lora_out, lora_ref_out = lora(input_ids=ids).logits, lora_ref(input_ids=ids).logits
    assert torch.allclose(lora_out, lora_ref_out, rtol=1e-5, atol=1e-5)
    assert float((lora_out - out).abs().max()) > 1e-3  # the adapter is active


def test_bad_models_and_modules_are_named(tiny_bf16):
    from verl_qerl.modeling import ModelConversionError, get_lora_model, quantize_model

    model = _hf(tiny_bf16)
    with pytest.raises(ModelConversionError, match="'model.embed_tokens' is a torch.nn.modules.sparse.Embedding"):
        quantize_model(model, targets=["embed_tokens", "q_proj"])
    with pytest.raises(ModelConversionError, match=r"\['no_such_proj'\] match no module"):
        quantize_model(model, targets=["no_such_proj"])
    odd = _hf(tiny_bf16)
    odd.model.layers[1].mlp.down_proj = nn.Linear(40, 128, bias=False)
    with pytest.raises(ModelConversionError, match="model.layers.1.mlp.down_proj.weight: in_features K=40"):
        quantize_model(odd)
    gpt = _hf(tiny_bf16)
    gpt.config.model_type = "gpt2"
    with pytest.raises(ModelConversionError, match="model_type='gpt2' is not supported"):
        quantize_model(gpt)
    peft_model = get_lora_model(_hf(tiny_bf16), r=4, lora_alpha=8)
    with pytest.raises(ModelConversionError, match="already has peft adapters"):
        quantize_model(peft_model)


def _snapshot(model: nn.Module) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Module types by name and a copy of the state dict: what a refused call must leave as it was."""
    types = {n: type(m).__qualname__ for n, m in model.named_modules()}
    return types, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model: nn.Module, snapshot) -> None:
    types, state = snapshot
    now_types, now_state = _snapshot(model)
    assert now_types == types, sorted(n for n in types if now_types.get(n) != types[n])[:5]
    assert sorted(now_state) == sorted(state)
    for k, v in state.items():
        now = now_state[k]
        assert now.dtype == v.dtype and now.shape == v.shape and now.is_meta == v.is_meta, k
        if not v.is_meta:
            torch.testing.assert_close(now, v, rtol=0, atol=0, equal_nan=True, msg=k)


@pytest.mark.parametrize("defect", ["K=40", "NaN", "partly meta"])
def test_a_refused_conversion_leaves_the_model_as_it_was(tiny_bf16, defect):
    from verl_qerl.modeling import ModelConversionError, quantize_model

    model = _hf(tiny_bf16)
    if defect == "K=40":  # the last target layer: every other layer would be converted first
        model.model.layers[1].mlp.down_proj = nn.Linear(40, 128, bias=False)
    elif defect == "NaN":
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    else:
        model.model.layers[1].self_attn.k_proj.to("meta")
    before = _snapshot(model)
    with pytest.raises(ModelConversionError, match="model.layers.1.") as err:
        quantize_model(model)
    assert {"K=40": "K=40", "NaN": "NaN", "partly meta": "meta"}[defect] in str(err.value)
    _assert_unchanged(model, before)


def test_a_refused_checkpoint_load_leaves_the_model_as_it_was(tiny_bf16, tiny_nvfp4, tmp_path):
    from verl_qerl.modeling import quantize_model

    key = "model.layers.1.mlp.down_proj"

    def wrong_shape(t):
        t[f"{key}.weight_packed"] = t[f"{key}.weight_packed"][:64].contiguous()
        t[f"{key}.weight_scale"] = t[f"{key}.weight_scale"][:64].contiguous()

    model = _hf(tiny_bf16)
    before = _snapshot(model)
    with pytest.raises((CheckpointError, NVFP4FormatError), match=f"{key}: checkpoint weight is \\[64, 256\\]"):
        quantize_model(model, checkpoint=_rewrite(tiny_nvfp4, tmp_path / "shape", wrong_shape))
    _assert_unchanged(model, before)

    def bf16_shape(t):
        t[f"{key}.weight"] = t[f"{key}.weight"][:, :64].contiguous()

    with pytest.raises(CheckpointError, match=f"tensor '{key}.weight' is \\[128, 64\\]"):
        quantize_model(model, checkpoint=_rewrite(tiny_bf16, tmp_path / "bf16", bf16_shape))
    _assert_unchanged(model, before)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_checkpoint_not_matching_the_model_names_the_tensor(tiny_bf16, tiny_nvfp4, tmp_path):
    from verl_qerl.modeling import quantize_model

    key = "model.layers.1.mlp.down_proj"

    def wrong_shape(t):
        t[f"{key}.weight_packed"] = t[f"{key}.weight_packed"][:64].contiguous()
        t[f"{key}.weight_scale"] = t[f"{key}.weight_scale"][:64].contiguous()

    bad = _rewrite(tiny_nvfp4, tmp_path / "shape", wrong_shape)
    with pytest.raises((CheckpointError, NVFP4FormatError), match=f"{key}: checkpoint weight is \\[64, 256\\]"):
        quantize_model(_hf(tiny_bf16), checkpoint=bad)

    def extra(t):
        for suffix in ("weight_packed", "weight_scale", "weight_global_scale"):
            t[f"model.layers.7.mlp.up_proj.{suffix}"] = t[f"{key}.{suffix}"].clone()

    with pytest.raises(CheckpointError, match="model.layers.7.mlp.up_proj.weight_packed'\\) do not exist"):
        quantize_model(_hf(tiny_bf16), checkpoint=_rewrite(tiny_nvfp4, tmp_path / "extra", extra))

    def missing(t):
        for suffix in ("weight_packed", "weight_scale", "weight_global_scale"):
            del t[f"{key}.{suffix}"]

    with pytest.raises(CheckpointError, match=f"model layer '{key}' has neither NVFP4 tensors"):
        quantize_model(_hf(tiny_bf16), checkpoint=_rewrite(tiny_nvfp4, tmp_path / "missing", missing))

    def bf16_shape(t):
        t[f"{key}.weight"] = t[f"{key}.weight"][:, :64].contiguous()

    with pytest.raises(CheckpointError, match=f"tensor '{key}.weight' is \\[128, 64\\]"):
        quantize_model(_hf(tiny_bf16), checkpoint=_rewrite(tiny_bf16, tmp_path / "bf16", bf16_shape))


# ------------------------------------------------------------------------------------------------
# LoRA through peft


def _dense_lora_twin(tiny_bf16: Path, nvfp4_model: nn.Module, lora_model: nn.Module):
    """A plain float32 model whose Linear weights are the NVFP4 model's dequantized weights, with
    ordinary peft LoRA carrying the same adapter values."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from verl_qerl.modeling import NVFP4Linear, get_lora_model

    dense = _hf(tiny_bf16)
    modules = dict(dense.named_modules())
    with torch.no_grad():
        for name, m in nvfp4_model.named_modules():
            if isinstance(m, NVFP4Linear):
                name = name.removeprefix("base_model.model.").removesuffix(".base_layer")
                modules[name].weight.copy_(m.dequantize_weight(torch.float32))
    twin = get_lora_model(dense, r=8, lora_alpha=16)
    set_peft_model_state_dict(twin, get_peft_model_state_dict(lora_model))
    return twin


@pytest.fixture()
def lora_nvfp4(nvfp4_fp32):
    from verl_qerl.modeling import get_lora_model

    model = get_lora_model(copy.deepcopy(nvfp4_fp32), r=8, lora_alpha=16)
    _randomize_lora(model)
    return model


def test_lora_gradients_equal_those_of_the_dequantized_dense_model(tiny_bf16, nvfp4_fp32, lora_nvfp4):
    from verl_qerl.modeling import NVFP4LoraLinear

    wrapped = [n for n, m in lora_nvfp4.named_modules() if isinstance(m, NVFP4LoraLinear)]
    assert len(wrapped) == 14
    twin = _dense_lora_twin(tiny_bf16, nvfp4_fp32, lora_nvfp4)
    ids = _ids()
    loss = lora_nvfp4(input_ids=ids, labels=ids).loss
    loss_ref = twin(input_ids=ids, labels=ids).loss
    loss.backward()
    loss_ref.backward()
    assert torch.allclose(loss, loss_ref, rtol=1e-5)
    ref = {n: p.grad for n, p in twin.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in lora_nvfp4.named_parameters() if p.requires_grad}
    assert sorted(got) == sorted(ref) and len(got) == 28
    for n, g in got.items():
        rel = ((g - ref[n]).norm() / ref[n].norm()).item()
        assert rel <= 1e-4, (n, rel)


def test_only_adapters_train_and_a_step_changes_only_them(lora_nvfp4):
    trainable = [n for n, p in lora_nvfp4.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    before = {k: v.clone() for k, v in lora_nvfp4.state_dict().items()}
    opt = torch.optim.AdamW([p for p in lora_nvfp4.parameters() if p.requires_grad], lr=1e-2)
    ids = _ids(3)
    lora_nvfp4(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    after = lora_nvfp4.state_dict()
    buffers = {n for n, _ in lora_nvfp4.named_buffers()}
    assert any("weight_global_scale" in n for n in buffers)
    for k, v in after.items():
        if ".lora_" in k:
            assert not torch.equal(v, before[k]), k
        else:  # NVFP4 buffers, biases, norms, embeddings, lm_head: bit-identical
            assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(lora_nvfp4, reentrant):
    ids = _ids(4)
    lora_nvfp4(input_ids=ids, labels=ids).loss.backward()
    plain = {n: p.grad.clone() for n, p in lora_nvfp4.named_parameters() if p.requires_grad}
    lora_nvfp4.zero_grad(set_to_none=True)
    lora_nvfp4.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    lora_nvfp4.enable_input_require_grads()
    lora_nvfp4.train()
    lora_nvfp4(input_ids=ids, labels=ids).loss.backward()
    for n, p in lora_nvfp4.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p.grad, plain[n], rtol=1e-5, atol=1e-7), n


def test_adapter_save_load_round_trip_with_peft_files(tiny_nvfp4, lora_nvfp4, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict

    from verl_qerl.modeling import load_lora_adapter, load_nvfp4_model, peft_custom_modules

    keys = list(get_peft_model_state_dict(lora_nvfp4))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys  # what vLLM parses
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    lora_nvfp4.save_pretrained(tmp_path / "adapter")
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert "adapter_config.json" in files and "adapter_model.safetensors" in files
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert sorted(saved) == sorted(keys)
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == sorted(PROJ) and cfg["r"] == 8
    ids = _ids(5)
    with torch.no_grad():
        want = lora_nvfp4(ids).logits
        loaded = load_lora_adapter(load_nvfp4_model(tiny_nvfp4, dtype=torch.float32), tmp_path / "adapter")
        assert torch.equal(loaded(ids).logits, want)
        with peft_custom_modules():  # what verl's PeftModel.from_pretrained(lora_adapter_path) goes through
            plain = PeftModel.from_pretrained(load_nvfp4_model(tiny_nvfp4, dtype=torch.float32), tmp_path / "adapter")
        assert torch.equal(plain(ids).logits, want)
    from peft import LoraConfig

    assert not LoraConfig(r=4)._custom_modules  # the context left peft as it was


def test_disabled_adapters_give_the_base_model_and_merging_is_refused(nvfp4_fp32, lora_nvfp4):
    from verl_qerl.modeling import NVFP4MergeError

    ids = _ids(6)
    with torch.no_grad():
        with lora_nvfp4.disable_adapter():  # verl's reference policy with LoRA
            base = lora_nvfp4(ids).logits
        assert torch.equal(base, nvfp4_fp32(ids).logits)
        assert not torch.allclose(lora_nvfp4(ids).logits, base)
    with pytest.raises(NVFP4MergeError, match="cannot merge LoRA into an NVFP4 base layer.*export_merged"):
        lora_nvfp4.merge_and_unload()
    with pytest.raises(ValueError, match="needs the dense base weight"):
        from verl_qerl.modeling import get_lora_model

        get_lora_model(copy.deepcopy(nvfp4_fp32), r=4, lora_alpha=8, init_lora_weights="pissa")


def test_merge_is_refused_before_any_layer_merges(tiny_bf16):
    """Layer 0 kept in BF16 (peft's own LoRA layers, mergeable) comes before the first NVFP4 layer."""
    from verl_qerl.modeling import NVFP4MergeError, get_lora_model, quantize_model

    model = quantize_model(_hf(tiny_bf16), ignore=["lm_head", "re:model\\.layers\\.0\\."])
    lora = get_lora_model(model, r=8, lora_alpha=16)
    _randomize_lora(lora)
    ids = _ids(7)
    with torch.no_grad():
        want = lora(ids).logits
        with lora.disable_adapter():
            base = lora(ids).logits
    before = _snapshot(lora)
    merges = {"merge_and_unload": lambda: lora.merge_and_unload(), "merge_adapter": lambda: lora.merge_adapter(),
              "safe_merge": lambda: lora.base_model.merge_and_unload(safe_merge=True)}
    for how, merge in merges.items():
        with pytest.raises(NVFP4MergeError, match="cannot merge LoRA into an NVFP4 base layer") as err:
            merge()
        _assert_unchanged(lora, before)
        with torch.no_grad():
            assert torch.equal(lora(ids).logits, want), how
        assert "model.layers.1.self_attn.q_proj" in str(err.value)  # the first NVFP4 layer is named
    unloaded = lora.unload()  # dropping the adapters without merging stays allowed
    with torch.no_grad():
        assert torch.equal(unloaded(ids).logits, base)


def test_all_linear_targets_include_nvfp4_layers(nvfp4_fp32):
    from verl_qerl.modeling import resolve_target_modules

    assert resolve_target_modules(nvfp4_fp32, "all-linear") == sorted(PROJ)


# ------------------------------------------------------------------------------------------------
# export_merged


def test_export_merged_bf16_loads_in_transformers_and_matches(tiny_bf16, lora_nvfp4, tmp_path):
    from verl_qerl.modeling import NVFP4LoraLinear, export_merged

    out = export_merged(lora_nvfp4, tmp_path / "merged", dtype="bf16", tokenizer=tiny_bf16)
    assert (out / "tokenizer.json").is_file() and "quantization_config" not in json.loads(
        (out / "config.json").read_text())
    loaded = _hf(out, torch.bfloat16)
    params = dict(loaded.named_parameters())
    for name, m in lora_nvfp4.base_model.model.named_modules():
        if isinstance(m, NVFP4LoraLinear):
            a, b = m.lora_A["default"].weight.detach(), m.lora_B["default"].weight.detach()
            want = (m.base_layer.dequantize_weight(torch.float32) + (b @ a) * m.scaling["default"]).to(torch.bfloat16)
            assert torch.equal(params[f"{name}.weight"].detach(), want), name
    ids = _ids(7)
    with torch.no_grad():
        want = lora_nvfp4(ids).logits
        got = _hf(out, torch.float32)(ids).logits
    assert ((got - want).norm() / want.norm()).item() < 2e-2  # bf16 rounding of the merged weights only


def test_export_merged_nvfp4_loads_in_compressed_tensors_and_matches(lora_nvfp4, tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from verl_qerl.modeling import NVFP4LoraLinear, export_merged

    out = export_merged(lora_nvfp4, tmp_path / "merged4", dtype="nvfp4")
    reader = CheckpointReader(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized" and qc["ignore"] == ["lm_head"]
    assert reader.config["qerl_scale_rule"] == "bf16"
    layers = {n: m for n, m in lora_nvfp4.base_model.model.named_modules() if isinstance(m, NVFP4LoraLinear)}
    assert sorted(reader.nvfp4_modules()) == sorted(layers)
    merged = {n: m.base_layer.dequantize_weight(torch.float32) + m.get_delta_weight("default")
              for n, m in layers.items()}
    groups: dict[str, list[str]] = {}
    for n in layers:
        groups.setdefault(fused_group(n), []).append(n)
    expected = {}
    for names in groups.values():
        gs = fused_global_scale([merged[n] for n in names])
        expected.update({n: quantize(merged[n], gs) for n in names})
    for n, q in expected.items():  # re-quantized merged weights, fused groups sharing a global scale
        got = reader.read_nvfp4(n)
        assert torch.equal(got.packed, q.packed) and torch.equal(got.global_scale, q.global_scale), n
    model = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    for n, q in expected.items():  # the real compressed-tensors decompresses to exactly our dequant
        assert torch.equal(params[f"{n}.weight"].detach(), q.dequantize(torch.bfloat16)), n


def test_export_merged_refuses_a_non_empty_folder_and_bad_dtype(lora_nvfp4, tmp_path):
    from verl_qerl.modeling import export_merged

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("keep")
    with pytest.raises(FileExistsError):
        export_merged(lora_nvfp4, tmp_path / "x")
    with pytest.raises(ValueError, match="dtype='int4'"):
        export_merged(lora_nvfp4, tmp_path / "y", dtype="int4")
    assert (tmp_path / "x" / "f").read_text() == "keep" and not (tmp_path / "y").exists()
