"""The `qerl` config block, the verl hooks and the qerl_sync trainer on CPU (no Ray, no GPU)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

os.environ.setdefault("VERL_QERL_QUIET", "1")
import verl  # noqa: E402, F401  (required in CI: a missing verl must fail, not skip)

from verl_qerl.testing.ppo_config import composed  # noqa: E402
from verl_qerl.verl.config import (  # noqa: E402
    TRAINER_MODE,
    QeRLConfig,
    QeRLConfigError,
    apply_qerl,
    read_qerl,
)
from verl_qerl.vllm import STANDALONE_WORKER_EXTENSION, VERL_WORKER_EXTENSION  # noqa: E402


def test_hydra_group_composes_and_fills_in_what_the_mode_needs():
    cfg = composed("+qerl=nvfp4")
    qerl = apply_qerl(cfg)
    assert qerl is not None and qerl.mode == "nvfp4" and qerl.aqn.enable and qerl.aqn.num_stages == 10
    vk = cfg.actor_rollout_ref.rollout.engine_kwargs.vllm
    assert vk.quantization == "qerl_nvfp4" and vk.worker_extension_cls == VERL_WORKER_EXTENSION
    assert cfg.actor_rollout_ref.rollout.load_format == "safetensors"
    assert cfg.trainer.v1.trainer_mode == TRAINER_MODE
    assert list(cfg.actor_rollout_ref.model.target_modules) == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # the block reaches the workers through the free-form model.lora dict
    assert cfg.actor_rollout_ref.model.lora.qerl.mode == "nvfp4"
    assert read_qerl({"actor_rollout_ref": {"model": {"lora": {"qerl": qerl.to_dict()}}}}) == qerl


def test_verl_accepts_the_result():
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.config import HFModelConfig, RolloutConfig  # noqa: F401

    cfg = composed("+qerl=nvfp4")
    # the patched validate_config applies the block first, then verl's own checks run and pass
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.quantization == "qerl_nvfp4"
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert rollout.engine_kwargs["vllm"]["worker_extension_cls"] == VERL_WORKER_EXTENSION
    assert dict(cfg.actor_rollout_ref.model.lora)["qerl"]["aqn"]["sigma_end"] == 5e-4


def test_worker_extension_names_resolve_to_classes_vllm_accepts():
    """What apply_qerl hands vLLM as ``worker_extension_cls``, resolved the way vLLM's workers resolve it: a
    class with QeRL's AQN methods that still is verl's extension (verl's server installs that one unless
    ``engine_kwargs`` replace it; without it no LoRA adapter reaches vLLM). The plain-vLLM one resolves too."""
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from verl_qerl.vllm.worker_extension import QeRLWorkerExtension

    cfg = composed("+qerl=nvfp4")
    apply_qerl(cfg)
    under_verl = resolve_obj_by_qualname(cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls)
    assert isinstance(under_verl, type)
    assert issubclass(under_verl, vLLMColocateWorkerExtension) and issubclass(under_verl, QeRLWorkerExtension)
    standalone = resolve_obj_by_qualname(STANDALONE_WORKER_EXTENSION)
    assert isinstance(standalone, type) and issubclass(standalone, QeRLWorkerExtension)
    assert not issubclass(standalone, vLLMColocateWorkerExtension)  # needs no verl


@pytest.mark.parametrize("group", ["bf16", "nf4", "nvfp4_noaqn"])
def test_other_groups(group):
    cfg = composed(f"+qerl={group}")
    qerl = apply_qerl(cfg)
    assert not qerl.aqn.enable
    quant = cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.get("quantization")
    assert quant == {"bf16": None, "nf4": "bitsandbytes", "nvfp4_noaqn": "qerl_nvfp4"}[group]


def test_no_block_changes_nothing():
    cfg = composed()
    before = str(cfg)
    assert apply_qerl(cfg) is None and str(cfg) == before


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["actor_rollout_ref.model.lora_rank=0"], r"lora_rank=0 .*set a rank > 0"),
        (["actor_rollout_ref.rollout.name=sglang"], r"rollout.name='sglang'.*vLLM"),
        (["qerl.mode=int8"], r"qerl.mode='int8': unknown mode"),
        (["+qerl.typo=1"], r"qerl.typo: unknown key"),
        (["qerl.aqn.num_stages=2"], r"qerl.aqn: .*num_stages"),
        (["qerl.aqn.sigma_end=0"], r"qerl.aqn: .*sigma_end"),
        (["qerl.aqn.schedule=sawtooth"], r"qerl.aqn: .*schedule"),
        (["+actor_rollout_ref.rollout.engine_kwargs.vllm.quantization=fp8"], r"quantization='fp8' conflicts"),
        (["actor_rollout_ref.rollout.quantization=fp8"], r"rollout.quantization='fp8': leave it null"),
        (["actor_rollout_ref.model.lora.merge=true"], r"cannot be merged into a 4-bit base"),
        (["trainer.v1.trainer_mode=separate_async"], r"trainer_mode='separate_async'"),
        (["trainer.use_v1=false"], r"use_v1=false"),
        (["qerl.aqn.apply_to=both"], r"qerl.aqn: apply_to: 'both' is not supported: AQN perturbs the rollout"),
        (["qerl.ignore=['lm_head','re:((']"], r"qerl.ignore: 're:\(\(' is not a valid regular expression"),
        (["qerl.ignore=[3]"], r"qerl.ignore: 3 is not a module name pattern"),
        (["qerl.ignore=5"], r"qerl.ignore=5: expected a list of module name patterns"),
        (["actor_rollout_ref.model.lora_rank=0", "actor_rollout_ref.model.lora.rank=32"],
         r"actor_rollout_ref.model.lora.rank=32 but actor_rollout_ref.model.lora_rank=0: verl's FSDP engine reads "
         r"lora_rank only"),
        (["qerl.aqn=true"], r"qerl.aqn=True: expected a block of AQN settings"),
        (["actor_rollout_ref.model.lora_rank=abc"], r"actor_rollout_ref.model.lora_rank='abc': must be an integer"),
        (["actor_rollout_ref.model.lora_rank=8.5"], r"actor_rollout_ref.model.lora_rank=8.5: must be an integer"),
        (["qerl.aqn.sigma_end=0.02"], r"qerl.aqn: sigma_end: 0.02 is above sigma_start=0.01"),
        (["trainer.total_training_steps=2"],
         r"trainer.total_training_steps=2 is fewer than qerl.aqn.num_stages=10"),
        (["+qerl.aqn.total_steps=5"], r"qerl.aqn: total_steps: 5 is fewer than num_stages=10"),
        (["qerl.scale_rule=ct019"], r"qerl.scale_rule='ct019': unknown NVFP4 scale rule; choose one of bf16, fp32"),
        (["qerl.scale_rule=fp32", "+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides.quantization_config"
          ".scale_rule=bf16"], r"hf_overrides.quantization_config=.* conflicts with qerl.scale_rule=fp32"),
    ],
)
def test_invalid_combinations_fail_with_the_key(overrides, match):
    cfg = composed("+qerl=nvfp4", *overrides)
    with pytest.raises(QeRLConfigError, match=match):
        apply_qerl(cfg)


def test_enough_steps_or_no_aqn_pass():
    assert apply_qerl(composed("+qerl=nvfp4", "trainer.total_training_steps=10")).aqn.num_stages == 10
    assert not apply_qerl(composed("+qerl=nvfp4_noaqn", "trainer.total_training_steps=1")).aqn.enable
    assert apply_qerl(composed("+qerl=nvfp4", "actor_rollout_ref.model.lora_rank=16")) is not None


def test_a_run_shorter_than_the_stages_warns_when_the_trainer_knows_its_length(caplog):
    from verl_qerl.verl.trainer import AQNDriver

    qerl = apply_qerl(composed("+qerl=nvfp4"))  # total steps come from the data set: unknown at config time
    with caplog.at_level("WARNING", logger="verl_qerl"):
        AQNDriver(qerl, 4, lambda: [])
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("4 training steps" in m and "qerl.aqn.num_stages=10" in m and "trainer.total_training_steps" in m
               for m in warned), warned
    caplog.clear()
    with caplog.at_level("WARNING", logger="verl_qerl"):
        AQNDriver(qerl, 10, lambda: [])
    assert not [r for r in caplog.records if "num_stages" in r.getMessage()]


def test_aqn_total_steps_spans_the_schedule_and_noise_needs_a_server():
    """qerl.aqn.total_steps was validated and then ignored (the trainer's length always won); and with no rollout
    server the driver logged sigma > 0 although the noise reached nothing."""
    from verl_qerl.verl.trainer import AQNDriver

    qerl = apply_qerl(composed("+qerl=nvfp4", "+qerl.aqn.total_steps=100"))
    driver = AQNDriver(qerl, 600, lambda: [])
    assert driver.total_steps == 100 and driver.sigma(150) == qerl.aqn.sigma_end  # past the user's 100 steps
    assert AQNDriver(apply_qerl(composed("+qerl=nvfp4")), 600, lambda: []).total_steps == 600
    with pytest.raises(RuntimeError, match="AQN qerl_aqn_apply: the trainer has no vLLM rollout server"):
        driver.apply(50)


def test_a_bad_config_json_at_model_path_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(QeRLConfigError, match=f"{tmp_path / 'config.json'}: not valid JSON"):
        apply_qerl(composed("+qerl=nvfp4", f"actor_rollout_ref.model.path={tmp_path}"))


def _tiny_rollout_model():
    """A small Qwen2 standing in for a vLLM worker's model: the RMSNorm parameter names AQN selects by."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at exactly 1; make them distinct so "changed" means something
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape))
    return model


