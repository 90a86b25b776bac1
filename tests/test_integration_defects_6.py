"""Defects of the verl integration and the vLLM method found by the sixth audit (CPU, no engine, no Ray).

Each test failed before its fix: a value accepted and then ignored or misread, or a rollout that would sample from
other weights than the actor trains, without an error.
"""

from __future__ import annotations

import json
import os
import shutil
import types

import pytest

os.environ.setdefault("VERL_QERL_QUIET", "1")
import verl  # noqa: E402, F401  (the plugin's hooks and the qerl group, as in test_verl_config)

from verl_qerl.testing.ppo_config import composed  # noqa: E402
from verl_qerl.verl.config import QeRLConfigError, apply_qerl  # noqa: E402

# -- reward.py: compute_score -------------------------------------------------------------------------------------


def test_reward_kwargs_with_a_misspelled_key_or_a_non_numeric_score_are_refused():
    """``+reward.custom_reward_function.reward_kwargs.form=[hash]`` (for ``forms``) went into ``**kwargs`` and every
    form stayed enabled; ``score=high`` failed only on the first correct answer, in float()."""
    from verl_qerl.verl import reward as R

    text = "so \\boxed{42}"
    with pytest.raises(R.RewardConfigError, match=r"reward_kwargs\.form: unknown key"):
        R.compute_score("openai/gsm8k", text, "42", form=["hash"])
    with pytest.raises(R.RewardConfigError, match=r"reward_kwargs\.format_scor: unknown key"):
        R.compute_score("openai/gsm8k", text, "42", format_scor=0.1)
    with pytest.raises(R.RewardConfigError, match=r"reward_kwargs\.score='high': must be a finite number"):
        R.compute_score("openai/gsm8k", text, "41", score="high")
    with pytest.raises(R.RewardConfigError, match=r"reward_kwargs\.format_score=nan"):
        R.compute_score("openai/gsm8k", text, "41", format_score=float("nan"))
    # what verl's reward managers add themselves (with a reward-model router) is still accepted
    assert R.compute_score("openai/gsm8k", text, "42", reward_router_address=None, reward_model_tokenizer=None,
                           score=2, format_score=0.5) == 2.0
    assert R.compute_score("openai/gsm8k", text, "41", forms=["hash"], format_score=0.5) == 0.5


# -- config.py: QeRLConfig ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, needle", [
    (("+qerl=nf4", "+qerl.scale_rule=fp32"), r"qerl.scale_rule='fp32' is only used with qerl.mode=nvfp4"),
    (("+qerl=bf16", "+qerl.scale_rule=fp32"), r"qerl.scale_rule='fp32' is only used with qerl.mode=nvfp4"),
    (("+qerl=bf16", "+qerl.shard_base=false"), r"qerl.shard_base=False is only used with qerl.mode=nvfp4"),
    (("+qerl=nf4", "+qerl.shard_base=false"), r"qerl.shard_base=False is only used with qerl.mode=nvfp4"),
    (("+qerl=bf16", "qerl.ignore=[lm_head,down_proj]"), r"qerl.ignore=\['lm_head', 'down_proj'\] with qerl.mode=bf16"),
    (("+qerl=nvfp4", "qerl.mode=bf16", "qerl.scale_rule=fp32"), r"qerl.scale_rule='fp32' is only used"),
])
def test_nvfp4_only_keys_are_refused_in_the_modes_that_never_read_them(overrides, needle):
    """``+qerl=nf4 +qerl.scale_rule=fp32`` or ``+qerl=bf16 qerl.ignore=[lm_head,down_proj]`` passed and changed
    nothing (only the nvfp4 path reads scale_rule, shard_base and ignore), as qerl.quantized_checkpoint is refused."""
    with pytest.raises(QeRLConfigError, match=needle):
        apply_qerl(composed(*overrides))


@pytest.mark.parametrize("group", ["bf16", "nf4", "nvfp4_noaqn"])
def test_the_groups_defaults_still_pass_in_every_mode(group):
    qerl = apply_qerl(composed(f"+qerl={group}", "+qerl.scale_rule=bf16", "+qerl.shard_base=true")
                      if group != "nvfp4_noaqn" else composed(f"+qerl={group}"))
    assert qerl.scale_rule == "bf16" and qerl.shard_base is True


# -- config.py: apply_qerl on a model.path that vLLM quantizes at load ---------------------------------------------


