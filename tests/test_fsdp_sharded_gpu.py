"""The sharded NVFP4 base on the GPU stack (torch's own FSDP2 build there, NCCL, the CUDA kernels): one process.

A world of one still runs every piece the CPU tests check on gloo: the frozen uint8 parameters built by that
torch's ``fully_shard`` (torch 2.11 builds them with a ``requires_grad=True`` default, see
``verl_qerl.modeling.fsdp``), the NCCL all-gather of the bytes into the layer before its forward and again
for its backward, the free after. Logits and the gradient at the embedding output must equal the unsharded
model's bit for bit, with gradient checkpointing as verl runs it.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _model(path: str, checkpointing: bool):
    from verl_qerl.modeling import get_lora_model, load_nvfp4_model

    model = load_nvfp4_model(path, dtype=torch.float32).cuda()
    model = get_lora_model(model, r=8, lora_alpha=16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g).cuda() * 0.05)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _run(model) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(2)).cuda()
    emb = {}

    def keep(_module, _args, out):
        out.requires_grad_(True)
        out.retain_grad()
        emb["out"] = out

    handle = model.get_input_embeddings().register_forward_hook(keep)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    handle.remove()
    return out.logits.detach(), emb["out"].grad


@pytest.fixture
def nccl_world_of_one():
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_sharded_base_on_nccl_is_bit_identical(tiny_nvfp4, nccl_world_of_one, checkpointing):
    from torch.distributed.fsdp import fully_shard

    from verl_qerl.modeling.fsdp import base_bytes, gathered_layers, shard_nvfp4_base

    want = _run(_model(str(tiny_nvfp4), checkpointing))
    model = _model(str(tiny_nvfp4), checkpointing)
    layers = shard_nvfp4_base(model)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert all(type(m.weight_packed).__name__ == "DTensor" and m.weight_packed.dtype == torch.uint8 for m in layers)
    got = _run(model)
    assert torch.equal(got[0], want[0]), "logits differ from the unsharded model"
    assert torch.equal(got[1], want[1]), "the input gradient (backward through the base) differs"
    assert gathered_layers(layers) == 0
    counts = base_bytes(layers)
    assert counts["local"] == counts["total"]  # a world of one holds everything
