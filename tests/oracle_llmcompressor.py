"""Reference outputs of llm-compressor 0.14.0.1 / compressed-tensors 0.19.0 for test_llmcompressor_oracle.py.

Runs in the oracle environment (``examples/setup_oracle_env.sh``), never in the main one, and
imports nothing from verl_qerl, so every number it returns comes from those libraries' own code:

    ORACLE_PYTHON tests/oracle_llmcompressor.py JOB.json OUT.pt

JOB.json keys (each optional):

* ``oneshot``: ``[{"src", "dst", "dtype"}]``: load ``src`` with transformers in ``dtype`` and run
  llm-compressor's data-free ``oneshot`` with ``QuantizationModifier(scheme="NVFP4A16")`` (its
  documented NVFP4A16 recipe), then ``save_pretrained(dst, save_compressed=True)``;
* ``scale_tables``: compressed-tensors' ``generate_gparam`` (as llm-compressor's observer calls
  it) and ``calculate_qparams`` on every positive finite bfloat16 value, as bf16 and as fp32;
* ``decompress``: ``[folder]``: load through transformers' compressed-tensors integration
  (``dequantize=True``) and return each quantized Linear's weight.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _oneshot(src: str, dst: str, dtype: str) -> dict:
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"]))
    model.save_pretrained(dst, save_compressed=True)
    return {"model_dtype": str(model.dtype)}


#: Global scales (fp32 divisors) under which the block-scale tables are taken: plain, typical of
#: small and large weights, and tiny (block scales underflow to compressed-tensors' 0.125).
BLOCK_TABLE_GLOBAL_SCALES = (1.0, 2688.0, 27776.0, 27803.154296875, 3.0e5, 1.5e-30)


def _positive_bf16_values():
    """Every positive finite bfloat16 value (bit patterns 0x0001 .. 0x7F7F), ascending."""
    import torch

    return torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _scale_tables() -> dict:
    import torch
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    amax = _positive_bf16_values()
    out: dict = {"amax": amax}
    for dtype in (torch.bfloat16, torch.float32):
        key = str(dtype).removeprefix("torch.")
        a = amax.to(dtype)
        # llm-compressor's Observer.get_global_scale: generate_gparam(-absmax.reshape(1), absmax.reshape(1))
        gs = torch.cat([generate_gparam(-v.reshape(1), v.reshape(1)) for v in a])
        out[f"gparam_{key}"] = gs
        for i, g in enumerate(BLOCK_TABLE_GLOBAL_SCALES):
            g_t = torch.tensor([g], dtype=torch.float32)
            scale, _ = calculate_qparams(torch.zeros_like(a), a, args, global_scale=g_t)
            out[f"block_scale_{key}_{i}"] = scale.to(torch.float8_e4m3fn)
    return out


def _decompress(folder: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    cfg = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]
    quantized = [n for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and not any(n == p or n.endswith("." + p) for p in cfg["ignore"])]
    return {n: model.get_submodule(n).weight.detach().clone() for n in quantized}


def main(job_file: str, out_file: str) -> None:
    import importlib.metadata as md

    import torch

    job = json.loads(Path(job_file).read_text())
    t0 = time.perf_counter()
    results: dict = {"versions": {p: md.version(p) for p in ("llmcompressor", "compressed-tensors", "transformers",
                                                             "torch")}}
    results["oneshot"] = [_oneshot(**spec) for spec in job.get("oneshot", [])]
    if job.get("scale_tables"):
        results["scale_tables"] = _scale_tables()
    results["decompress"] = {folder: _decompress(folder) for folder in job.get("decompress", [])}
    results["seconds"] = time.perf_counter() - t0
    torch.save(results, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:3])
