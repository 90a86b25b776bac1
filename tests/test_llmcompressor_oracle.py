"""Bit-exact against llm-compressor 0.14.0.1 / compressed-tensors 0.19.0, run in their own environment.

Their pins clash with vLLM's, so they live in a second environment (``examples/setup_oracle_env.sh``,
run by ``examples/setup_env.sh``: ``.venv-ct019`` beside ``.venv``), and
``tests/oracle_llmcompressor.py`` runs there in a subprocess: llm-compressor's own ``oneshot``
NVFP4A16 on a tiny BF16 model (loaded in bfloat16, and in float32), compressed-tensors' scale
functions on every positive bfloat16 value, and compressed-tensors' decompression of our
checkpoints. Here the same inputs go through ``qerl-quantize``, the actor's ``quantize_model`` and
the scale functions, and everything must agree to the byte:

* llm-compressor on the BF16 model == scale rule ``bf16`` (the default);
* llm-compressor on the model loaded in float32 == scale rule ``fp32``.

Without the oracle environment these tests skip locally, and fail under CI (``CI=true``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from verl_qerl.checkpoint_conversion import quantize_checkpoint
from verl_qerl.nvfp4 import compute_block_scales, global_scale_from_amax
from verl_qerl.nvfp4.checkpoint import SCALE_RULE_KEY, CheckpointReader

HERE = Path(__file__).resolve().parent
ORACLE_SCRIPT = HERE / "oracle_llmcompressor.py"
ORACLE_ENV_VAR = "QERL_ORACLE_PYTHON"
ORACLE_VENV = ".venv-ct019"
WANT_VERSIONS = {"llmcompressor": "0.14.0.1", "compressed-tensors": "0.19.0"}
QUANT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_global_scale")


def _oracle_module():
    spec = importlib.util.spec_from_file_location("_oracle_llmcompressor", ORACLE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def oracle_python() -> Path | None:
    """The oracle environment's python: $QERL_ORACLE_PYTHON, REPO/.venv-ct019, or the running venv's twin."""
    candidates = []
    if os.environ.get(ORACLE_ENV_VAR):
        candidates.append(Path(os.environ[ORACLE_ENV_VAR]))
    candidates.append(HERE.parent / ORACLE_VENV / "bin" / "python")
    candidates.append(Path(sys.prefix).with_name(Path(sys.prefix).name + "-ct019") / "bin" / "python")
    return next((p for p in candidates if p.is_file()), None)


def _require_oracle() -> Path:
    python = oracle_python()
    if python is not None:
        return python
    why = (f"the llm-compressor oracle environment is missing (looked for ${ORACLE_ENV_VAR}, {ORACLE_VENV}/ in the "
           "repository and beside the running venv); create it with: bash examples/setup_oracle_env.sh .venv")
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why)
    pytest.skip(why)


def _edge_case_model(folder: Path) -> Path:
    """The tiny BF16 Qwen2 with the cases that exercise the scale formulas' corners."""
    from verl_qerl.testing.tiny import make_tiny_model

    make_tiny_model(folder, seed=3)
    shard = folder / "model.safetensors"
    tensors = load_file(shard)
    p = "model.layers."
    tensors[f"{p}1.self_attn.v_proj.weight"].zero_()  # an all-zero part of a fused group
    tensors[f"{p}0.self_attn.o_proj.weight"][:3, :16] = 0  # all-zero blocks (scale 0.125)
    tensors[f"{p}0.mlp.down_proj.weight"][:, 5] *= 50  # an outlier column
    tensors[f"{p}0.mlp.up_proj.weight"][0, 0] = 1.0  # gate/up's amax comes from up
    tensors[f"{p}1.self_attn.o_proj.weight"] *= 1e-37  # global scale overflows to inf -> 1.0; scales underflow
    tensors[f"{p}1.mlp.down_proj.weight"] *= 300.0  # a large amax (small global scale)
    save_file(tensors, shard, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> dict:
    """Run the oracle once: llm-compressor in bf16 and fp32, scale tables, decompression of our checkpoints."""
    python = _require_oracle()
    root = tmp_path_factory.mktemp("oracle")
    src = _edge_case_model(root / "bf16")
    ours = {rule: root / f"ours_{rule}" for rule in ("bf16", "fp32")}
    for rule, dst in ours.items():
        quantize_checkpoint(src, dst, scale_rule=rule)
    theirs = {"bf16": root / "llmc_bf16", "fp32": root / "llmc_fp32"}
    job = {"oneshot": [{"src": str(src), "dst": str(theirs[r]), "dtype": {"bf16": "bfloat16", "fp32": "float32"}[r]}
                       for r in ("bf16", "fp32")],
           "scale_tables": True,
           "decompress": [str(ours["bf16"]), str(ours["fp32"])]}
    (root / "job.json").write_text(json.dumps(job))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)  # their code only (the oracle script imports nothing of ours)
    proc = subprocess.run([str(python), str(ORACLE_SCRIPT), str(root / "job.json"), str(root / "out.pt")],
                          capture_output=True, text=True, timeout=840, env=env, cwd=root)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"oracle run failed (rc={proc.returncode}) with {python}:\n{tail}")
    out = torch.load(root / "out.pt", weights_only=False)
    return {"src": src, "ours": ours, "theirs": theirs, **out}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_oracle_runs_the_versions_it_claims(oracle):
    versions = oracle["versions"]
    assert {k: versions[k] for k in WANT_VERSIONS} == WANT_VERSIONS
    assert [r["model_dtype"] for r in oracle["oneshot"]] == ["torch.bfloat16", "torch.float32"]


