"""The NVFP4 base sharded across FSDP2 ranks (``shard_nvfp4_base``) on CPU: 2 and 4 processes, gloo.

Every rank gets the same batch, so each rank's forward/backward is the single-process one: logits and
the gradient reaching the embeddings must be bit-identical to an unsharded model's (they involve no
cross-rank reduction); LoRA gradients pass through FSDP's reduce-scatter (a sum over ranks then a
division) and are compared exactly with the same run on a replicated base, and within rounding with
the single process. Also: each rank stores 1/N of the base bytes, a layer's gathered rows exist only
around its own forward/backward, verl's checkpoint manager resumes a sharded run exactly, and the full
state dict is the unsharded model's, bytes and all.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(path: str):
    from verl_qerl.modeling import get_lora_model, load_nvfp4_model

    model = load_nvfp4_model(path, dtype=torch.float32)
    model = get_lora_model(model, r=8, lora_alpha=16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # peft starts B at 0; make every path carry a gradient
        for name, p in sorted(model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _ids(step: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(2 + step))


def _decoder_layers(model):
    return model.base_model.model.model.layers


def _shard(model, *, base: bool, mp_dtype: torch.dtype | None = None) -> list:
    """verl's FSDP2 layout: (the base layers,) each decoder layer, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from verl_qerl.modeling.fsdp import shard_nvfp4_base

    layers = shard_nvfp4_base(model) if base else []
    policy = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32 if mp_dtype else None)
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return layers


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if t is not None and hasattr(t, "full_tensor") else t


def _forward_backward(model, layers=()) -> dict:
    """One forward/backward; logits, the gradient at the embedding output, LoRA grads, and (if
    ``layers``) the most layers holding gathered rows at any point of the forward and of the backward."""
    from verl_qerl.modeling.fsdp import gathered_layers

    seen = {"forward": 0, "backward": 0}
    handles = []

    def in_backward(_grad):
        seen["backward"] = max(seen["backward"], gathered_layers(layers))

    def pre(_module, _args):
        seen["forward"] = max(seen["forward"], gathered_layers(layers))

    def post(_module, _args, out):
        if out.requires_grad:
            out.register_hook(in_backward)

    for layer in layers:
        handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    emb = {}

    def keep(_module, _args, out):  # what verl's enable_input_require_grads does, plus keeping the grad
        out.requires_grad_(True)
        out.retain_grad()
        emb["out"] = out

    handles.append(model.get_input_embeddings().register_forward_hook(keep))
    out = model(input_ids=_ids(), labels=_ids())
    out.loss.backward()
    for h in handles:
        h.remove()
    grads = {n: _full(p.grad).clone() for n, p in model.named_parameters() if "lora_" in n}
    model.zero_grad(set_to_none=True)
    return {"logits": out.logits.detach().clone(), "emb_grad": emb["out"].grad.clone(), "lora_grads": grads,
            "gathered": seen, "after": gathered_layers(layers)}


def _train(model, steps: int, opt=None) -> tuple[list[float], torch.optim.Optimizer]:
    opt = opt or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=_ids(), labels=_ids()).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, opt


def _eval_loss(model) -> float:
    with torch.no_grad():
        return model(input_ids=_ids(1), labels=_ids(1)).loss.item()


def _checkpoint_manager(model, opt):
    from omegaconf import OmegaConf
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    cfg = OmegaConf.create({"save_contents": ["model", "optimizer", "extra"],
                            "load_contents": ["model", "optimizer", "extra"]})
    return FSDPCheckpointManager(model=model, optimizer=opt, lr_scheduler=None, processing_class=None,
                                 checkpoint_config=cfg)