def test_trainer_mode_is_registered_and_drives_aqn_per_step():
    """The qerl_sync trainer against stand-in rollout servers whose ``collective_rpc`` runs the real worker
    extension on a small model: the configured AQN targets / final norm / rounding / seed must be what the
    rollout side's noiser uses, and the noise must land on exactly those norms."""
    import torch
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from verl_qerl.aqn import AQNConfig, NormNoiser
    from verl_qerl.vllm.worker_extension import QeRLWorkerExtension

    cls = get_trainer_cls(TRAINER_MODE)
    assert issubclass(cls, PPOTrainerSync)

    calls: list[tuple] = []  # every call of every step, in order (never cleared)

    class FakeWorker(QeRLWorkerExtension):
        def __init__(self):
            model = _tiny_rollout_model()
            self.model_runner = SimpleNamespace(get_model=lambda: model)

    class FakeRemote:
        def __init__(self, name, server, fn):
            self.name, self.server, self.fn = name, server, fn

        def remote(self, *args, **kwargs):
            calls.append((self.server, self.name, args, kwargs, FakeServer.step))
            return self.fn(*args, **kwargs)

    class FakeServer:
        step = 0

        def __init__(self, i):
            self.worker = FakeWorker()
            rpc = lambda method, kwargs=None: getattr(self.worker, method)(**(kwargs or {}))  # noqa: E731
            self.collective_rpc = FakeRemote("collective_rpc", i, rpc)
            self.clear_kv_cache = FakeRemote("clear_kv_cache", i, lambda: None)

    import ray

    cfg = composed("+qerl=nvfp4", "qerl.aqn.seed=5", "+qerl.aqn.targets=[post_attention_layernorm]",
                   "+qerl.aqn.include_final_norm=true", "+qerl.aqn.rounding=nearest")
    apply_qerl(cfg)
    trainer = cls.__new__(cls)
    trainer.trainer_mode = cfg.trainer.v1.trainer_mode  # what verl's __init__ does
    assert trainer.trainer_mode == "sync"  # verl's sync/async branches compare with the literal "sync"
    trainer.config = cfg
    trainer.total_training_steps = 20
    servers = [FakeServer(0), FakeServer(1), FakeServer(2)]
    trainer.llm_server_manager = SimpleNamespace(
        rollout_replicas=[SimpleNamespace(servers=servers[:2]), SimpleNamespace(servers=servers[2:])])
    clean = {n: p.detach().clone() for n, p in servers[0].worker.model_runner.get_model().named_parameters()
             if n.endswith("norm.weight")}
    want = {"model.layers.0.post_attention_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
            "model.norm.weight"}
    orig_get = ray.get
    ray.get = lambda refs, **k: refs
    try:
        sigmas = {}
        for step in (1, 2, 3, 10, 20):
            FakeServer.step = step
            trainer.global_steps = step
            trainer._pending_sync_metrics = {}
            trainer.on_step_begin()
            m = trainer._pending_sync_metrics
            sigmas[step] = m["qerl/aqn_sigma"]
            now = [c for c in calls if c[4] == step]
            if step <= 2:  # stage 0 (steps 1-2 of 20 with 10 stages) is noise-free: no call needed
                assert m["qerl/aqn_stage"] == 0 and m["qerl/aqn_sigma"] == 0.0
                assert not [c for c in now if c[1] == "collective_rpc"]
            else:
                rpcs = [c for c in now if c[1] == "collective_rpc" and c[2][0] != "qerl_aqn_setup"]
                assert sorted(c[0] for c in rpcs) == [0, 1, 2]  # every server of every replica
                assert all(c[2][0] == "qerl_aqn_apply" and c[3]["kwargs"]["sigma"] == m["qerl/aqn_sigma"]
                           and c[3]["kwargs"]["step"] == step for c in rpcs)
                assert sorted(c[0] for c in now if c[1] == "clear_kv_cache") == [0, 1, 2]
        # the clean snapshot is taken once per server, at the first noisy step, before its first apply,
        # with the configured AQN settings
        setups = [c for c in calls if c[1] == "collective_rpc" and c[2][0] == "qerl_aqn_setup"]
        assert sorted(c[0] for c in setups) == [0, 1, 2] and {c[4] for c in setups} == {3}
        first_apply = min(i for i, c in enumerate(calls) if c[1] == "collective_rpc" and c[2][0] == "qerl_aqn_apply")
        assert all(calls.index(c) < first_apply for c in setups)
        assert all(c[3]["kwargs"] == {"seed": 5, "targets": ["post_attention_layernorm"], "include_final_norm": True,
                                      "rounding": "nearest"} for c in setups)
        # ... and they reach the rollout side: each worker's noiser targets those norms with that rounding and
        # seed, and holds the noise of the last step (20) on exactly those norms, as the AQN library computes it
        expected = {n: t.clone() for n, t in clean.items()}
        NormNoiser.from_config(expected.items(), AQNConfig(seed=5, targets=("post_attention_layernorm",),
                                                           include_final_norm=True, rounding="nearest")
                               ).apply(20, sigmas[20])
        for srv in servers:
            assert set(srv.worker._qerl_noiser.names) == want
            assert srv.worker._qerl_noiser_key == (5, ("post_attention_layernorm",), True, "nearest")
            held = dict(srv.worker.model_runner.get_model().named_parameters())
            for name, value in clean.items():
                assert torch.equal(held[name], expected[name]), name
                assert torch.equal(held[name], value) == (name not in want), name
        assert sigmas[3] == pytest.approx(1e-2) and sigmas[20] == pytest.approx(5e-4)
        # validation removes the noise, then puts it back
        calls.clear()
        trainer.on_validate_begin()
        assert {c[2][0] for c in calls if c[1] == "collective_rpc"} == {"qerl_aqn_restore"}
        held = dict(servers[1].worker.model_runner.get_model().named_parameters())
        assert all(torch.equal(held[n], v) for n, v in clean.items())
        calls.clear()
        trainer.on_validate_end()
        assert {c[2][0] for c in calls if c[1] == "collective_rpc"} == {"qerl_aqn_apply"}
        held = dict(servers[1].worker.model_runner.get_model().named_parameters())
        assert all(torch.equal(held[n], expected[n]) for n in clean)
    finally:
        ray.get = orig_get