def test_qerl_quantize_bf16_rule_is_llmcompressor_on_a_bf16_model_byte_for_byte(oracle):
    ours, theirs = _tensors(oracle["ours"]["bf16"]), _tensors(oracle["theirs"]["bf16"])
    assert sorted(ours) == sorted(theirs)
    assert sum(n.endswith(".weight_packed") for n in ours) == 14
    differ = [n for n in theirs if not _same_bytes(ours[n], theirs[n])]
    assert not differ, f"{len(differ)} of {len(theirs)} tensors differ from llm-compressor's, e.g. {differ[:3]}"
    # the corner cases really were corners: overflowed global scale -> 1.0, zero blocks -> 0.125
    assert float(ours["model.layers.1.self_attn.o_proj.weight_global_scale"]) == 1.0
    assert float(ours["model.layers.0.self_attn.o_proj.weight_scale"][0, 0].float()) == 0.125
    assert torch.equal(ours["model.layers.1.self_attn.v_proj.weight_global_scale"],
                       ours["model.layers.1.self_attn.q_proj.weight_global_scale"])
    # and the global scales are not the fp32 rule's (which this model tells apart)
    fp32 = _tensors(oracle["ours"]["fp32"])
    gs = [n for n in ours if n.endswith(".weight_global_scale")]
    assert sum(not torch.equal(ours[n], fp32[n]) for n in gs) >= len(gs) // 2


def test_qerl_quantize_fp32_rule_is_llmcompressor_on_a_float32_model(oracle):
    ours, theirs = _tensors(oracle["ours"]["fp32"]), _tensors(oracle["theirs"]["fp32"])
    assert sorted(ours) == sorted(theirs)
    quantized = [n for n in theirs if n.endswith(QUANT_SUFFIXES)]
    assert len(quantized) == 42
    differ = [n for n in quantized if not _same_bytes(ours[n], theirs[n])]
    assert not differ, f"{len(differ)} of {len(quantized)} NVFP4 tensors differ, e.g. {differ[:3]}"
    # llm-compressor saved the float32 model's other tensors in float32: the same values as our bf16 copies
    for n in set(theirs) - set(quantized):
        assert theirs[n].dtype == torch.float32 and torch.equal(theirs[n].to(torch.bfloat16), ours[n]), n


def test_the_rule_is_recorded_and_their_loader_reads_our_checkpoints_exactly(oracle):
    for rule, folder in oracle["ours"].items():
        reader = CheckpointReader(folder)
        assert reader.config[SCALE_RULE_KEY] == rule
        theirs = oracle["decompress"][str(folder)]  # transformers 5.17 + compressed-tensors 0.19 loaded it
        assert sorted(theirs) == sorted(reader.nvfp4_modules())
        for module, w in theirs.items():
            ref = reader.read_nvfp4(module).dequantize(torch.float32).to(w.dtype)
            assert torch.equal(w, ref), (rule, module, w.dtype)


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
def test_actor_quantize_at_load_is_llmcompressor_whatever_dtype_the_actor_holds(oracle, model_dtype):
    """quantize_model (the actor) with the default rule holds llm-compressor's bytes, from bf16 or fp32 weights."""
    from transformers import AutoModelForCausalLM

    from verl_qerl.modeling import NVFP4Linear, quantize_model

    model = AutoModelForCausalLM.from_pretrained(oracle["src"], dtype=model_dtype)
    quantize_model(model, "nvfp4")
    theirs = _tensors(oracle["theirs"]["bf16"])
    layers = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(layers) == 14
    for name, layer in layers.items():
        assert _same_bytes(layer.weight_packed, theirs[f"{name}.weight_packed"]), name
        assert _same_bytes(layer.scale_fp8, theirs[f"{name}.weight_scale"]), name
        assert _same_bytes(layer.global_scale, theirs[f"{name}.weight_global_scale"]), name


@pytest.mark.parametrize("rule", ["bf16", "fp32"])
def test_scale_functions_match_compressed_tensors_on_every_bf16_value(oracle, rule):
    tables = oracle["scale_tables"]
    amax = tables["amax"]
    key = {"bf16": "bfloat16", "fp32": "float32"}[rule]
    # global scale: generate_gparam on llm-compressor's statistics in the rule's dtype
    ours = torch.cat([global_scale_from_amax(a, rule) for a in amax.float()])
    theirs = tables[f"gparam_{key}"]
    bad = (ours.view(torch.int32) != theirs.view(torch.int32)).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} amax values differ, e.g. amax={amax[bad[:3]].tolist()}"
    # block scales: one block per amax value (the amax at position 0, zeros elsewhere)
    weight = torch.zeros(amax.numel(), 16)
    weight[:, 0] = amax.float()
    for i, g in enumerate(_oracle_module().BLOCK_TABLE_GLOBAL_SCALES):
        ours_s = compute_block_scales(weight, torch.tensor([g]), rule).reshape(-1)
        theirs_s = tables[f"block_scale_{key}_{i}"].reshape(-1)
        bad = (ours_s.view(torch.uint8) != theirs_s.view(torch.uint8)).nonzero().flatten()
        assert bad.numel() == 0, f"global scale {g}: {bad.numel()} block amax values differ, e.g. {amax[bad[:3]]}"
    # the two rules really differ on this table (else the test could not tell them apart)
    other = torch.cat([global_scale_from_amax(a, "fp32" if rule == "bf16" else "bf16") for a in amax.float()])
    assert (other != ours).float().mean() > 0.5
