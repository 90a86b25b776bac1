"""``qerl_nvfp4`` on a CUDA vLLM engine (0.24 with verl's stack): the FP4 kernel under CUDA graphs.

The CPU file (test_vllm.py) proves the method's numbers; this one re-runs the engine on a GPU with
``enforce_eager=False`` (torch.compile + CUDA graphs, what verl runs) and checks that

* every quantized layer runs the FP4 GEMM (``verl_qerl.kernels``, repacked layout);
* the engine holds exactly the NVFP4 weights the format library computes (quantize-at-load on GPU
  is bit-identical to the CPU/offline quantizer);
* greedy logprobs match HF (CPU, fp32, same dequantized weights) as closely as bf16 allows, and an
  fp32 eager GPU engine matches HF like the CPU engine does (<= 1e-3);
* LoRA from a peft folder matches HF+peft;
* AQN's in-place norm writes reach the captured graphs, and restoring gives the clean outputs back.

Skipped without CUDA (conftest). Engines run in driver subprocesses, as in test_vllm.py, whose
helpers this file loads by path.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

_spec = importlib.util.spec_from_file_location("_qerl_vllm_cpu_tests", Path(__file__).with_name("test_vllm.py"))
cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu)

lora_adapter = cpu.lora_adapter  # the same module-scoped fixture (a peft folder + verl-style tensors)


@pytest.fixture(scope="module")
def gpu_engines(tiny_bf16, lora_adapter) -> dict:
    prompts = cpu._prompt_ids(tiny_bf16)
    base = {"id": "base", "kind": "greedy", "args": {"prompts": prompts}}
    summary = {"id": "summary", "kind": "rpc", "args": {"method": "qerl_quant_summary"}}
    dequant = {"id": "dequant", "kind": "tensors", "args": {"method": "qerl_dequantized_weights"}}
    graphs = [
        summary, dequant, base,
        {"id": "lora_dir", "kind": "greedy",
         "args": {"prompts": prompts, "lora": {"name": "folder", "id": 1, "path": str(lora_adapter["dir"])}}},
        {"id": "aqn_apply", "kind": "rpc",
         "args": {"method": "qerl_aqn_apply", "kwargs": {"step": cpu.AQN_STEP, "sigma": cpu.AQN_SIGMA,
                                                        "seed": cpu.AQN_SEED}}},
        {"id": "reset1", "kind": "reset_prefix_cache"},
        {"id": "noisy", "kind": "greedy", "args": {"prompts": prompts}},
        {"id": "aqn_restore", "kind": "rpc", "args": {"method": "qerl_aqn_restore"}},
        {"id": "reset2", "kind": "reset_prefix_cache"},
        {"id": "restored", "kind": "greedy", "args": {"prompts": prompts}},
    ]
    common = dict(gpu_memory_utilization=0.3, enable_lora=True, max_lora_rank=cpu.LORA_RANK, max_loras=1)
    job = {"engines": [
        {"name": "graphs_bf16", "llm": cpu._llm_kwargs(tiny_bf16, dtype="bfloat16", enforce_eager=False, **common),
         "tasks": graphs},
        {"name": "eager_bf16", "llm": cpu._llm_kwargs(tiny_bf16, dtype="bfloat16", **common), "tasks": [base]},
        {"name": "eager_fp32", "llm": cpu._llm_kwargs(tiny_bf16, dtype="float32", gpu_memory_utilization=0.3),
         "tasks": [summary, base]},
    ]}
    res = cpu.run_driver(job, multiproc=True, timeout=900)
    for name in ("graphs_bf16", "eager_bf16", "eager_fp32"):
        assert "error" not in res[name], (name, res[name].get("error"))
    return res


def test_cuda_graph_engine_runs_the_fp4_kernel_on_the_exact_weights(gpu_engines, tiny_bf16):
    g = gpu_engines["graphs_bf16"]
    layers = [v for v in g["summary"][0]["layers"].values() if "backend" in v]
    assert len(layers) == 8 and all(v["backend"] == "kernel" and v["layout"] == "repacked" for v in layers), layers
    ref = cpu._ref_weights_from_bf16(tiny_bf16)
    for name, w in ref.items():
        assert torch.equal(cpu._engine_weight(g["dequant"][0], name), w.cpu()), name


def test_cuda_graphs_match_eager_and_hf(gpu_engines, tiny_bf16):
    g, e = gpu_engines["graphs_bf16"], gpu_engines["eager_bf16"]
    # graph and eager bf16 pad the batch differently, so the split-K sums differ in order: tokens may flip only at
    # a near-tie of the eager run (greedy_agree), logprobs on the common prefix within 1e-2
    ok, report = cpu.greedy_agree(g["base"], e["base"], lp_tol=1e-2)
    print("\nCUDA graphs vs eager (bf16):\n" + report)
    assert ok, report
    ref = cpu._ref_weights_from_bf16(tiny_bf16)
    hf32 = cpu._hf_model(tiny_bf16, ref)
    diff_bf16 = cpu._max_diff(g["base"], cpu._hf_logprobs(hf32, g["base"]))
    print(f"\nGPU bf16 + CUDA graphs vs HF fp32 (same NVFP4 weights): max |dlogprob| = {diff_bf16:.3g}")
    assert diff_bf16 <= 2e-2 * 2, diff_bf16
    f = gpu_engines["eager_fp32"]
    assert {v["backend"] for v in f["summary"][0]["layers"].values() if "backend" in v} <= {"kernel", "torch"}
    diff_fp32 = cpu._max_diff(f["base"], cpu._hf_logprobs(hf32, f["base"]))
    print(f"GPU fp32 eager vs HF fp32: max |dlogprob| = {diff_fp32:.3g}")
    assert diff_fp32 <= 1e-3, diff_fp32


def test_lora_under_cuda_graphs_matches_hf_peft(gpu_engines, tiny_bf16, lora_adapter):
    from peft import PeftModel

    g = gpu_engines["graphs_bf16"]
    hf = PeftModel.from_pretrained(cpu._hf_model(tiny_bf16, cpu._ref_weights_from_bf16(tiny_bf16)),
                                   lora_adapter["dir"]).eval()
    diff = cpu._max_diff(g["lora_dir"], cpu._hf_logprobs(hf, g["lora_dir"]))
    print(f"GPU bf16 + CUDA graphs + LoRA vs HF+peft fp32: max |dlogprob| = {diff:.3g}")
    assert diff <= 2e-2 * 2, diff


def test_aqn_writes_reach_captured_graphs(gpu_engines):
    g = gpu_engines["graphs_bf16"]
    base = [r["logprobs"] for r in g["base"]]
    assert cpu._max_diff(g["noisy"], base) > 1e-3, "noise written in place did not change graph outputs"
    assert [r["tokens"] for r in g["restored"]] == [r["tokens"] for r in g["base"]]
    assert cpu._max_diff(g["restored"], base) <= 1e-5
    rest = g["aqn_restore"][0]
    assert rest["checksum"] == rest["clean_checksum"]


@pytest.fixture(scope="module")
def gpu_fast_path_engines(tiny_bf16, lora_adapter, lora_adapter_next) -> dict:
    """The LoRA fast path under CUDA graphs (bf16) against vLLM's own LoRA path (``QERL_LORA_FAST_PATH=off``),
    same tasks as the CPU comparison (peft folder, a mixed batch, verl's tensor route reproduced, new weights
    under the same id, AQN with the adapter on)."""
    tasks = cpu._fast_path_tasks(cpu._prompt_ids(tiny_bf16), lora_adapter, lora_adapter_next)
    llm = cpu._llm_kwargs(tiny_bf16, dtype="bfloat16", enforce_eager=False, gpu_memory_utilization=0.3,
                          enable_lora=True, max_lora_rank=cpu.LORA_RANK, max_loras=1,
                          worker_extension_cls="test_vllm.VerlReproExtension")
    job = {"engines": [{"name": "fast", "llm": llm, "tasks": tasks, "env": {cpu.FAST_PATH_ENV: "on"}},
                       {"name": "vllm", "llm": llm, "tasks": tasks, "env": {cpu.FAST_PATH_ENV: "off"}}]}
    res = cpu.run_driver(job, multiproc=False, timeout=900)
    for name in ("fast", "vllm"):
        assert "error" not in res[name], (name, res[name].get("error"))
    return res


lora_adapter_next = cpu.lora_adapter_next


def test_lora_fast_path_under_cuda_graphs_matches_vllm_lora_path(gpu_fast_path_engines):
    fast, ref = gpu_fast_path_engines["fast"], gpu_fast_path_engines["vllm"]
    layers = [v for v in fast["summary"][0]["layers"].values() if v["method"] == "QeRLNvFp4LinearMethod"]
    assert len(layers) == 8 and all(v["lora_fast_path"] and v["backend"] == "kernel" for v in layers)
    assert not any(v["lora_fast_path"] for v in ref["summary"][0]["layers"].values())
    for key in cpu.LORA_RUNS:
        # greedy decodes in bf16 may part at a near-tie; compare each sequence up to that token (the teacher-forced
        # comparison with HF + peft in float32 below covers every token of the fast path's sequences)
        diff, compared, total = cpu._max_diff_until_divergence(fast[key], ref[key])
        same = sum(a["tokens"] == b["tokens"] for a, b in zip(fast[key], ref[key]))
        print(f"\nGPU bf16 graphs, fast path vs vLLM LoRA path, {key}: max |dlogprob| = {diff:.3g} over {compared} of "
              f"{total} positions (up to a divergence), {same}/{len(fast[key])} token sequences equal")
        assert diff <= 2e-2 * 2, (key, diff)  # bf16: the two paths round the shrink differently
        assert compared >= total // 2, (key, compared, total)  # a divergence in the first half is not a near-tie
    # the update took effect and the adapter acts, on the fast path
    assert cpu._max_diff(fast["lora_tensors"], [r["logprobs"] for r in fast["lora_tensors_next"]]) > 1e-2
    assert cpu._max_diff(fast["base"], [r["logprobs"] for r in fast["lora_dir"]]) > 1e-2


def test_lora_fast_path_under_cuda_graphs_matches_hf_peft(gpu_fast_path_engines, tiny_bf16, lora_adapter,
                                                          lora_adapter_next):
    from peft import PeftModel

    fast = gpu_fast_path_engines["fast"]
    weights = cpu._ref_weights_from_bf16(tiny_bf16)
    for adapter, key in ((lora_adapter, "lora_tensors"), (lora_adapter_next, "lora_tensors_next")):
        hf = PeftModel.from_pretrained(cpu._hf_model(tiny_bf16, weights), adapter["dir"]).eval()
        diff = cpu._max_diff(fast[key], cpu._hf_logprobs(hf, fast[key]))
        print(f"\nGPU bf16 graphs + fast path vs HF+peft fp32, {key}: max |dlogprob| = {diff:.3g}")
        assert diff <= 2e-2 * 2, (key, diff)


#: QERL_LORA_EPILOGUE_MAX_BLOCK_M (cuda/qerl_nvfp4.h): the split-K kernel takes the LoRA epilogue, and with it the
#: in-launch shrink, for up to this many tokens
LORA_EPILOGUE_MAX_TOKENS = 8


def test_lora_fast_path_kernels_per_layer_on_cuda(gpu_fast_path_engines):
    """On CUDA a fast-path qerl layer is one op, ``qerl::nvfp4_lora_linear``, and where the split-K kernel runs (decode
    token counts) one kernel in all, base GEMM included: the split-K GEMM with the shrink's CTAs in its grid and the
    expand in its epilogue (no ``_lora_shrink_kernel``, no expand kernel); likewise the copy-engine decode kernel's
    linear kernel where the dispatch runs ``decode_tma`` and the shrink's units fit its grid. Where the dispatch runs
    another GEMM the op runs the shrink (Triton up to ``TRITON_MAX_TOKENS``, cuBLAS above) and, for GEMMs without a
    LoRA epilogue, ``_lora_expand_kernel`` after it (below ``CUBLAS_MIN_TOKENS``; from there on cuBLAS called from
    C++). Printed: the kernels, and what vLLM's path launches for the LoRA term."""
    from verl_qerl.kernels.lora_expand import CUBLAS_MIN_TOKENS
    from verl_qerl.kernels.lora_shrink import TRITON_MAX_TOKENS

    fast = gpu_fast_path_engines["fast"]["lora_ops"][0]
    ref = gpu_fast_path_engines["vllm"]["lora_ops"][0]
    qerl = {n: v for n, v in fast.items() if v["method"] == "QeRLNvFp4LinearMethod"}
    assert len(qerl) == 8
    in_launch = 0
    for name, v in qerl.items():
        print(f"\n{name} (T={v['tokens']}): fast path kernels {v['kernels']}; "
              f"vLLM path LoRA kernels {ref[name]['lora_kernels']}")
        assert v["fused_expand"] and v["ops"] == ["qerl::nvfp4_lora_linear"], (name, v)
        splitk = sum("nvfp4_gemm_splitk_kernel" in k for k in v["kernels"])
        shrink = sum("_lora_shrink_kernel" in k for k in v["kernels"])
        expand = sum("_lora_expand_kernel" in k for k in v["kernels"])
        if splitk and v["tokens"] <= LORA_EPILOGUE_MAX_TOKENS:
            in_launch += 1
            assert v["kernels"] == [k for k in v["kernels"] if "nvfp4_gemm_splitk_kernel" in k] and splitk == 1, v
            continue
        if any("nvfp4_gemm_decode_tma_linear_kernel" in k for k in v["kernels"]):  # the decode kernel's, likewise
            in_launch += 1
            assert len(v["kernels"]) == 1, v
            continue
        no_triton = splitk or any("decode_tma" in k for k in v["kernels"]) or v["tokens"] >= CUBLAS_MIN_TOKENS
        assert expand == (0 if no_triton else 1), (name, v)
        if v["tokens"] <= TRITON_MAX_TOKENS:
            assert shrink == 1, (name, v)
    print(f"\nlayers with the shrink in the GEMM's launch: {in_launch} of {len(qerl)}")