def test_fsdp_engine_hook_makes_nvfp4_layers_with_lora(tiny_bf16):
    """The patched FSDPEngine._build_lora_module (verl's own code after our conversion) on a tiny Qwen2."""
    import torch
    from transformers import AutoModelForCausalLM
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    from verl_qerl.modeling import NVFP4Linear

    assert getattr(FSDPEngine._build_lora_module, "_qerl_wrapped", False)
    cfg = composed("+qerl=nvfp4", "actor_rollout_ref.model.lora_rank=8")
    apply_qerl(cfg)
    m = cfg.actor_rollout_ref.model
    model_config = SimpleNamespace(
        lora=dict(m.lora), lora_rank=8, lora_alpha=16, target_modules=list(m.target_modules), target_parameters=None,
        exclude_modules=None, lora_adapter_path=None, use_shm=False)
    fake_engine = SimpleNamespace(model_config=model_config)
    module = AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.float32)  # verl trains in fp32
    peft_model = FSDPEngine._build_lora_module(fake_engine, module)
    layers = {n: mod for n, mod in peft_model.named_modules() if isinstance(mod, NVFP4Linear)}
    assert len(layers) == 14  # 2 layers x q,k,v,o,gate,up,down; lm_head stays dense
    assert all(".base_layer" in n for n in layers)  # each wrapped by a peft LoRA layer
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {b.dtype for n, b in peft_model.named_buffers() if "weight_" in n} == {torch.uint8}
    # plain LoRA (no qerl block): verl's path is untouched
    plain = SimpleNamespace(model_config=SimpleNamespace(**{**vars(model_config), "lora": {}}))
    dense = FSDPEngine._build_lora_module(plain, AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.float32))
    assert not any(isinstance(mod, NVFP4Linear) for mod in dense.modules())


