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
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from verl_qerl.testing.gloo_workers import end_worker, worker_failure
from verl_qerl.testing.procs import free_port
from verl_qerl.testing.scripts import load_script
from verl_qerl.testing.tiny import (
    TINY_SHAPE,
    lora_nvfp4_model,
)

STEPS = 3




def _ids(step: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(2 + step))


def _decoder_layers(model):
    return model.base_model.model.model.layers


def _shard(model, *, base: bool, mp_dtype: torch.dtype | None = None, offload: bool = False) -> list:
    """verl's FSDP2 layout: (the base layers,) each decoder layer, then the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from verl_qerl.modeling.fsdp import shard_nvfp4_base

    off = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
    layers = shard_nvfp4_base(model, offload_policy=off) if base else []
    policy = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32 if mp_dtype else None)
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=policy, offload_policy=off)
    fully_shard(model, mp_policy=policy, offload_policy=off)
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


def _misuse_errors(model, layer) -> dict[str, str]:
    """The messages of the misuses of a sharded base that must fail loudly (not compute on 1/N of the rows)."""
    from verl_qerl.modeling.fsdp import shard_nvfp4_base

    calls = {"dequantize_weight": layer.dequantize_weight,
             "direct_forward": lambda: layer.forward(torch.zeros(1, layer.in_features)),  # hooks bypassed
             "shard_twice": lambda: shard_nvfp4_base(model)}
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = "no error"
        except (RuntimeError, ValueError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


def _checkpoint_manager(model, opt):
    from omegaconf import OmegaConf
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    cfg = OmegaConf.create({"save_contents": ["model", "optimizer", "extra"],
                            "load_contents": ["model", "optimizer", "extra"]})
    return FSDPCheckpointManager(model=model, optimizer=opt, lr_scheduler=None, processing_class=None,
                                 checkpoint_config=cfg)


def _like_torch_2_11() -> None:
    """Make FSDP2 build its sharded parameters the way torch 2.11 does (the GPU stack): ``nn.Parameter(dtensor)``
    with the constructor's default ``requires_grad=True``, then ``requires_grad_``. For a uint8 tensor that
    constructor raises unless ``shard_nvfp4_base`` made the default ``False`` (pytorch/pytorch#177844)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    original = FSDPParam._init_sharded_param

    def init_sharded_param(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.sharded_param = torch.nn.Parameter(self.sharded_param.detach())  # torch 2.11's call
        self.sharded_param.requires_grad_(args[0].requires_grad if args else kwargs["param"].requires_grad)
        self._setattr_on_modules(self.sharded_param)

    FSDPParam._init_sharded_param = init_sharded_param


def _worker(rank: int, world: int, path: str, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    _like_torch_2_11()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from verl_qerl.modeling.fsdp import base_bytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    out = Path(out_dir)
    result: dict = {}
    try:
        # the single-process model, run in this process (same threads, same kernels)
        ref = lora_nvfp4_model(path)
        ref_state = {k: v.clone() for k, v in ref.state_dict().items()}
        ref_fb = _forward_backward(ref)
        ref_losses = _train(ref, STEPS)[0] + [_eval_loss(ref)]

        # the base sharded, fp32 (no mixed precision: comparable bit for bit with the single process)
        model = lora_nvfp4_model(path)
        layers = _shard(model, base=True)
        result["bytes"] = base_bytes(layers)
        result["dtensor_base"] = all(type(layer.weight_packed).__name__ == "DTensor" for layer in layers)
        result["n_layers"] = len(layers)
        result["errors"] = _misuse_errors(model, layers[0])
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

        # the same with gradient checkpointing (verl's default: the layer's forward runs again in backward)
        # and with FSDP2's CPU offload policy (shards on the host, copied in per layer)
        for variant in ("checkpointing", "offload"):
            model = lora_nvfp4_model(path)
            if variant == "checkpointing":
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            layers = _shard(model, base=True, offload=variant == "offload")
            fb = _forward_backward(model, layers)
            result[variant] = {"logits_equal": torch.equal(fb["logits"], ref_fb["logits"]),
                               "emb_grad_equal": torch.equal(fb["emb_grad"], ref_fb["emb_grad"]),
                               "gathered": fb["gathered"], "after": fb["after"]}

        # verl's layout with mixed precision (bf16 compute, fp32 reduce): sharded base == replicated base
        runs = {}
        for base in (True, False):
            m = lora_nvfp4_model(path)
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
        model = lora_nvfp4_model(path)
        _shard(model, base=True)
        _, opt = _train(model, 2)
        mgr = _checkpoint_manager(model, opt)
        mgr.save_checkpoint(str(out / "ckpt"), global_step=2)
        cont = _train(model, 1, opt)[0] + [_eval_loss(model)]
        fresh = lora_nvfp4_model(path)
        fresh_layers = _shard(fresh, base=True)
        with torch.no_grad():
            for layer in fresh_layers:
                for t in (layer.weight_packed, layer.weight_scale):
                    (t.to_local() if hasattr(t, "to_local") else t).zero_()
        fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
        _checkpoint_manager(fresh, fresh_opt).load_checkpoint(str(out / "ckpt"))
        result["resume_losses"] = _train(fresh, 1, fresh_opt)[0] + [_eval_loss(fresh)]
        result["continued_losses"] = cont
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    end_worker()


def _verl_engine(path: str, world: int, shard_base: bool):
    """verl's FSDPEngine build steps (``_build_module``, ``_build_lora_module``, ``_build_fsdp_module``,
    hooked by the plugin) on a stand-in engine with an FSDP2 config: model.path = the NVFP4 checkpoint,
    rank 0 builds it for real and the other ranks on meta (filled by verl's broadcast)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    from verl_qerl.verl.config import QeRLConfig

    model_config = SimpleNamespace(
        lora={"qerl": QeRLConfig(mode="nvfp4", shard_base=shard_base).to_dict()}, local_path=path, path=path,
        hf_config=AutoConfig.from_pretrained(path), model_type="language_model", trust_remote_code=False,
        use_liger=False, fused_kernel_options=None, use_fused_kernels=False, enable_gradient_checkpointing=False,
        enable_activation_offload=False, lora_rank=8, lora_alpha=16, target_parameters=None, exclude_modules=None,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_adapter_path=None, use_shm=False)
    engine_config = OmegaConf.create(dict(  # verl's defaults: bf16 params, fp32 reduce, reshard after forward
        model_dtype=None, forward_only=False, mixed_precision=None, wrap_policy={}, reshard_after_forward=True,
        strategy="fsdp2", offload_policy=False, forward_prefetch=False, use_orig_params=False))
    engine = SimpleNamespace(model_config=model_config, engine_config=engine_config, use_remove_padding=False,
                             device_mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)),
                             ulysses_sequence_parallel_size=1, _is_offload_param=False, _is_offload_optimizer=False)
    torch.manual_seed(0)  # the same LoRA initialization in both builds
    module = FSDPEngine._build_module(engine)
    module = FSDPEngine._build_lora_module(engine, module)
    return FSDPEngine._build_fsdp_module(engine, module)


def _verl_worker(rank: int, world: int, path: str, port: int, out_dir: str) -> None:
    os.environ["VERL_PLATFORM"] = "cpu"  # verl_qerl's CPU platform (gloo, torch.cpu)
    os.environ["VERL_QERL_QUIET"] = "1"
    import torch.distributed as dist

    _like_torch_2_11()

    from verl_qerl.modeling.fsdp import base_bytes, nvfp4_layers
    from verl_qerl.nvfp4.checkpoint import CheckpointReader

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    result: dict = {}
    try:
        reader = CheckpointReader(path)
        runs = {}
        for shard_base in (True, False):
            model = _verl_engine(path, world, shard_base)
            layers = nvfp4_layers(model)
            result[f"bytes_{shard_base}"] = base_bytes(m for _, m in layers)
            result[f"dtensor_{shard_base}"] = all(type(m.weight_packed).__name__ == "DTensor" for _, m in layers)
            if shard_base:  # every rank's rows, gathered, are the checkpoint's bytes (rank 0 real, others meta)
                result["base_matches_checkpoint"] = len(layers) == 14 and all(
                    torch.equal(_full(m.weight_packed), reader.get(f"{_plain_name(n)}.weight_packed"))
                    and torch.equal(_full(m.weight_scale).view(torch.float8_e4m3fn),
                                    reader.get(f"{_plain_name(n)}.weight_scale"))
                    for n, m in layers)
            out = model(input_ids=_ids(), labels=_ids())
            out.loss.backward()
            runs[shard_base] = (out.logits.detach(), {n: _full(p.grad) for n, p in model.named_parameters()
                                                      if p.grad is not None})
        result["logits_equal"] = torch.equal(runs[True][0], runs[False][0])
        result["grads_equal"] = runs[True][1].keys() == runs[False][1].keys() and all(
            torch.equal(g, runs[False][1][n]) for n, g in runs[True][1].items())
        result["n_grads"] = len(runs[True][1])
    finally:
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    end_worker()


def _plain_name(name: str) -> str:
    """The checkpoint name of a module of the peft model (``base_model.model.`` and ``.base_layer`` off)."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def _run(tiny_nvfp4, tmp_path_factory, world: int, mode: str = "fsdp2") -> list[dict]:
    out = tmp_path_factory.mktemp(f"fsdp_sharded_{mode}_{world}")
    proc = subprocess.run([sys.executable, __file__, mode, str(world), str(tiny_nvfp4), str(free_port()), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, worker_failure(proc, out)
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
        for variant in ("checkpointing", "offload"):
            v = r[variant]
            assert v["logits_equal"] and v["emb_grad_equal"], (variant, v)
            assert v["after"] == 0, (variant, v)
        # recomputing a decoder layer in backward gathers its 7 projections (FSDP keeps what is gathered
        # during backward until each one's own backward is done): one decoder layer of 2 at the peak
        assert r["checkpointing"]["gathered"]["backward"] <= 7 + 1, r["checkpointing"]


@pytest.mark.skipif(sys.platform != "linux", reason="gloo multiprocess test written for Linux")
def test_misuse_of_a_sharded_layer_fails_loudly(sharded):
    errors = sharded[1][0]["errors"]
    name = "dequantize_weight"
    assert errors[name].startswith("NVFP4FormatError") and "sharded by FSDP2" in errors[name], errors[name]
    assert errors["direct_forward"].startswith("RuntimeError") and "all-gathered first" in errors["direct_forward"]
    assert errors["shard_twice"].startswith("ValueError") and "already an FSDP2 module" in errors["shard_twice"]


def test_store_as_parameters_keeps_the_state_dict(tiny_nvfp4):
    from verl_qerl.modeling import NVFP4Linear, load_nvfp4_model
    from verl_qerl.modeling.fsdp import nvfp4_layers, shard_nvfp4_base
    from verl_qerl.nvfp4 import NVFP4Weight

    model = load_nvfp4_model(str(tiny_nvfp4), dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    layer = model.model.layers[0].self_attn.q_proj
    y = layer(x)
    for _, m in nvfp4_layers(model):
        m.store_as_parameters()
        m.store_as_parameters()  # idempotent
    assert layer.stores_parameters and not layer.is_sharded
    assert not layer.weight_packed.requires_grad and layer.weight_packed.dtype == torch.uint8
    model.to(torch.bfloat16).to(torch.float32)  # module casts leave integer parameters alone
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert torch.equal(layer(x), y)
    layer.set_nvfp4(NVFP4Weight(layer.weight_packed, layer.scale_fp8, layer.global_scale))  # still settable,
    # still a Parameter
    assert isinstance(layer._parameters["weight_packed"], torch.nn.Parameter) and torch.equal(layer(x), y)
    with pytest.raises(ValueError, match="no NVFP4Linear"):
        shard_nvfp4_base(torch.nn.Linear(4, 4))
    assert isinstance(layer, NVFP4Linear)


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
    memory_table = load_script("benchmarks/memory_table.py", "memory_table")
    for r in results:
        local, total = r["bytes"]["local"], r["bytes"]["total"]
        scales = 4 * r["n_layers"]  # the fp32 global scales stay replicated
        assert local == (total - scales) // world + scales, (local, total, world)
        assert local <= 0.51 * total if world == 2 else local <= 0.26 * total
        # the formula of benchmarks/memory_table.py (the README's per-rank table) is what a rank holds
        assert local == memory_table.base_bytes_per_rank({**TINY_SHAPE, "vocab_size": 512}, world)["qerl"]


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


@pytest.mark.skipif(sys.platform != "linux", reason="gloo multiprocess test written for Linux")
def test_verl_fsdp2_engine_shards_the_base(tiny_nvfp4, tmp_path_factory):
    pytest.importorskip("verl")
    results = _run(tiny_nvfp4, tmp_path_factory, 2, mode="verl")
    for r in results:
        assert r["dtensor_True"] and not r["dtensor_False"]  # qerl.shard_base=false keeps today's buffers
        assert r["bytes_True"]["total"] == r["bytes_False"]["total"] == r["bytes_False"]["local"]
        assert r["bytes_True"]["local"] <= 0.51 * r["bytes_True"]["total"]
        assert r["base_matches_checkpoint"], "verl's broadcast did not fill the sharded base with the checkpoint"
        assert r["logits_equal"] and r["grads_equal"] and r["n_grads"] > 0


@pytest.mark.skipif(sys.platform != "linux", reason="gloo multiprocess test written for Linux")
def test_verl_fsdp2_engine_keeps_the_base_whole_on_one_rank(tiny_nvfp4, tmp_path_factory):
    """One rank: sharding saves nothing, and each NVFP4Linear as an FSDP2 unit costs 2-6 % of a 7B training step
    (benchmarks/train_step.py --fsdp2, NOTES), so qerl.shard_base=true keeps the base in buffers there."""
    pytest.importorskip("verl")
    (r,) = _run(tiny_nvfp4, tmp_path_factory, 1, mode="verl")
    assert not r["dtensor_True"] and not r["dtensor_False"]
    assert r["bytes_True"] == r["bytes_False"] and r["bytes_True"]["local"] == r["bytes_True"]["total"]
    assert r["base_matches_checkpoint"]
    assert r["logits_equal"] and r["grads_equal"] and r["n_grads"] > 0


if __name__ == "__main__":
    worker = {"fsdp2": _worker, "verl": _verl_worker}[sys.argv[1]]
    world = int(sys.argv[2])
    mp.start_processes(worker, args=(world, sys.argv[3], int(sys.argv[4]), sys.argv[5]), nprocs=world,
                       start_method="spawn", join=True)
