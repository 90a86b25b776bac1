"""Audited defects of the ``qerl_nvfp4`` vLLM method (verl_qerl/vllm/), each pinned by a test that failed before.

1. Block scales stored as safetensors U8 (their E4M3 bits) were copied into the float8 parameter as numbers
   (vLLM's ``copy_`` converts, it does not reinterpret): weights ~70 % off, no error.
2. A native ``qerl_nvfp4`` config with ``checkpoint_format: compressed-tensors`` (no ``config_groups``) or with
   ``targets: "Linear"`` (a string) quantized no layer at all, silently.
3. Native ``ignore`` / ``targets`` were not validated: a misspelled pattern matched nothing, a string was split
   into characters, a misspelled key was dropped, a bad regex surfaced as a raw ``re.error``.
4. A truncated safetensors shard gave a bare JSON parse error naming no file.
5. A checkpoint tensor whose shape disagrees with config.json gave a bare ``AssertionError`` from vLLM's loader.

Config parsing, the front-end checks (``maybe_update_config``) and the weight loader wrapper are tested on their
own; the U8 scales (1) and the front-end errors (2, 4, 5) also on a real CPU engine, through the driver of
tests/test_vllm.py (engines run in a subprocess).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from verl_qerl.vllm.config import QeRLNvFp4Config, QeRLNvFp4Error, check_checkpoint_tensors  # noqa: E402

_spec = importlib.util.spec_from_file_location("_qerl_vllm_cpu_tests_defects",
                                               Path(__file__).with_name("test_vllm.py"))
cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu)

MAPPING = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
O_PROJ = "model.layers.1.self_attn.o_proj"


def _hf_config(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def _native(**kw) -> QeRLNvFp4Config:
    cfg = QeRLNvFp4Config.from_config({"quant_method": "qerl_nvfp4", **kw})
    cfg.packed_modules_mapping = MAPPING  # what vLLM sets from the model class
    return cfg


def _clone(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _u8_scales(tiny_nvfp4: Path, dst: Path) -> Path:
    """``tiny_nvfp4`` with every ``weight_scale`` stored as U8 (the same bytes), as some converters write it."""
    from safetensors.torch import load_file, save_file

    folder = _clone(tiny_nvfp4, dst)
    tensors = load_file(folder / "model.safetensors")
    scales = [k for k in tensors if k.endswith(".weight_scale")]
    assert scales and all(tensors[k].dtype == torch.float8_e4m3fn for k in scales)
    for k in scales:
        tensors[k] = tensors[k].view(torch.uint8)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _bad_shape(tiny_nvfp4: Path, dst: Path) -> Path:
    """``tiny_nvfp4`` whose o_proj of layer 1 has half the rows config.json says (its tensors consistent)."""
    from safetensors.torch import load_file, save_file

    folder = _clone(tiny_nvfp4, dst)
    tensors = load_file(folder / "model.safetensors")
    for leaf in ("weight_packed", "weight_scale"):
        name = f"{O_PROJ}.{leaf}"
        tensors[name] = tensors[name][: tensors[name].shape[0] // 2].contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _truncated(tiny_nvfp4: Path, dst: Path, keep: int) -> Path:
    folder = _clone(tiny_nvfp4, dst)
    shard = folder / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:keep])
    return folder


# ------------------------------------------------------------------------------------------------
# The weight loader (create_weights' wrapper around vLLM's), on real vLLM parameters
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def tp1(monkeypatch):
    """vLLM's parameter classes read the tensor-parallel rank and size at construction; an engine has a group,
    a unit test has none: rank 0 of 1."""
    import vllm.model_executor.parameter as vparam

    monkeypatch.setattr(vparam, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_world_size", lambda: 1)
    return vparam


def _row_parallel_loader(param, loaded_weight, *args, **kwargs):
    """What ``RowParallelLinear.weight_loader_v2`` does for these parameters (o_proj, down_proj)."""
    return param.load_row_parallel_weight(loaded_weight=loaded_weight)


def _layer(prefix: str):
    from verl_qerl.vllm.linear_method import QeRLLayerState

    layer = torch.nn.Module()
    layer.qerl_state = QeRLLayerState(prefix=prefix, checkpoint_format="compressed-tensors")
    return layer


def test_u8_block_scales_load_as_their_e4m3_bits(tp1):
    """Defect 1, at the loader: a U8 ``weight_scale`` (the E4M3 bytes) lands in the float8 parameter bit for bit,
    as ``validate_nvfp4`` reads it on the training side; before, ``copy_`` converted the numbers 0..255."""
    from verl_qerl.vllm.linear_method import _tracking

    gen = torch.Generator().manual_seed(0)
    want = (torch.rand(8, 4, generator=gen) * 400 + 0.01).to(torch.float8_e4m3fn)
    layer = _layer(O_PROJ)
    param = tp1.GroupQuantScaleParameter(data=torch.zeros(8, 4, dtype=torch.float8_e4m3fn), input_dim=1,
                                         output_dim=0, weight_loader=_row_parallel_loader)
    _tracking(layer, "weight_scale", _row_parallel_loader)(param, want.view(torch.uint8))
    assert torch.equal(param.data.view(torch.uint8), want.view(torch.uint8))
    assert layer.qerl_state.loaded == {"weight_scale": {None}}
    # float8 scales still load as they are; uint8 packed codes are not reinterpreted (their parameter is uint8)
    _tracking(layer, "weight_scale", _row_parallel_loader)(param, want)
    assert torch.equal(param.data.view(torch.uint8), want.view(torch.uint8))
    codes = tp1.ModelWeightParameter(data=torch.zeros(8, 4, dtype=torch.uint8), input_dim=1, output_dim=0,
                                     weight_loader=_row_parallel_loader)
    _tracking(layer, "weight_packed", _row_parallel_loader)(codes, want.view(torch.uint8))
    assert torch.equal(codes.data, want.view(torch.uint8))


def test_a_tensor_of_the_wrong_shape_is_named_with_both_shapes(tp1):
    """Defect 5, at the loader: vLLM's bare ``assert self.data.shape == loaded_weight.shape`` becomes an error
    naming the tensor (``<prefix>.<tensor>``) and both shapes."""
    from verl_qerl.vllm.linear_method import _tracking

    layer = _layer(O_PROJ)
    param = tp1.ModelWeightParameter(data=torch.zeros(128, 64, dtype=torch.uint8), input_dim=1, output_dim=0,
                                     weight_loader=_row_parallel_loader)
    with pytest.raises(QeRLNvFp4Error) as err:
        _tracking(layer, "weight_packed", _row_parallel_loader)(param, torch.zeros(64, 64, dtype=torch.uint8))
    msg = str(err.value)
    for needle in (f"{O_PROJ}.weight_packed", "[64, 64]", "[128, 64]", "config.json"):
        assert needle in msg, msg


# ------------------------------------------------------------------------------------------------
# Native quantization_config: parsing and the front-end checks against the model
# ------------------------------------------------------------------------------------------------


def test_native_targets_default_to_every_linear_and_a_string_is_one_pattern():
    """Defect 2: ``checkpoint_format: compressed-tensors`` without ``config_groups`` read no targets (every layer
    BF16); ``targets: "Linear"`` was split into six one-letter patterns (every layer BF16)."""
    for cfg in (_native(checkpoint_format="compressed-tensors"), _native(targets="Linear"),
                _native(checkpoint_format="modelopt")):
        assert cfg.targets == ["Linear"], cfg
        assert cfg.ignore == ["lm_head"], cfg
        assert not cfg.is_skipped("model.layers.0.self_attn.qkv_proj"), cfg
        assert not cfg.is_skipped("model.layers.0.mlp.down_proj"), cfg
    cfg = _native(targets="re:.*mlp.*")
    assert cfg.targets == ["re:.*mlp.*"] and cfg.is_skipped("model.layers.0.self_attn.o_proj")
    assert not cfg.is_skipped("model.layers.0.mlp.gate_up_proj")


def test_native_ignore_string_is_one_pattern():
    """Defect 3: ``ignore: "down_proj"`` was nine one-letter patterns, which matched nothing."""
    cfg = _native(ignore="down_proj")
    assert cfg.ignore == ["down_proj"]
    assert cfg.is_skipped("model.layers.0.mlp.down_proj")
    assert not cfg.is_skipped("model.layers.0.mlp.gate_up_proj")


@pytest.mark.parametrize("config, needles", [
    ({"ignore": ["lm_head", "re:(down"]}, ["quantization_config.ignore", "'re:(down'", "regular expression"]),
    ({"targets": ["re:[q"]}, ["quantization_config.targets", "'re:[q'", "regular expression"]),
    ({"ignore": ["lm_head", 3]}, ["quantization_config.ignore", "3"]),
    ({"ignore": 3}, ["quantization_config.ignore", "3", "not a list"]),
    ({"igonre": ["down_proj"], "scale_rul": "fp32"}, ["'igonre'", "'scale_rul'", "'ignore'", "'scale_rule'"]),
])
def test_native_config_errors_name_the_key_or_pattern(config, needles):
    """Defect 3: a bad regex was a raw ``re.error`` at the first layer; an unknown key was dropped silently."""
    with pytest.raises(QeRLNvFp4Error) as err:
        QeRLNvFp4Config.from_config({"quant_method": "qerl_nvfp4", **config})
    for needle in needles:
        assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("config, needles", [
    ({"ignore": ["lm_head", "donw_proj"]}, ["quantization_config.ignore", "'donw_proj'", "matches no Linear"]),
    ({"ignore": ["lm_head", "q_proj"]}, ["quantization_config.ignore", "q_proj", "fused"]),
    ({"targets": ["re:.*mlp.*", "re:.*self_atn.*"]}, ["quantization_config.targets", "'re:.*self_atn.*'",
                                                      "matches no Linear"]),
    ({"ignore": ["lm_head", "re:.*_proj"]}, ["quantizes no layer", "quantization_config"]),
    ({"targets": ["lm_head"]}, ["quantizes no layer"]),
])
def test_native_patterns_are_checked_against_the_models_linear_layers(tiny_bf16, config, needles):
    """Defects 2 and 3: with the model at hand (``maybe_update_config``, in the front end before any engine
    process), a native pattern that matches no Linear layer, a split fused group, or a config that leaves every
    layer unquantized is refused, naming the key."""
    cfg = QeRLNvFp4Config.from_config({"quant_method": "qerl_nvfp4", **config})
    with pytest.raises(QeRLNvFp4Error) as err:
        cfg.maybe_update_config(str(tiny_bf16), hf_config=_hf_config(tiny_bf16))
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_native_patterns_that_match_pass(tiny_bf16):
    cfg = QeRLNvFp4Config.from_config({"quant_method": "qerl_nvfp4", "ignore": ["lm_head", "down_proj"],
                                       "targets": "Linear", "scale_rule": "fp32"})
    cfg.maybe_update_config(str(tiny_bf16), hf_config=_hf_config(tiny_bf16))
    assert cfg.model_type == "qwen2" and cfg.ignore == ["lm_head", "down_proj"]


def test_native_compressed_tensors_format_on_a_bf16_checkpoint_is_refused(tiny_bf16):
    """Defect 2: the BF16 checkpoint served unquantized under ``checkpoint_format: compressed-tensors``; now the
    front end says it holds no NVFP4 tensors (and with the default targets every layer would want them)."""
    cfg = QeRLNvFp4Config.from_config({"quant_method": "qerl_nvfp4", "checkpoint_format": "compressed-tensors"})
    with pytest.raises(QeRLNvFp4Error) as err:
        cfg.maybe_update_config(str(tiny_bf16), hf_config=_hf_config(tiny_bf16))
    for needle in (str(tiny_bf16), "checkpoint_format='compressed-tensors'", "no NVFP4 tensors", "bf16"):
        assert needle in str(err.value), str(err.value)


def test_a_checkpoints_own_ignore_list_may_name_absent_modules(tiny_nvfp4):
    """Only a native dict (what a user writes) must match: compressed-tensors checkpoints from other tools list
    modules of other architectures (vision towers, MoE gates) that this model does not have."""
    qc = json.loads((tiny_nvfp4 / "config.json").read_text())["quantization_config"]
    qc["ignore"] = ["lm_head", "re:.*vision_tower.*", "model.layers.0.mlp.gate"]
    cfg = QeRLNvFp4Config.from_config(qc)
    cfg.maybe_update_config(str(tiny_nvfp4), hf_config=_hf_config(tiny_nvfp4))
    assert cfg.checkpoint_format == "compressed-tensors" and cfg.targets == ["Linear"]


# ------------------------------------------------------------------------------------------------
# Front-end checkpoint scan: damaged shards, shapes against config.json
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [5, 1000, -100], ids=["length-cut", "header-cut", "data-cut"])
def test_a_truncated_shard_is_named(tiny_nvfp4, tmp_path, keep):
    """Defect 4: a shard cut inside its length prefix, its JSON header, or its data gave a bare JSON error (or
    nothing, leaving vLLM to fail later); now the error names the file and says what to do."""
    folder = _truncated(tiny_nvfp4, tmp_path / "trunc", keep)
    with pytest.raises(QeRLNvFp4Error) as err:
        check_checkpoint_tensors(folder, "compressed-tensors")
    msg = str(err.value)
    for needle in (str(folder / "model.safetensors"), "damaged or incomplete", "copy or download it again"):
        assert needle in msg, msg


def test_a_tensor_shape_against_config_json_is_checked_in_the_front_end(tiny_nvfp4, tmp_path):
    """Defect 5, before any engine process: the checkpoint's header shapes against the model config.json
    describes, naming the tensor and both shapes."""
    folder = _bad_shape(tiny_nvfp4, tmp_path / "badshape")
    cfg = QeRLNvFp4Config.from_config(json.loads((folder / "config.json").read_text())["quantization_config"])
    with pytest.raises(QeRLNvFp4Error) as err:
        cfg.maybe_update_config(str(folder), hf_config=_hf_config(folder))
    for needle in (f"{O_PROJ}.weight_packed", "[64, 64]", "[128, 64]", "config.json"):
        assert needle in str(err.value), str(err.value)


# ------------------------------------------------------------------------------------------------
# A real CPU engine
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_bf16, tiny_nvfp4, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("defects")
    prompts = cpu._prompt_ids(tiny_bf16)
    tasks = [{"id": "dequant", "kind": "tensors", "args": {"method": "qerl_dequantized_weights"}},
             {"id": "summary", "kind": "rpc", "args": {"method": "qerl_quant_summary"}},
             {"id": "base", "kind": "greedy", "args": {"prompts": prompts}}]
    ct_native = {"quantization_config": {"quant_method": "qerl_nvfp4", "checkpoint_format": "compressed-tensors"}}
    typo = {"quantization_config": {"quant_method": "qerl_nvfp4", "ignore": ["lm_head", "donw_proj"]}}
    job = {"engines": [
        {"name": "f8", "llm": cpu._llm_kwargs(tiny_nvfp4), "tasks": tasks},
        {"name": "u8", "llm": cpu._llm_kwargs(_u8_scales(tiny_nvfp4, root / "u8")), "tasks": tasks},
        {"name": "badshape", "llm": cpu._llm_kwargs(_bad_shape(tiny_nvfp4, root / "badshape"))},
        {"name": "truncated", "llm": cpu._llm_kwargs(_truncated(tiny_nvfp4, root / "trunc", 1000))},
        {"name": "ct_native_on_bf16", "llm": cpu._llm_kwargs(tiny_bf16, hf_overrides=ct_native), "tasks": tasks[1:2]},
        {"name": "ignore_typo", "llm": cpu._llm_kwargs(tiny_bf16, hf_overrides=typo), "tasks": tasks[1:2]},
    ]}
    res = cpu.run_driver(job, multiproc=False)
    res["_root"] = root
    return res


def test_u8_scale_checkpoint_serves_the_f8_checkpoints_weights_and_logprobs(engines, tiny_nvfp4):
    """Defect 1, end to end: the engine on the U8-scale copy holds exactly the weights of the F8 checkpoint (as
    the training side's reader dequantizes them) and generates the same tokens with the same logprobs."""
    f8, u8 = engines["f8"], engines["u8"]
    assert "error" not in f8 and "error" not in u8, (f8.get("error"), u8.get("error"))
    ref = cpu._ref_weights_from_reader(tiny_nvfp4)
    assert len(ref) == 14
    for name, w in ref.items():
        assert torch.equal(cpu._engine_weight(f8["dequant"][0], name), w), name
        assert torch.equal(cpu._engine_weight(u8["dequant"][0], name), w), name
    assert u8["summary"][0]["nvfp4_digest"] == f8["summary"][0]["nvfp4_digest"]
    assert [r["tokens"] for r in u8["base"]] == [r["tokens"] for r in f8["base"]]
    assert [r["logprobs"] for r in u8["base"]] == [r["logprobs"] for r in f8["base"]]


@pytest.mark.parametrize("case, needles", [
    ("badshape", [f"{O_PROJ}.weight_packed", "[64, 64]", "[128, 64]"]),
    ("truncated", ["model.safetensors", "damaged or incomplete"]),
    ("ct_native_on_bf16", ["checkpoint_format='compressed-tensors'", "no NVFP4 tensors"]),
    ("ignore_typo", ["quantization_config.ignore", "'donw_proj'", "matches no Linear"]),
])
def test_engine_refuses_in_the_front_end_naming_the_problem(engines, case, needles):
    """Defects 2-5 on a real engine: each refused while vLLM builds its config, with the file, tensor or key."""
    res = engines[case]
    assert "error" in res, f"{case}: the engine started (layers: {res.get('summary')})"
    for needle in needles:
        assert needle in res["error"], (case, res["error"][:800])
    assert res["startup_s"] < 60, res["startup_s"]


def test_a_wildcard_pattern_in_a_native_config_is_refused_with_the_regex_to_use():
    """vLLM's skip test takes ModelOpt's ``*`` wildcards, the actor's ``quantize_model`` does not: a native
    ``ignore: ["*down_proj"]`` kept the layer dense in vLLM only (the message said it matched nothing)."""
    with pytest.raises(QeRLNvFp4Error,
                       match=r"'\*down_proj': '\*' wildcards are not module patterns.*'re:\.\*down_proj'"):
        QeRLNvFp4Config.from_config({"quant_method": "qerl_nvfp4", "ignore": ["lm_head", "*down_proj"]})
    assert QeRLNvFp4Config.from_config(
        {"quant_method": "qerl_nvfp4", "ignore": ["lm_head", "re:.*down_proj"]}).ignore == ["lm_head", "re:.*down_proj"]