def test_a_quantized_checkpoint_that_is_not_a_folder_is_refused_at_the_driver(tiny_bf16, tmp_path, caplog):
    path = f"actor_rollout_ref.model.path={tiny_bf16}"
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    for bad in (notes, tmp_path):  # a file; a folder without config.json
        with pytest.raises(QeRLConfigError, match=rf"qerl.quantized_checkpoint='{bad}': not a checkpoint folder"):
            apply_qerl(composed("+qerl=nvfp4", path, f"qerl.quantized_checkpoint={bad}"))
    with caplog.at_level("WARNING"):
        apply_qerl(composed("+qerl=nvfp4", path, f"qerl.quantized_checkpoint={tmp_path / 'elsewhere'}"))
    assert "does not exist on the driver" in caplog.text


@pytest.mark.parametrize("ignore", ["[lm_head,down_proj]", "[]"])
def test_nf4_refuses_an_ignore_list_vllm_would_not_follow(ignore):
    with pytest.raises(QeRLConfigError, match=r"with qerl.mode=nf4: vLLM's bitsandbytes keeps only its own default"):
        apply_qerl(composed("+qerl=nf4", f"qerl.ignore={ignore}"))
    assert apply_qerl(composed("+qerl=nf4")).ignore == ("lm_head",)


def test_a_qerl_value_that_is_not_a_block_is_named():
    # a group's name as a string: hydra did not find the group (the plugin scan missed it)
    with pytest.raises(QeRLConfigError, match=r"qerl='nvfp4': hydra did not find verl-qerl's `qerl` config group"):
        QeRLConfig.from_dict("nvfp4")
    with pytest.raises(QeRLConfigError, match=r"qerl='fp4': expected a block of settings"):
        QeRLConfig.from_dict("fp4")


def test_ignore_patterns_are_checked_against_the_model(tiny_bf16):
    """A qerl.ignore pattern that keeps no layer (a misspelling) or splits a fused q/k/v or gate/up layer is refused:
    at the driver where model.path's config.json is local, else by the actor hook on the built model."""
    import torch
    from transformers import AutoModelForCausalLM
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    path = f"actor_rollout_ref.model.path={tiny_bf16}"
    with pytest.raises(QeRLConfigError, match=r"qerl.ignore: 'donw_proj' matches no Linear layer of the model"):
        apply_qerl(composed("+qerl=nvfp4", path, "qerl.ignore=[lm_head,donw_proj]"))
    with pytest.raises(QeRLConfigError, match=r"qerl.ignore: keeps .*gate_proj in BF16 but not .*up_proj"):
        apply_qerl(composed("+qerl=nvfp4", path, "qerl.ignore=[lm_head,gate_proj]"))
    assert apply_qerl(composed("+qerl=nvfp4", path, "qerl.ignore=[lm_head,down_proj]")).ignore == ("lm_head",
                                                                                                 "down_proj")
    # a model.path the driver cannot read (hub id): the actor hook refuses it on the model it built
    cfg = composed("+qerl=nvfp4", "actor_rollout_ref.model.lora_rank=8", "qerl.ignore=[lm_head,donw_proj]")
    apply_qerl(cfg)
    m = cfg.actor_rollout_ref.model
    engine = SimpleNamespace(model_config=SimpleNamespace(
        lora=dict(m.lora), lora_rank=8, lora_alpha=16, target_modules=list(m.target_modules), target_parameters=None,
        exclude_modules=None, lora_adapter_path=None, use_shm=False))
    with pytest.raises(QeRLConfigError, match="'donw_proj' matches no Linear layer"):
        FSDPEngine._build_lora_module(engine, AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.float32))


