"""NVFP4 + LoRA under FSDP2 (and FSDP1) on CPU: 2 processes, gloo.

The quantized state is uint8 buffers, which neither FSDP version shards, casts or all-gathers;
LoRA adapters and the frozen float parameters (biases, norms, embeddings) are sharded as usual.
Each rank gets the same batch, so the averaged gradient equals the single-process one and the
losses of a two-step run must match a single-process run of the same model.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from verl_qerl.testing.gloo_workers import end_worker, worker_failure
from verl_qerl.testing.procs import free_port
from verl_qerl.testing.tiny import lora_nvfp4_model

WORLD = 2
GS_NAME = "model.layers.0.self_attn.q_proj.base_layer.weight_global_scale"




def _ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(2))


def _two_steps(model) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(2):
        loss = model(input_ids=_ids(), labels=_ids()).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    with torch.no_grad():
        losses.append(model(input_ids=_ids(), labels=_ids()).loss.item())
    return losses


def _buffers(model) -> dict[str, tuple[str, list[int], str]]:
    """Each NVFP4 buffer's dtype, shape and a digest of all its bytes (compared before and after wrapping)."""
    out = {}
    for name, b in model.named_buffers():
        name = name.replace("_fsdp_wrapped_module.", "").removeprefix("base_model.model.")
        if "weight_" in name:
            raw = b.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
            out[name] = (str(b.dtype), list(b.shape), hashlib.sha256(raw).hexdigest())
    return out


def _worker(rank: int, path: str, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    result: dict = {}
    try:
        # FSDP2: shard every decoder layer, then the root (verl's fsdp2 strategy)
        from torch.distributed.fsdp import fully_shard

        model = lora_nvfp4_model(path)
        before = _buffers(model)
        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        lora = [p for n, p in model.named_parameters() if "lora_A" in n][0]
        result["fsdp2_lora_is_sharded"] = type(lora).__name__ == "DTensor"
        result["fsdp2_losses"] = _two_steps(model)
        result["fsdp2_buffers_kept"] = _buffers(model) == before
        result["fsdp2_buffers"] = {k: v[0] for k, v in _buffers(model).items()}

        # FSDP1 with use_orig_params (mixed frozen/trainable units) and a bf16 buffer_dtype: float
        # buffers are cast, the uint8 NVFP4 state (the fp32 global scale stored as bytes) is not.
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
            from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

            model = lora_nvfp4_model(path)
            wrapped = FullyShardedDataParallel(
                model, auto_wrap_policy=ModuleWrapPolicy({Qwen2DecoderLayer}), use_orig_params=True,
                device_id=torch.device("cpu"), mixed_precision=MixedPrecision(buffer_dtype=torch.bfloat16))
            result["fsdp1_losses"] = _two_steps(wrapped)
            result["fsdp1_buffers_kept"] = _buffers(wrapped) == before
            result["fsdp1_error"] = None
        except Exception as exc:  # noqa: BLE001 - recorded and asserted on in the parent
            result["fsdp1_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    end_worker()


@pytest.fixture(scope="module")
def fsdp_results(tiny_nvfp4, tmp_path_factory):
    # Run this file as a script: spawned workers re-import ``__main__`` by path, which works whatever
    # pytest's import mode (tests/ is not a package).
    out = tmp_path_factory.mktemp("fsdp")
    proc = subprocess.run([sys.executable, __file__, str(tiny_nvfp4), str(free_port()), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, worker_failure(proc, out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def single_process_losses(tiny_nvfp4):
    torch.manual_seed(0)
    return _two_steps(lora_nvfp4_model(str(tiny_nvfp4)))


@pytest.mark.skipif(sys.platform != "linux", reason="gloo multiprocess test written for Linux")
def test_fsdp2_matches_single_process_and_keeps_buffers(fsdp_results, single_process_losses):
    for r in fsdp_results:
        assert r["fsdp2_lora_is_sharded"]
        assert r["fsdp2_buffers_kept"], "NVFP4 buffers changed dtype, shape or value under FSDP2"
        assert set(r["fsdp2_buffers"].values()) == {"torch.uint8"}
        assert GS_NAME in r["fsdp2_buffers"]
        # step 1 is the same forward; steps 2/3 follow the same averaged gradient and AdamW update
        for got, want in zip(r["fsdp2_losses"], single_process_losses, strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (r["fsdp2_losses"], single_process_losses)
    assert fsdp_results[0]["fsdp2_losses"] == fsdp_results[1]["fsdp2_losses"]


@pytest.mark.skipif(sys.platform != "linux", reason="gloo multiprocess test written for Linux")
def test_fsdp1_use_orig_params_keeps_the_uint8_state(fsdp_results, single_process_losses):
    for r in fsdp_results:
        assert r["fsdp1_error"] is None, r["fsdp1_error"]
        assert r["fsdp1_buffers_kept"], "FSDP1 buffer_dtype cast touched the NVFP4 state"
        # the rotary table (a float buffer) was cast to bf16 by buffer_dtype: close, not equal
        first = r["fsdp1_losses"][0]
        assert abs(first - single_process_losses[0]) <= 1e-2 * abs(single_process_losses[0])
        assert r["fsdp1_losses"][-1] < first  # it trains


if __name__ == "__main__":
    mp.start_processes(_worker, args=(sys.argv[1], int(sys.argv[2]), sys.argv[3]), nprocs=WORLD,
                       start_method="spawn", join=True)
