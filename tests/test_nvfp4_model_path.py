"""model.path = an NVFP4 checkpoint: verl's FSDPEngine._build_module, hooked, builds the actor without dense weights.

Runs verl's own ``_build_module`` / ``_build_lora_module`` on a stand-in engine (no process group: the fake
device mesh says which rank we are), on the tiny compressed-tensors NVFP4A16 checkpoint of ``tiny_nvfp4``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

os.environ.setdefault("VERL_QERL_QUIET", "1")
import verl  # noqa: E402, F401  (required in CI: a missing verl must fail, not skip)
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine  # noqa: E402

from verl_qerl.modeling import NVFP4Linear, load_nvfp4_model  # noqa: E402
from verl_qerl.nvfp4.checkpoint import CheckpointReader  # noqa: E402
from verl_qerl.verl.config import QeRLConfig  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def fake_engine(model_path, *, rank=0, quantized_checkpoint=None, mode="nvfp4"):
    from transformers import AutoConfig

    qerl = QeRLConfig(mode=mode, quantized_checkpoint=None if quantized_checkpoint is None
                      else str(quantized_checkpoint)).to_dict()
    model_config = SimpleNamespace(
        lora={"qerl": qerl}, local_path=str(model_path), path=str(model_path),
        hf_config=AutoConfig.from_pretrained(model_path), model_type="language_model", trust_remote_code=False,
        use_liger=False, fused_kernel_options=None, use_fused_kernels=False, enable_gradient_checkpointing=False,
        lora_rank=8, lora_alpha=16, target_modules=TARGETS, target_parameters=None, exclude_modules=None,
        lora_adapter_path=None, use_shm=False)
    return SimpleNamespace(
        model_config=model_config, engine_config=SimpleNamespace(model_dtype=None, forward_only=False),
        device_mesh=SimpleNamespace(get_coordinate=lambda: [rank]), use_remove_padding=False,
        ulysses_sequence_parallel_size=1)


@pytest.fixture
def no_dense_linear_init(monkeypatch):
    """Fails if any nn.Linear gets a real weight to initialize while the actor is built."""
    touched = []
    original = nn.Linear.reset_parameters

    def reset_parameters(self):
        if not self.weight.is_meta:
            touched.append(tuple(self.weight.shape))
        return original(self)

    monkeypatch.setattr(nn.Linear, "reset_parameters", reset_parameters)
    return touched


def _check_against_checkpoint(module, ckpt):
    reader = CheckpointReader(ckpt)
    stored = reader.nvfp4_modules()
    layers = {n: m for n, m in module.named_modules() if isinstance(m, NVFP4Linear)}
    assert sorted(layers) == sorted(stored) and len(stored) == 14  # 2 layers x 7 projections; lm_head dense
    for n, layer in layers.items():
        w = reader.read_nvfp4(n)
        assert torch.equal(layer.weight_packed, reader.get(f"{n}.weight_packed"))
        assert torch.equal(layer.weight_packed, w.packed)
        assert torch.equal(layer.weight_scale, w.scale.view(torch.uint8))
        assert torch.equal(layer.global_scale, w.global_scale)
    dense = [n for n, m in module.named_modules() if type(m) is nn.Linear]
    assert dense == ["lm_head"]
    for name, p in module.named_parameters():
        # every parameter is a checkpoint tensor (no dense q/k/v/... weight), in verl's training dtype
        assert name in reader, name
        assert p.dtype == torch.float32 and torch.equal(p.detach(), reader.get(name).float()), name
    return layers


def test_build_module_from_nvfp4_model_path(tiny_nvfp4, no_dense_linear_init, caplog):
    assert getattr(FSDPEngine._build_module, "_qerl_wrapped", False)
    engine = fake_engine(tiny_nvfp4)
    assert engine.model_config.hf_config.quantization_config  # verl's config keeps it; the actor ignores it
    with caplog.at_level("WARNING", logger="verl_qerl"):
        module = FSDPEngine._build_module(engine)
    assert "built from the NVFP4 checkpoint" in caplog.text
    assert no_dense_linear_init == []
    assert getattr(module.config, "quantization_config", None) is None
    _check_against_checkpoint(module, tiny_nvfp4)

    ref = load_nvfp4_model(tiny_nvfp4, dtype=torch.float32)
    ids = torch.randint(0, module.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(module.eval()(ids).logits, ref(ids).logits)

    # hook 3 does not convert again; peft wraps the NVFP4 layers
    with caplog.at_level("WARNING", logger="verl_qerl"):
        peft_model = FSDPEngine._build_lora_module(engine, module.train())
    assert "already NVFP4" in caplog.text
    layers = {n: m for n, m in peft_model.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(layers) == 14 and all(".base_layer" in n for n in layers)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_other_ranks_build_matching_meta_shells(tiny_nvfp4, no_dense_linear_init):
    """Ranks != 0 build on meta (verl then broadcasts rank 0's parameters and buffers): same structure."""
    rank0 = FSDPEngine._build_module(fake_engine(tiny_nvfp4, rank=0))
    rank1 = FSDPEngine._build_module(fake_engine(tiny_nvfp4, rank=1))
    sd0, sd1 = rank0.state_dict(), rank1.state_dict()
    assert list(sd0) == list(sd1)
    for k in sd0:
        assert sd1[k].is_meta and (sd1[k].shape, sd1[k].dtype) == (sd0[k].shape, sd0[k].dtype), k
    assert [n for n, m in rank1.named_modules() if isinstance(m, NVFP4Linear)] == [
        n for n, m in rank0.named_modules() if isinstance(m, NVFP4Linear)]
    assert no_dense_linear_init == []


def test_bf16_model_path_with_quantized_twin(tiny_bf16, tiny_nvfp4, no_dense_linear_init):
    """qerl.quantized_checkpoint = the NVFP4 twin of a BF16 model.path: the actor is built from the twin."""
    module = FSDPEngine._build_module(fake_engine(tiny_bf16, quantized_checkpoint=tiny_nvfp4))
    assert no_dense_linear_init == []
    _check_against_checkpoint(module, tiny_nvfp4)


def test_bf16_model_path_alone_is_verls_path(tiny_bf16):
    module = FSDPEngine._build_module(fake_engine(tiny_bf16))
    assert not any(isinstance(m, NVFP4Linear) for m in module.modules())  # converted later, in hook 3