@pytest.mark.parametrize("group", ["bf16", "nf4"])
def test_nvfp4_model_path_is_refused_for_modes_that_train_from_bf16(group, tiny_nvfp4):
    cfg = composed(f"+qerl={group}", f"actor_rollout_ref.model.path={tiny_nvfp4}")
    with pytest.raises(QeRLConfigError, match=r"actor_rollout_ref.model.path=.* is an NVFP4 checkpoint "
                                              rf"\(compressed-tensors\), but qerl.mode={group}"):
        apply_qerl(cfg)


def test_nvfp4_model_path_is_the_nvfp4_base(tiny_nvfp4, tiny_bf16):
    cfg = composed("+qerl=nvfp4", f"actor_rollout_ref.model.path={tiny_nvfp4}")
    qerl = apply_qerl(cfg)
    assert qerl.quantized_checkpoint is None
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.quantization == "qerl_nvfp4"
    # naming the same folder again is fine; a second, different source is not
    path, twin = f"actor_rollout_ref.model.path={tiny_nvfp4}", f"qerl.quantized_checkpoint={tiny_nvfp4}"
    cfg = composed("+qerl=nvfp4", path, twin)
    apply_qerl(cfg)
    cfg = composed("+qerl=nvfp4", path, f"qerl.quantized_checkpoint={tiny_bf16}")
    with pytest.raises(QeRLConfigError, match=r"qerl.quantized_checkpoint=.* is already an NVFP4 checkpoint"):
        apply_qerl(cfg)
    # a BF16 model.path with its NVFP4 twin (the other way) still passes
    cfg = composed("+qerl=nvfp4", f"actor_rollout_ref.model.path={tiny_bf16}", twin)
    assert apply_qerl(cfg).quantized_checkpoint == str(tiny_nvfp4)


def test_actor_hook_checks_the_nvfp4_source_as_the_driver_does(tiny_nvfp4, tiny_bf16, monkeypatch):
    """The worker-side choice of the NVFP4 source (on verl's local copy of model.path) runs the driver's check:
    the same refusal, and the same folder written another way (``~``) is the same folder."""
    from verl_qerl.verl.integration import nvfp4_actor_source

    def source(path, twin):
        qerl = QeRLConfig(mode="nvfp4", quantized_checkpoint=None if twin is None else str(twin))
        return nvfp4_actor_source(SimpleNamespace(lora={"qerl": qerl.to_dict()}, local_path=str(path), path=str(path)))

    with pytest.raises(QeRLConfigError, match=r"qerl.quantized_checkpoint=.* is already an NVFP4 checkpoint"):
        source(tiny_nvfp4, tiny_bf16)
    monkeypatch.setenv("HOME", str(tiny_nvfp4.parent))
    assert source(tiny_nvfp4, f"~/{tiny_nvfp4.name}") == str(tiny_nvfp4)
    assert source(tiny_nvfp4, None) == str(tiny_nvfp4)
    assert source(tiny_bf16, tiny_nvfp4) == str(tiny_nvfp4)  # a BF16 model.path with its NVFP4 twin
    assert source(tiny_bf16, None) is None  # verl loads BF16, the actor quantizes it


def test_verl_model_config_reads_an_nvfp4_model_path(tiny_nvfp4):
    """verl's own HFModelConfig on the NVFP4 folder: config (with its quantization_config) and tokenizer load."""
    from verl.workers.config import HFModelConfig

    mc = HFModelConfig(path=str(tiny_nvfp4))
    assert mc.hf_config.quantization_config["quant_method"] == "compressed-tensors"
    assert mc.tokenizer is not None and mc.hf_config.model_type == "qwen2"


@pytest.mark.parametrize("extra, expected", [((), 0.1), (("qerl.replay_poll_s=0.5",), 0.5)])
def test_qerl_trainer_polls_finished_rollouts_faster_than_verls_2s(extra, expected, monkeypatch):
    """verl's sync ReplayBuffer sleeps 2 s between checks (each step's rollout rounded up to 2 s); ours sets it."""
    import inspect

    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    assert inspect.signature(ReplayBuffer.__init__).parameters["poll_interval"].default == 2.0  # why we override
    built = ReplayBuffer.__new__(ReplayBuffer)
    built.poll_interval = 2.0
    monkeypatch.setattr(PPOTrainerSync, "_build_replay_buffer", lambda self: built)
    cfg = composed("+qerl=nvfp4", *extra)
    apply_qerl(cfg)
    trainer = get_trainer_cls(TRAINER_MODE).__new__(get_trainer_cls(TRAINER_MODE))
    trainer.config = cfg
    assert trainer._build_replay_buffer() is built and built.poll_interval == expected


