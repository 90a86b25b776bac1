"""One reading of a checkpoint's quantization config: the actor's reader, the verl config check and vLLM agree.

Each case is a checkpoint folder (config.json, optionally ModelOpt's hf_quant_config.json); the reader
(:class:`CheckpointReader`, used by ``load_nvfp4_model``, ``qerl-quantize`` and the NVFP4 actor), the verl
config check (``checkpoint_format``) and the vLLM method (``QeRLNvFp4Config.from_config`` on the dict vLLM
hands it: config.json's ``quantization_config``, else the whole hf_quant_config.json) must name the same
format, or all refuse naming the same setting.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from verl_qerl.nvfp4 import checkpoint as ckpt
from verl_qerl.nvfp4.checkpoint import CheckpointError, CheckpointReader, ct_quantization_config

CT = ct_quantization_config()
MODELOPT = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}


def _ct(**weights) -> dict:
    qc = copy.deepcopy(CT)
    qc["config_groups"]["group_0"]["weights"].update(weights)
    return qc


# name -> (config.json quantization_config or None, hf_quant_config.json or None, format or error needle)
CASES = {
    "unquantized": (None, None, "bf16"),
    "empty quantization_config": ({}, None, "bf16"),
    "compressed-tensors NVFP4A16": (CT, None, "compressed-tensors"),
    "compressed_tensors spelling": ({**CT, "quant_method": "compressed_tensors"}, None, "compressed-tensors"),
    "ModelOpt in config.json": ({"quant_method": "modelopt", **MODELOPT}, None, "modelopt"),
    "ModelOpt W4A16 in config.json": ({"quant_method": "modelopt", **MODELOPT, "quant_algo": "W4A16_NVFP4"}, None,
                                      "modelopt"),
    "ModelOpt hf_quant_config.json": (None, {"producer": {"name": "modelopt"}, "quantization": MODELOPT},
                                      "modelopt"),
    "qerl_nvfp4, quantize at load": ({"quant_method": "qerl_nvfp4"}, None, "bf16"),
    "qerl_nvfp4 bf16": ({"quant_method": "qerl_nvfp4", "checkpoint_format": "bf16"}, None, "bf16"),
    "qerl_nvfp4 compressed-tensors": ({**CT, "quant_method": "qerl_nvfp4", "checkpoint_format": "compressed-tensors"},
                                      None, "compressed-tensors"),
    # refused, naming the setting
    "unknown quant_method": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, None, "quant_method='fp8'"),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128}, None, "quant_method='awq'"),
    "qerl_nvfp4 unknown layout": ({"quant_method": "qerl_nvfp4", "checkpoint_format": "unquantized"}, None,
                                  "checkpoint_format='unquantized'"),
    "compressed-tensors group 32": (_ct(group_size=32), None, "group_size=32"),
    "compressed-tensors int4": (_ct(type="int"), None, "type='int'"),
    "compressed-tensors 8-bit": (_ct(num_bits=8), None, "num_bits=8"),
    "compressed-tensors asymmetric": (_ct(symmetric=False), None, "symmetric=False"),
    "compressed-tensors other format": ({**CT, "format": "pack-quantized", "config_groups": {
        "group_0": {**CT["config_groups"]["group_0"], "format": "pack-quantized"}}}, None, "'pack-quantized'"),
    "compressed-tensors KV cache": ({**CT, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, None,
                                    "kv_cache_scheme"),
    "ModelOpt FP8": ({"quant_method": "modelopt", "quant_algo": "FP8"}, None, "quant_algo='FP8'"),
    "ModelOpt NVFP4_AWQ": ({"quant_method": "modelopt", "quant_algo": "NVFP4_AWQ"}, None, "quant_algo='NVFP4_AWQ'"),
    "ModelOpt group 32": ({"quant_method": "modelopt", **MODELOPT, "group_size": 32}, None, "group_size=32"),
}
FORMATS = ("bf16", "compressed-tensors", "modelopt")


def _folder(root: Path, name: str, qc: dict | None, hf_quant: dict | None) -> Path:
    folder = root / name.replace(" ", "_").replace(",", "")
    folder.mkdir()
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    if qc is not None:
        config["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    save_file({"model.norm.weight": torch.ones(4)}, folder / "model.safetensors")
    return folder


def _vllm_dict(qc: dict | None, hf_quant: dict | None) -> dict | None:
    return qc if qc is not None else hf_quant


@pytest.mark.parametrize("name", list(CASES))
def test_reader_verl_and_vllm_read_a_config_the_same_way(tmp_path, name):
    from verl_qerl.verl.config import QeRLConfigError, checkpoint_format
    from verl_qerl.vllm.config import QeRLNvFp4Config, QeRLNvFp4Error

    qc, hf_quant, want = CASES[name]
    folder = _folder(tmp_path, name, qc, hf_quant)
    vllm_dict = _vllm_dict(qc, hf_quant)
    if want in FORMATS:
        assert CheckpointReader(folder).format == want
        assert checkpoint_format(folder) == want
        if vllm_dict is not None:  # vLLM builds QeRLNvFp4Config() (bf16) when a checkpoint declares nothing
            assert QeRLNvFp4Config.from_config(vllm_dict).checkpoint_format == want
        return
    with pytest.raises(CheckpointError) as reader_err:
        CheckpointReader(folder)
    with pytest.raises(QeRLConfigError) as verl_err:
        checkpoint_format(folder)
    with pytest.raises(QeRLNvFp4Error) as vllm_err:
        QeRLNvFp4Config.from_config(vllm_dict)
    for err in (reader_err, verl_err, vllm_err):
        assert want in str(err.value), (name, str(err.value))


def test_one_set_of_format_names():
    from verl_qerl.vllm import config as vllm_config

    assert (vllm_config.FORMAT_BF16, vllm_config.FORMAT_CT, vllm_config.FORMAT_MODELOPT) == (
        ckpt.FORMAT_BF16, ckpt.FORMAT_CT, ckpt.FORMAT_MODELOPT) == FORMATS
    assert vllm_config.CHECKPOINT_FORMATS == FORMATS and vllm_config.METHOD_NAME == "qerl_nvfp4"


def _qerl_nvfp4_folder(tiny_bf16: Path, dst: Path, **extra) -> Path:
    shutil.copytree(tiny_bf16, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "qerl_nvfp4", **extra}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_load_nvfp4_model_quantizes_a_qerl_nvfp4_folder_at_load_as_vllm_does(tiny_bf16, tmp_path):
    from verl_qerl.modeling import NVFP4Linear, load_nvfp4_model

    folder = _qerl_nvfp4_folder(tiny_bf16, tmp_path / "qerl")
    model = load_nvfp4_model(folder, dtype=torch.float32)
    want = load_nvfp4_model(tiny_bf16, dtype=torch.float32)  # the plain BF16 folder, quantized at load
    assert sum(isinstance(m, NVFP4Linear) for m in model.modules()) == 14
    got, ref = model.state_dict(), want.state_dict()
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)

    # the folder's own ignore list is the one vLLM uses; the actor-side loader follows it too
    kept = _qerl_nvfp4_folder(tiny_bf16, tmp_path / "kept", ignore=["lm_head", "down_proj"])
    model = load_nvfp4_model(kept, dtype=torch.float32)
    layers = {n: type(m) for n, m in model.named_modules() if n.endswith(("down_proj", "up_proj"))}
    assert all((t is nn.Linear) == n.endswith("down_proj") for n, t in layers.items()), layers
    assert all(t is NVFP4Linear for n, t in layers.items() if n.endswith("up_proj"))


def test_qerl_quantize_converts_a_qerl_nvfp4_quantize_at_load_folder(tiny_bf16, tmp_path):
    from verl_qerl.checkpoint_conversion import quantize_checkpoint

    src = _qerl_nvfp4_folder(tiny_bf16, tmp_path / "qerl")
    report = quantize_checkpoint(src, tmp_path / "out")
    assert len(report.quantized) == 14 and CheckpointReader(tmp_path / "out").format == "compressed-tensors"
    # declared layers carry over: the written ignore list names every Linear left in BF16
    src = _qerl_nvfp4_folder(tiny_bf16, tmp_path / "some", ignore=["lm_head", "down_proj"], targets=["re:.*mlp.*"])
    report = quantize_checkpoint(src, tmp_path / "out2")
    assert sorted(report.quantized) == sorted(f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj",
                                                                                                     "up_proj"))
    written = CheckpointReader(tmp_path / "out2").quant_config["ignore"]  # full names (compressed-tensors' rule)
    assert sorted(written) == sorted(["lm_head"] + [f"model.layers.{i}.{p}" for i in range(2) for p in (
        "mlp.down_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")])