def _worker(rank: int, world: int, path: str, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from verl_qerl.modeling.fsdp import base_bytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    out = Path(out_dir)
    result: dict = {}
    try:
        # the single-process model, run in this process (same threads, same kernels)
        ref = _build(path)
        ref_state = {k: v.clone() for k, v in ref.state_dict().items()}
        ref_fb = _forward_backward(ref)
        ref_losses = _train(ref, STEPS)[0] + [_eval_loss(ref)]

        # the base sharded, fp32 (no mixed precision: comparable bit for bit with the single process)
        model = _build(path)
        layers = _shard(model, base=True)
        result["bytes"] = base_bytes(layers)
        result["dtensor_base"] = all(type(layer.weight_packed).__name__ == "DTensor" for layer in layers)
        result["n_layers"] = len(layers)
        fb = _forward_backward(model, layers)
        result["logits_equal"] = torch.equal(fb["logits"], ref_fb["logits"])
        result["emb_grad_equal"] = torch.equal(fb["emb_grad"], ref_fb["emb_grad"])
        result["lora_grad_max_rel"] = max(
            ((fb["lora_grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
            for n, g in ref_fb["lora_grads"].items())
        result["gathered"] = fb["gathered"]
        result["gathered_after"] = fb["after"]
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        result["full_state_keys_equal"] = list(full) == list(ref_state)
        result["full_state_base_equal"] = all(
            full[k].dtype == ref_state[k].dtype and torch.equal(full[k], ref_state[k])
            for k in ref_state if "weight_packed" in k or "weight_scale" in k or "weight_global_scale" in k)
        losses, opt = _train(model, STEPS)
        result["losses"] = losses + [_eval_loss(model)]
        result["ref_losses"] = ref_losses

        # verl's layout with mixed precision (bf16 compute, fp32 reduce): sharded base == replicated base
        runs = {}
        for base in (True, False):
            m = _build(path)
            _shard(m, base=base, mp_dtype=torch.bfloat16)
            runs[base] = _train(m, STEPS)[0] + [_eval_loss(m)]
            if base:
                grads = _forward_backward(m)["lora_grads"]
            else:
                grads_rep = _forward_backward(m)["lora_grads"]
        result["mp_losses_sharded"], result["mp_losses_replicated"] = runs[True], runs[False]
        result["mp_lora_grads_equal"] = all(torch.equal(grads[n], grads_rep[n]) for n in grads_rep)

        # resume: 2 steps, verl checkpoint, 1 more step == a fresh model (its base zeroed first) loaded
        # from the checkpoint and stepped once
        model = _build(path)
        _shard(model, base=True)
        _, opt = _train(model, 2)
        mgr = _checkpoint_manager(model, opt)
        mgr.save_checkpoint(str(out / "ckpt"), global_step=2)
        cont = _train(model, 1, opt)[0] + [_eval_loss(model)]
        fresh = _build(path)
        fresh_layers = _shard(fresh, base=True)
        with torch.no_grad():
            for layer in fresh_layers:
                layer.weight_packed.to_local().zero_()
                layer.weight_scale.to_local().zero_()
        fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
        _checkpoint_manager(fresh, fresh_opt).load_checkpoint(str(out / "ckpt"))
        result["resume_losses"] = _train(fresh, 1, fresh_opt)[0] + [_eval_loss(fresh)]
        result["continued_losses"] = cont
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def _run(tiny_nvfp4, tmp_path_factory, world: int) -> list[dict]:
    out = tmp_path_factory.mktemp(f"fsdp_sharded_{world}")
    proc = subprocess.run([sys.executable, __file__, str(world), str(tiny_nvfp4), str(_free_port()), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def sharded(request, tiny_nvfp4, tmp_path_factory):
    return request.param, _run(tiny_nvfp4, tmp_path_factory, request.param)


@pytest.mark.skipif(sys.platform != "linux", reason="gloo multiprocess test written for Linux")
def test_sharded_forward_backward_is_bit_identical(sharded):
    world, results = sharded
    for r in results:
        assert r["dtensor_base"]
        assert r["logits_equal"], "logits differ from the single-process model"
        assert r["emb_grad_equal"], "the input gradient (backward through the base) differs"
        # the reduce-scatter sums N equal gradients and divides: rounding at most
        assert r["lora_grad_max_rel"] <= 1e-6, r["lora_grad_max_rel"]


@pytest.mark.skipif(sys.platform != "linux", reason="gloo multiprocess test written for Linux")
def test_sharded_losses_match_over_three_steps(sharded):
    world, results = sharded
    for r in results:
        for got, want in zip(r["losses"], r["ref_losses"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], r["ref_losses"])
        # with verl's bf16 mixed precision, sharding the base changes nothing at all
        assert r["mp_losses_sharded"] == r["mp_losses_replicated"]
        assert r["mp_lora_grads_equal"]
    assert all(r["losses"] == results[0]["losses"] for r in results)


@pytest.mark.skipif(sys.platform != "linux", reason="gloo multiprocess test written for Linux")
def test_each_rank_holds_one_nth_of_the_base(sharded):
    world, results = sharded
    for r in results:
        local, total = r["bytes"]["local"], r["bytes"]["total"]
        scales = 4 * r["n_layers"]  # the fp32 global scales stay replicated
        assert local == (total - scales) // world + scales, (local, total, world)
        assert local <= 0.51 * total if world == 2 else local <= 0.26 * total


@pytest.mark.skipif(sys.platform != "linux", reason="gloo multiprocess test written for Linux")
def test_gathered_rows_live_only_around_their_layer(sharded):
    _, results = sharded
    for r in results:
        # forward: the running layer (FSDP may have the next one in flight); backward: the running
        # layer and the one prefetched for the next step of the backward. A replicated base would be
        # every layer, all the time.
        assert 1 <= r["gathered"]["forward"] <= 2, r["gathered"]
        assert 1 <= r["gathered"]["backward"] <= 3, r["gathered"]
        assert r["n_layers"] >= 7 * 2
        assert r["gathered_after"] == 0


@pytest.mark.skipif(sys.platform != "linux", reason="gloo multiprocess test written for Linux")
def test_full_state_dict_and_resume_are_exact(sharded):
    _, results = sharded
    for r in results:
        assert r["full_state_keys_equal"], "gathered state dict keys differ from the unsharded model's"
        assert r["full_state_base_equal"], "gathered NVFP4 tensors differ (dtype or bytes) from the unsharded model's"
        assert r["resume_losses"] == r["continued_losses"], (r["resume_losses"], r["continued_losses"])


if __name__ == "__main__":
    world = int(sys.argv[1])
    mp.start_processes(_worker, args=(world, sys.argv[2], int(sys.argv[3]), sys.argv[4]), nprocs=world,
                       start_method="spawn", join=True)