def test_replay_poll_interval_must_be_positive_seconds():
    for bad in (0, -1, 11, True, "0.1"):
        with pytest.raises(QeRLConfigError, match="qerl.replay_poll_s"):
            QeRLConfig(replay_poll_s=bad)
    assert QeRLConfig.from_dict({"replay_poll_s": 0.5}).to_dict()["replay_poll_s"] == 0.5


HF_OVERRIDES = "actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides"


def test_scale_rule_reaches_vllm_only_where_vllm_quantizes(tiny_nvfp4):
    from omegaconf import OmegaConf

    cfg = composed("+qerl=nvfp4")  # default rule: vLLM's default too, nothing to pass
    assert apply_qerl(cfg).scale_rule == "bf16"
    assert OmegaConf.select(cfg, HF_OVERRIDES) is None
    cfg = composed("+qerl=nvfp4", "qerl.scale_rule=fp32")  # BF16 model.path: quantized at load by vLLM
    qerl = apply_qerl(cfg)
    assert qerl.scale_rule == "fp32" and cfg.actor_rollout_ref.model.lora.qerl.scale_rule == "fp32"
    assert OmegaConf.to_container(OmegaConf.select(cfg, HF_OVERRIDES)) == {
        "quantization_config": {"quant_method": "qerl_nvfp4", "scale_rule": "fp32", "ignore": ["lm_head"]}}
    # an NVFP4 model.path is read as it is by both sides: no override (it would replace its quantization_config)
    cfg = composed("+qerl=nvfp4", "qerl.scale_rule=fp32", f"actor_rollout_ref.model.path={tiny_nvfp4}")
    apply_qerl(cfg)
    assert OmegaConf.select(cfg, HF_OVERRIDES) is None


def test_ignore_list_reaches_vllm_where_vllm_quantizes(tiny_bf16, tmp_path):
    """qerl.ignore decides which layers the actor keeps in BF16; vLLM's quantize-at-load must keep the same ones (it
    read only its own default, lm_head, before: the README's qerl.ignore=[lm_head,down_proj] trained BF16 down_proj
    layers while the rollout sampled from NVFP4 ones)."""
    from omegaconf import OmegaConf

    from verl_qerl.vllm.config import QeRLNvFp4Config

    for ignore, want in (("[lm_head,down_proj]", ["lm_head", "down_proj"]),
                         ("[lm_head,o_proj]", ["lm_head", "o_proj"])):
        cfg = composed("+qerl=nvfp4", f"qerl.ignore={ignore}")
        assert list(apply_qerl(cfg).ignore) == want
        quant = OmegaConf.to_container(OmegaConf.select(cfg, HF_OVERRIDES))["quantization_config"]
        assert quant == {"quant_method": "qerl_nvfp4", "scale_rule": "bf16", "ignore": want}
        assert QeRLNvFp4Config.from_config(quant).ignore == want  # what vLLM's qerl_nvfp4 reads from it
    # a list without lm_head is refused: vLLM's LM head is never quantized, the actor's would be
    for ignore in ("[]", "[down_proj]"):
        with pytest.raises(QeRLConfigError, match=r"leaves out lm_head: the actor would train on an NVFP4 LM head"):
            apply_qerl(composed("+qerl=nvfp4", f"qerl.ignore={ignore}"))
    # a user's own override that disagrees is refused, naming both
    cfg = composed("+qerl=nvfp4", "qerl.ignore=[lm_head,down_proj]",
                   f"+{HF_OVERRIDES}.quantization_config.quant_method=qerl_nvfp4")
    with pytest.raises(QeRLConfigError, match=r"conflicts with qerl.scale_rule=bf16 / qerl.ignore=\['lm_head', "
                                              r"'down_proj'\]"):
        apply_qerl(cfg)
    # NVFP4 model.path (made keeping down_proj dense): both sides read its bytes and its own ignore list
    from verl_qerl.checkpoint_conversion import quantize_checkpoint

    quantize_checkpoint(tiny_bf16, tmp_path / "nvfp4", ignore=["down_proj"])
    cfg = composed("+qerl=nvfp4", "qerl.ignore=[lm_head,down_proj]",
                   f"actor_rollout_ref.model.path={tmp_path / 'nvfp4'}")
    apply_qerl(cfg)
    assert OmegaConf.select(cfg, HF_OVERRIDES) is None


