"""export_merged on the adapter setups an audit found it got wrong: LoRA biases, peft modules_to_save, adapters
merged with merge_adapter(), ignore patterns, and the output folder when an export fails or is killed.

Each test compares what the exported-and-reloaded checkpoint computes with the in-memory model (float32), or
checks the refusal / the folder state, on tiny models built here (no hub)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open

TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=256)


def _tiny(arch: str = "qwen2", tied: bool = False, seed: int = 0) -> nn.Module:
    """A random float32 causal LM built in memory (``llama``: no biases, with attention_bias/mlp_bias switches)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if arch == "llama":
        cfg = LlamaConfig(**TINY, tie_word_embeddings=tied, attention_bias=False, mlp_bias=False)
    else:
        cfg = Qwen2Config(**TINY, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # transformers zero-inits biases; make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.05)
    return model.eval()


def _perturb_trainable(model: nn.Module, seed: int = 1) -> None:
    """Give every trainable tensor (LoRA A/B and their biases, modules_to_save copies) a random change: peft starts
    B at 0 and modules_to_save as a copy, which would export correctly by accident."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(7))


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids()).logits


def _reload(out: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def _keys(out: Path) -> list[str]:
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        return list(f.keys())


def _assert_same_logits(out: Path, want: torch.Tensor, tol: float = 1e-4) -> None:
    got = _logits(_reload(out))
    assert (got - want).abs().max().item() < tol


# ------------------------------------------------------------------------------------------------
# 1. lora_bias=True: scaling * lora_B.bias belongs in the exported bias


def test_lora_bias_on_layers_with_a_bias_is_added_to_it(tmp_path):
    from verl_qerl.modeling import export_merged, get_lora_model, quantize_model

    pm = get_lora_model(quantize_model(_tiny("qwen2"), "nvfp4"), r=4, lora_alpha=8,
                        target_modules=["q_proj", "k_proj", "v_proj"], lora_bias=True)
    _perturb_trainable(pm)
    want = _logits(pm)
    out = export_merged(pm, tmp_path / "out", dtype="fp32")
    _assert_same_logits(out, want)


def test_lora_bias_where_the_base_has_none_turns_on_the_configs_bias_setting(tmp_path):
    from verl_qerl.modeling import export_merged, get_lora_model, quantize_model

    # o_proj and the MLP get a LoRA bias; Llama's attention_bias also gives q/k/v one (written as zeros)
    pm = get_lora_model(quantize_model(_tiny("llama"), "nvfp4"), r=4, lora_alpha=8,
                        target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"], lora_bias=True)
    _perturb_trainable(pm)
    want = _logits(pm)
    for dtype in ("fp32", "nvfp4"):
        out = export_merged(pm, tmp_path / dtype, dtype=dtype)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["attention_bias"] is True and cfg["mlp_bias"] is True
        keys = _keys(out)
        assert "model.layers.0.self_attn.o_proj.bias" in keys and "model.layers.1.mlp.down_proj.bias" in keys
        assert "model.layers.0.self_attn.q_proj.bias" in keys
        if dtype == "fp32":
            _assert_same_logits(out, want)


def test_lora_bias_the_architecture_cannot_hold_is_refused_by_name(tmp_path):
    from verl_qerl.modeling import export_merged, get_lora_model, quantize_model

    pm = get_lora_model(quantize_model(_tiny("qwen2"), "nvfp4"), r=4, lora_alpha=8, lora_bias=True)
    _perturb_trainable(pm)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj.*lora_bias"):
        export_merged(pm, tmp_path / "out", dtype="fp32")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------
# 2. peft modules_to_save: the active copy, under the plain name


@pytest.mark.parametrize("tied", [False, True])
def test_modules_to_save_copy_is_exported_under_the_plain_name(tmp_path, tied):
    from verl_qerl.modeling import export_merged, get_lora_model, quantize_model

    pm = get_lora_model(quantize_model(_tiny("qwen2", tied=tied), "nvfp4"), r=4, lora_alpha=8,
                        modules_to_save=["lm_head"])
    _perturb_trainable(pm)
    want = _logits(pm)
    out = export_merged(pm, tmp_path / "fp32", dtype="fp32")
    keys = _keys(out)
    assert "lm_head.weight" in keys
    assert not [k for k in keys if "modules_to_save" in k or "original_module" in k]
    _assert_same_logits(out, want)
    out4 = export_merged(pm, tmp_path / "nvfp4", dtype="nvfp4")  # lm_head matches the default ignore by its plain name
    keys4 = _keys(out4)
    assert "lm_head.weight" in keys4 and not [k for k in keys4 if k.startswith("lm_head.weight_")]
    assert json.loads((out4 / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]


def test_modules_to_save_with_adapters_disabled_exports_the_original(tmp_path):
    from verl_qerl.modeling import export_merged, get_lora_model, quantize_model

    pm = get_lora_model(quantize_model(_tiny("qwen2"), "nvfp4"), r=4, lora_alpha=8, modules_to_save=["lm_head"])
    _perturb_trainable(pm)
    with pm.disable_adapter():
        want = _logits(pm)
        out = export_merged(pm, tmp_path / "out", dtype="fp32")
    _assert_same_logits(out, want)


# ------------------------------------------------------------------------------------------------
# 3. after merge_adapter(), the delta is already in the base weight


def test_merged_adapters_are_not_added_twice(tmp_path):
    from verl_qerl.modeling import export_merged, get_lora_model, quantize_model

    pm = get_lora_model(quantize_model(_tiny("llama"), "bf16"), r=4, lora_alpha=8)
    _perturb_trainable(pm)
    with pm.disable_adapter():
        base = _logits(pm)
    want = _logits(pm)
    pm.merge_adapter()
    assert (_logits(pm) - want).abs().max().item() < 1e-4
    _assert_same_logits(export_merged(pm, tmp_path / "merged", dtype="fp32"), want)
    with pm.disable_adapter():  # merged but disabled: peft's forward un-merges first, giving the base model
        out = export_merged(pm, tmp_path / "disabled", dtype="fp32")
    _assert_same_logits(out, base)


# ------------------------------------------------------------------------------------------------
# 4. ignore patterns


def test_ignore_given_as_a_string_is_one_pattern(tmp_path):
    from verl_qerl.modeling import export_merged, get_lora_model, quantize_model

    pm = get_lora_model(quantize_model(_tiny("qwen2"), "nvfp4"), r=4)
    out = export_merged(pm, tmp_path / "out", dtype="nvfp4", ignore="lm_head")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]
    keys = _keys(out)
    assert "lm_head.weight" in keys and "lm_head.weight_packed" not in keys


@pytest.mark.parametrize("dtype", ["nvfp4", "bf16"])
def test_a_misspelled_ignore_pattern_is_refused_by_name(tmp_path, dtype):
    from verl_qerl.modeling import export_merged, get_lora_model, quantize_model

    pm = get_lora_model(quantize_model(_tiny("qwen2"), "nvfp4", ignore=["lm_head", "down_proj"]), r=4)
    with pytest.raises(ValueError, match="'donw_proj' matches no Linear layer"):
        export_merged(pm, tmp_path / "out", dtype=dtype, ignore=["lm_head", "donw_proj"])
    assert not list(tmp_path.iterdir())
    out = export_merged(pm, tmp_path / "ok", dtype="nvfp4", ignore=["lm_head", "down_proj"])
    assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] == [
        "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "lm_head"]  # full names, as written


# ------------------------------------------------------------------------------------------------
# 5. the tokenizer and the output folder


def test_a_missing_tokenizer_folder_is_refused_before_anything_is_written(tmp_path):
    from verl_qerl.modeling import export_merged, get_lora_model, quantize_model

    pm = get_lora_model(quantize_model(_tiny("qwen2"), "nvfp4"), r=4)
    (tmp_path / "no_tok").mkdir()
    (tmp_path / "no_tok" / "config.json").write_text("{}")
    for bad in (tmp_path / "typo", tmp_path / "no_tok"):
        with pytest.raises((FileNotFoundError, ValueError), match=str(bad)):
            export_merged(pm, tmp_path / "out", tokenizer=bad)
        assert not (tmp_path / "out").exists()
    with pytest.raises(TypeError, match="tokenizer=12"):
        export_merged(pm, tmp_path / "out", tokenizer=12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no_tok"]


def test_a_failed_export_keeps_the_users_empty_folder_and_leaves_nothing_behind(tmp_path, monkeypatch):
    import verl_qerl.modeling.export as export
    from verl_qerl.modeling import get_lora_model, quantize_model

    pm = get_lora_model(quantize_model(_tiny("qwen2"), "nvfp4"), r=4)
    user = tmp_path / "mine"
    user.mkdir()
    calls = []

    def failing(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(f"{path}: No space left on device")
        original(tensors, path)

    original = export.write_safetensors
    monkeypatch.setattr(export, "write_safetensors", failing)
    with pytest.raises(OSError, match="No space left"):
        export.export_merged(pm, user, dtype="bf16", max_shard_bytes=200_000)
    assert user.is_dir() and not list(user.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging folder left either
    with pytest.raises(ValueError, match="bogus"):
        export.export_merged(pm, user, dtype="bogus")
    assert user.is_dir()
    # a missing parent made for the export is taken back too
    with pytest.raises(OSError, match="No space left"):
        calls.clear()
        export.export_merged(pm, tmp_path / "new" / "deeper", dtype="bf16", max_shard_bytes=200_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


_CHILD = """
import sys, time
import torch
import verl_qerl.modeling.export as export
from transformers import AutoModelForCausalLM
from verl_qerl.modeling import get_lora_model, quantize_model

original = export.write_safetensors
def slow(tensors, path):
    original(tensors, path)
    print("wrote", flush=True)
    time.sleep(120)  # stands in for the next multi-GB shard write

export.write_safetensors = slow
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
export.export_merged(get_lora_model(quantize_model(model, "nvfp4"), r=4), sys.argv[2], max_shard_bytes=200_000)
"""


def test_an_export_killed_by_sigterm_leaves_no_half_written_folder_and_a_retry_works(tiny_bf16, tmp_path):
    from verl_qerl.modeling import export_merged, get_lora_model, quantize_model

    out = tmp_path / "work" / "merged"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_CHILD), str(tiny_bf16), str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "wrote"
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert not out.exists()  # nothing under the name the user asked for until it is complete
    from transformers import AutoModelForCausalLM

    pm = get_lora_model(quantize_model(AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.float32), "nvfp4"),
                        r=4)
    done = export_merged(pm, out, dtype="fp32", tokenizer=tiny_bf16, max_shard_bytes=200_000)
    assert (done / "config.json").is_file() and (done / "tokenizer.json").is_file()
    assert (done / "model.safetensors.index.json").is_file() and not list(done.glob("*.tmp.*"))
    _assert_same_logits(done, _logits(pm))


@pytest.mark.parametrize("tied", [False, True])
def test_nvfp4_export_writes_an_ignore_list_compressed_tensors_readers_match(tmp_path, tied):
    """``ignore=["lm_head", "down_proj"]`` was written verbatim; compressed-tensors / vLLM's stock loader /
    transformers read ignore entries as exact names (or ``re:``), so they expected NVFP4 tensors for the BF16
    down_proj layers. The written list names every Linear kept dense, the tied head included."""
    from compressed_tensors.utils.match import match_name

    from verl_qerl.modeling import export_merged, get_lora_model, quantize_model

    pm = get_lora_model(quantize_model(_tiny("qwen2", tied=tied), "nvfp4", ignore=["lm_head", "down_proj"]), r=4)
    out = export_merged(pm, tmp_path / "out", dtype="nvfp4", ignore=["lm_head", "down_proj"])
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    keys = _keys(out)
    nvfp4 = {k.removesuffix(".weight_packed") for k in keys if k.endswith(".weight_packed")}
    linear = [n for n, m in _tiny("qwen2", tied=tied).named_modules() if isinstance(m, nn.Linear)]
    assert nvfp4 and len(nvfp4) == 2 * 6
    for name in linear:
        assert any(match_name(name, p) for p in ignore) == (name not in nvfp4), (name, ignore)