def _declaring(tiny_bf16, folder, block):
    shutil.copytree(tiny_bf16, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = block
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("group", ["bf16", "nf4"])
def test_bf16_and_nf4_refuse_a_model_path_that_vllm_would_quantize_to_nvfp4(group, tiny_bf16, tmp_path):
    """A BF16 folder whose config.json declares ``{"quant_method": "qerl_nvfp4"}`` (quantize at load): transformers
    skips the unknown block and the actor trained BF16 (or NF4), while vLLM followed the block and rolled out NVFP4
    weights (with ``quantization=None``, and over ``quantization=bitsandbytes`` too)."""
    src = _declaring(tiny_bf16, tmp_path / "model", {"quant_method": "qerl_nvfp4", "ignore": ["lm_head"]})
    with pytest.raises(QeRLConfigError, match=r"actor_rollout_ref.model.path=.* declares a qerl_nvfp4 "
                                              rf"quantization_config .* qerl.mode={group} trains"):
        apply_qerl(composed(f"+qerl={group}", f"actor_rollout_ref.model.path={src}"))
    # nvfp4 is what the block is for; a plain BF16 folder is fine in every mode
    assert apply_qerl(composed("+qerl=nvfp4", f"actor_rollout_ref.model.path={src}")).mode == "nvfp4"
    assert apply_qerl(composed(f"+qerl={group}", f"actor_rollout_ref.model.path={tiny_bf16}")).mode == group


# -- vllm/config.py: override_quantization_method -----------------------------------------------------------------


def test_vllm_does_not_replace_another_quantization_the_user_asked_for(tiny_bf16, tmp_path):
    """``LLM(folder declaring qerl_nvfp4, quantization="bitsandbytes")`` ran qerl_nvfp4 without a word: the method
    claimed the checkpoint whatever the user asked for. Now vLLM's own mismatch error says the two disagree."""
    from verl_qerl.vllm import plugin
    from verl_qerl.vllm.config import QeRLNvFp4Config

    block = {"quant_method": "qerl_nvfp4"}
    assert QeRLNvFp4Config.override_quantization_method(dict(block), "bitsandbytes") is None
    assert QeRLNvFp4Config.override_quantization_method(dict(block), None) == "qerl_nvfp4"
    assert QeRLNvFp4Config.override_quantization_method({"quant_method": "QERL_NVFP4"}, "qerl_nvfp4") == "qerl_nvfp4"

    plugin.register()
    from vllm.config import ModelConfig

    src = _declaring(tiny_bf16, tmp_path / "model", block)
    assert ModelConfig(model=str(src)).quantization == "qerl_nvfp4"
    with pytest.raises(ValueError, match=r"\(qerl_nvfp4\) does not match .* \(bitsandbytes\)"):
        ModelConfig(model=str(src), quantization="bitsandbytes")


# -- vllm/worker_extension.py: the AQN RPCs -----------------------------------------------------------------------


def _worker():
    import torch

    from verl_qerl.vllm.worker_extension import QeRLWorkerExtension

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
    for layer in model.layers:
        for norm in ("input_layernorm", "post_attention_layernorm"):
            setattr(layer, norm, torch.nn.Module())
            getattr(layer, norm).weight = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    worker = QeRLWorkerExtension()
    worker.model_runner = types.SimpleNamespace(get_model=lambda: model)
    return worker


def test_aqn_rpc_arguments_are_checked_not_coerced():
    """``qerl_aqn_setup(targets="input_layernorm")`` became fifteen one-letter targets (the error listed 'i', 'n',
    'p', ...); ``qerl_aqn_apply(step=7.5)`` drew step 7's noise and ``sigma=None`` failed inside float()."""
    from verl_qerl.aqn import AQNConfigError

    worker = _worker()
    with pytest.raises(AQNConfigError, match=r"targets: must be a list of module names, got 'input_layernorm'"):
        worker.qerl_aqn_setup(targets="input_layernorm")
    assert worker.qerl_aqn_setup(targets=["input_layernorm"])["names"] == [
        "layers.0.input_layernorm.weight", "layers.1.input_layernorm.weight"]
    for kwargs, needle in (({"step": 7.5, "sigma": 0.01}, r"step: .* got 7.5"),
                           ({"step": True, "sigma": 0.01}, r"step: .* got True"),
                           ({"step": 3, "sigma": None}, r"sigma: .* got None"),
                           ({"step": 3, "sigma": "0.01"}, r"sigma: .* got '0.01'")):
        with pytest.raises(AQNConfigError, match=needle):
            worker.qerl_aqn_apply(**kwargs)
    out = worker.qerl_aqn_apply(step=3, sigma=0.01)
    assert out["step"] == 3 and out["sigma"] == 0.01
    assert worker.qerl_aqn_restore()["checksum"] == worker.qerl_aqn_restore()["clean_checksum"]


# -- vllm/config.py: check_architecture ---------------------------------------------------------------------------


@pytest.mark.parametrize("value, allowed", [("1", True), ("true", True), (" Yes ", True), ("on", True),
                                            ("0", False), ("false", False), ("", False), (None, False)])
def test_allow_untested_arch_is_a_switch_like_the_others(monkeypatch, value, allowed):
    """``QERL_NVFP4_ALLOW_UNTESTED_ARCH=true`` was read as off (only the exact string "1" counted) and the model was
    refused with "set it to 1"; a value that is no switch value is now refused naming the variable."""
    from transformers import MistralConfig

    from verl_qerl.vllm.config import ALLOW_UNTESTED_ARCH_ENV, QeRLNvFp4Error, check_architecture

    if value is None:
        monkeypatch.delenv(ALLOW_UNTESTED_ARCH_ENV, raising=False)
    else:
        monkeypatch.setenv(ALLOW_UNTESTED_ARCH_ENV, value)
    if allowed:
        assert check_architecture(MistralConfig()) == "mistral"
    else:
        with pytest.raises(QeRLNvFp4Error, match="does not support model_type='mistral'"):
            check_architecture(MistralConfig())


def test_allow_untested_arch_with_a_value_that_is_no_switch_is_named(monkeypatch):
    from transformers import MistralConfig, Qwen2Config

    from verl_qerl.vllm.config import ALLOW_UNTESTED_ARCH_ENV, QeRLNvFp4Error, check_architecture

    monkeypatch.setenv(ALLOW_UNTESTED_ARCH_ENV, "maybe")
    with pytest.raises(QeRLNvFp4Error, match=r"QERL_NVFP4_ALLOW_UNTESTED_ARCH='maybe' is not a switch value"):
        check_architecture(MistralConfig())
    assert check_architecture(Qwen2Config()) == "qwen2"  # read only where it matters