def test_an_nvfp4_twin_must_match_the_scale_rule_vllm_uses(tiny_bf16, tiny_nvfp4, tmp_path):
    import json
    import shutil

    from verl_qerl.checkpoint_conversion import quantize_checkpoint

    path = f"actor_rollout_ref.model.path={tiny_bf16}"
    # recorded by qerl-quantize (bf16, the default) ...
    apply_qerl(composed("+qerl=nvfp4", path, f"qerl.quantized_checkpoint={tiny_nvfp4}"))
    with pytest.raises(QeRLConfigError, match=r"made with scale rule 'bf16' \(its config.json records it\), but "
                                              r"qerl.scale_rule='fp32'.*set qerl.scale_rule=bf16"):
        apply_qerl(composed("+qerl=nvfp4", path, f"qerl.quantized_checkpoint={tiny_nvfp4}", "qerl.scale_rule=fp32"))
    # ... or not recorded (an earlier qerl-quantize, llm-compressor): one layer of model.path is re-quantized
    old = quantize_checkpoint(tiny_bf16, tmp_path / "old", scale_rule="fp32").dst
    cfg = json.loads((old / "config.json").read_text())
    del cfg["qerl_scale_rule"]
    (old / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QeRLConfigError, match=r"made with scale rule 'fp32' \(re-quantizing one layer of model.path "
                                              r"matches it\), but qerl.scale_rule='bf16'.*set qerl.scale_rule=fp32"):
        apply_qerl(composed("+qerl=nvfp4", path, f"qerl.quantized_checkpoint={old}"))
    apply_qerl(composed("+qerl=nvfp4", path, f"qerl.quantized_checkpoint={old}", "qerl.scale_rule=fp32"))
    # a twin of another model matches neither rule: a warning, not an error
    other = tmp_path / "other"
    shutil.copytree(old, other)
    from safetensors.torch import load_file, save_file

    tensors = load_file(other / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        tensors[name] = tensors[name] ^ 0x11
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    apply_qerl(composed("+qerl=nvfp4", path, f"qerl.quantized_checkpoint={other}"))


def test_fsdp_engine_hook_quantizes_with_the_configured_scale_rule(tiny_bf16):
    import torch
    from transformers import AutoModelForCausalLM

    from verl_qerl.modeling import NVFP4Linear, quantize_model
    from verl_qerl.verl.integration import convert_for_lora

    cfg = composed("+qerl=nvfp4", "qerl.scale_rule=fp32")
    apply_qerl(cfg)
    model_config = SimpleNamespace(lora=dict(cfg.actor_rollout_ref.model.lora))
    module = AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.float32)
    assert convert_for_lora(module, model_config).scale_rule == "fp32"
    want = quantize_model(AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.float32), "nvfp4",
                          scale_rule="fp32").state_dict()
    default = quantize_model(AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.float32), "nvfp4").state_dict()
    got = module.state_dict()
    layers = [n for n, m in module.named_modules() if isinstance(m, NVFP4Linear)]
    assert len(layers) == 14
    for n in layers:
        for leaf in ("weight_packed", "weight_scale", "weight_global_scale"):
            assert torch.equal(got[f"{n}.{leaf}"], want[f"{n}.{leaf}"]), (n, leaf)
    assert any(not torch.equal(got[f"{n}.weight_global_scale"], default[f"{n}.weight_global_scale"]) for n in layers)


def test_bf16_with_aqn_noise_from_start_is_expressible():
    """The BF16 + AQN ablation: no quantization in vLLM, AQN on (it perturbs the rollout's RMSNorm weights, which
    needs no quantized base), noise from step 1; the carrier hands the setting to the actor and the trainer."""
    cfg = composed("+qerl=bf16", "qerl.aqn.enable=true", "++qerl.aqn.noise_from_start=true")
    qerl = apply_qerl(cfg)
    assert qerl.mode == "bf16" and qerl.aqn.enable and qerl.aqn.noise_from_start
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.get("quantization") is None
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls == VERL_WORKER_EXTENSION
    carried = dict(cfg.actor_rollout_ref.model.lora)["qerl"]["aqn"]
    assert carried["enable"] is True and carried["noise_from_start"] is True
    from verl_qerl.verl.config import read_qerl
    from verl_qerl.verl.trainer import AQNDriver

    driver = AQNDriver(read_qerl(cfg), 100, servers_fn=lambda: [])
    assert driver.sigma(1) == 1e-2 and driver.sigma(100) == 5e-4
    # the same on the NVFP4 group (which ships the key)
    cfg = composed("+qerl=nvfp4", "qerl.aqn.noise_from_start=true", "trainer.total_training_steps=5",
                   "qerl.aqn.num_stages=2")
    assert apply_qerl(cfg).aqn.noise_from_start


def test_noise_from_start_short_run_names_the_keys():
    with pytest.raises(QeRLConfigError, match=r"total_training_steps=1 is fewer than qerl.aqn.num_stages=2.*\(>= 2\)"):
        apply_qerl(composed("+qerl=nvfp4", "qerl.aqn.noise_from_start=true", "trainer.total_training_steps=1",
                            "qerl.aqn.num_stages=2"))


def _declaring(tiny_bf16, folder, block: dict):
    """A copy of the tiny BF16 model whose config.json declares the quantize-at-load ``block``."""
    import json
    import shutil

    shutil.copytree(tiny_bf16, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = block
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("block", [
    {"quant_method": "qerl_nvfp4", "ignore": ["lm_head", "down_proj"], "scale_rule": "fp32"},
    {"quant_method": "qerl_nvfp4", "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]},
], ids=["ignore+scale_rule", "targets"])
def test_a_block_declared_by_model_path_is_what_actor_and_vllm_both_quantize_with(block, tiny_bf16, tmp_path):
    """A BF16 model.path whose config.json declares a qerl_nvfp4 quantize-at-load block: vLLM quantizes it as the
    block says (an hf_overrides quantization_config replaces it), and the actor quantized with the qerl defaults
    (lm_head only, bf16), so rollout and training held different bases without an error."""
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from verl_qerl.modeling import NVFP4Linear
    from verl_qerl.verl.integration import convert_for_lora
    from verl_qerl.vllm.config import QeRLNvFp4Config

    src = _declaring(tiny_bf16, tmp_path / "model", block)
    cfg = composed("+qerl=nvfp4", "actor_rollout_ref.model.lora_rank=8", f"actor_rollout_ref.model.path={src}")
    apply_qerl(cfg)
    override = OmegaConf.select(cfg, f"{HF_OVERRIDES}.quantization_config")
    vllm = QeRLNvFp4Config.from_config(OmegaConf.to_container(override) if override is not None else block)
    module = AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.float32)  # src's weights
    qerl = convert_for_lora(module, SimpleNamespace(lora=dict(cfg.actor_rollout_ref.model.lora)))
    assert qerl.scale_rule == vllm.scale_rule == block.get("scale_rule", "bf16")
    actor = {n: isinstance(m, NVFP4Linear) for n, m in module.named_modules()
             if isinstance(m, (torch.nn.Linear, NVFP4Linear)) and n != "lm_head"}
    assert len(actor) == 14 and not all(actor.values())  # the block keeps some layers BF16
    assert actor == {n: not vllm.is_skipped(n) for n in actor}


def test_an_explicit_qerl_value_against_model_paths_declared_block_is_refused(tiny_bf16, tmp_path):
    """Only a qerl value left at its default follows the block; one that disagrees with it names both."""
    from omegaconf import OmegaConf

    path = "actor_rollout_ref.model.path=" + str(_declaring(tiny_bf16, tmp_path / "a", {
        "quant_method": "qerl_nvfp4", "ignore": ["down_proj"]}))
    with pytest.raises(QeRLConfigError, match=r"qerl.ignore=\['lm_head', 'o_proj'\] conflicts with .*config.json: "
                                              r"quantization_config \(ignore=\['down_proj'\], targets=None\)"):
        apply_qerl(composed("+qerl=nvfp4", path, "qerl.ignore=[lm_head,o_proj]"))
    # the same layers by another pattern agree; a key the block leaves out (scale_rule) binds nothing
    cfg = composed("+qerl=nvfp4", path, "qerl.ignore=[lm_head,re:.*mlp.down_proj]", "qerl.scale_rule=fp32")
    assert apply_qerl(cfg).scale_rule == "fp32"
    assert OmegaConf.select(cfg, f"{HF_OVERRIDES}.quantization_config.scale_rule") == "fp32"
    path = "actor_rollout_ref.model.path=" + str(_declaring(tiny_bf16, tmp_path / "b", {
        "quant_method": "qerl_nvfp4", "scale_rule": "bf16"}))
    with pytest.raises(QeRLConfigError, match=r"qerl.scale_rule='fp32' conflicts with .*config.json: "
                                              r"quantization_config.scale_rule='bf16'"):
        apply_qerl(composed("+qerl=nvfp4", path, "qerl.scale_rule=fp32"))


def test_ignore_keeping_layers_the_nvfp4_base_stores_quantized_is_refused_at_the_driver(tiny_nvfp4, tiny_bf16):
    """README's ``qerl.ignore=[lm_head,down_proj]`` against an NVFP4 checkpoint made with the default ignore: the
    driver passed it and the actor failed after Ray / vLLM start-up, naming ``ignore=``. Refused now, naming the key,
    the folder, the layers and the fix; from an NVFP4 model.path and from a qerl.quantized_checkpoint alike."""
    ignore = "qerl.ignore=[lm_head,down_proj]"
    with pytest.raises(QeRLConfigError, match=rf"qerl.ignore=\['lm_head', 'down_proj'\] keeps 2 layer\(s\) in BF16 "
                                              rf"that actor_rollout_ref.model.path='{tiny_nvfp4}' stores in NVFP4 "
                                              r"\(e.g. model.layers.0.mlp.down_proj.*--ignore down_proj"):
        apply_qerl(composed("+qerl=nvfp4", f"actor_rollout_ref.model.path={tiny_nvfp4}", ignore))
    with pytest.raises(QeRLConfigError, match=rf"that qerl.quantized_checkpoint='{tiny_nvfp4}' stores in NVFP4"):
        apply_qerl(composed("+qerl=nvfp4", f"actor_rollout_ref.model.path={tiny_bf16}",
                            f"qerl.quantized_checkpoint={tiny_nvfp4}", ignore))
    assert apply_qerl(composed("+qerl=nvfp4", f"actor_rollout_ref.model.path={tiny_nvfp4}")).ignore == ("lm_head",)
