"""The real pretrained GGUFs shipped in pip packages, end to end on CPU.

For each model whose packages are installed: :func:`verl_qerl.pretrained.prepare` converts it into
a BF16 Hugging Face folder, and

* greedy generations of that folder in transformers equal those of transformers' own GGUF load
  (the oracle) on chat prompts, token for token;
* the same in vLLM's CPU engine (plain BF16 weights, ``qerl_nvfp4`` off);
* vLLM's ``qerl_nvfp4`` engine on the folder, forced to choose the FP4 GEMM layout
  (``QERL_NVFP4_BACKEND=kernel``: SmolLM2's K=576 layers must fall back, its K=1536 ones repack),
  gives the log-probabilities of :func:`verl_qerl.modeling.load_nvfp4_model` on the same folder;
* ``qerl-quantize`` of the folder loads with ``load_nvfp4_model``, and LoRA on top trains
  (gradients reach the adapters only).

A model whose packages are missing is skipped, unless the environment was built by
``examples/setup_env.sh`` and that script installs it (it lists such models in
``$VENV/qerl-pretrained-required``) or ``QERL_REQUIRE_PRETRAINED`` names it: then a missing package
is a failure, so CI cannot pass by silently skipping. With ``QERL_PRETRAINED_CACHE`` set, a conversion
cached there is reused (the Qwen conversion takes minutes on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from verl_qerl import pretrained
from verl_qerl.testing.procs import shutdown_vllm_engine

PROMPTS = (
    "Tom has 23 apples and buys 19 more. How many apples does he have now?",
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
)
MAX_NEW_TOKENS = 24
KEYS = ("smollm2-135m", "qwen2.5-coder-0.5b")
REQUIRED_FILE = Path(sys.prefix) / "qerl-pretrained-required"


def required_models() -> set[str]:
    """Models whose absence is a failure: listed by setup_env.sh in the venv, or in QERL_REQUIRE_PRETRAINED."""
    keys = set(filter(None, os.environ.get("QERL_REQUIRE_PRETRAINED", "").replace(",", " ").split()))
    if REQUIRED_FILE.is_file():
        keys |= set(REQUIRED_FILE.read_text().split())
    return keys


def _require(key: str) -> pretrained.PretrainedModel:
    model = pretrained.get_model(key)
    try:
        pretrained.locate_parts(model)
        pretrained.require_gguf()
    except pretrained.PretrainedNotInstalled as err:
        if key in required_models():
            pytest.fail(f"{key} is required here ({REQUIRED_FILE} or QERL_REQUIRE_PRETRAINED) but: {err}")
        pytest.skip(str(err))
    return model


@pytest.fixture(scope="module", params=KEYS)
def real(request, tmp_path_factory) -> dict:
    """The converted folder, the (joined) GGUF and its tokenized chat prompts, for one model."""
    key = request.param
    model = _require(key)
    base = tmp_path_factory.mktemp(key)
    t0 = time.perf_counter()
    # QERL_PRETRAINED_CACHE set: reuse (or fill) that cache, as qerl-pretrained does; else convert afresh.
    out = pretrained.default_cache_dir() / key if os.environ.get("QERL_PRETRAINED_CACHE") else base / "hf"
    folder = pretrained.prepare(key, out, progress=False)
    convert_s = time.perf_counter() - t0
    gguf_file = pretrained.assemble_gguf(model, base / "gguf", progress=False)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                   return_dict=True)["input_ids"] for p in PROMPTS]
    return {"key": key, "folder": folder, "gguf": gguf_file, "ids": [list(i) for i in ids], "tok": tok,
            "convert_s": convert_s}


def _hf_greedy(model, prompts: list[list[int]], n: int = MAX_NEW_TOKENS) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                 min_new_tokens=n, pad_token_id=model.generation_config.pad_token_id)
            outs.append(out[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def gguf_greedy(real) -> list[list[int]]:
    """The oracle: transformers' own GGUF load (dequantized, float32), greedy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(real["gguf"].parent, gguf_file=real["gguf"].name,
                                                 dtype=torch.float32).eval()
    return _hf_greedy(model, real["ids"])


@pytest.mark.slow
def test_converted_folder_is_plain_bf16(real):
    config = json.loads((real["folder"] / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(real["folder"] / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    assert real["tok"].chat_template and "<|im_start|>" in real["tok"].chat_template
    print(f"\n[{real['key']}] converted in {real['convert_s']:.1f} s")


@pytest.mark.slow
def test_transformers_greedy_equals_gguf_load(real, gguf_greedy):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(real["folder"], dtype=torch.float32).eval()
    got = _hf_greedy(model, real["ids"])
    for prompt, want, out in zip(PROMPTS, gguf_greedy, got):
        assert out == want, (prompt, real["tok"].decode(want), real["tok"].decode(out))
    print(f"\n[{real['key']}] " + " | ".join(repr(real["tok"].decode(o)) for o in got))


# ------------------------------------------------------------------------------------------------
# vLLM (CPU engine) in a driver subprocess: vLLM's engine leaves process-global state behind.
# ------------------------------------------------------------------------------------------------



def _driver(job_file: str, out_file: str) -> None:
    from vllm import LLM, SamplingParams

    job = json.loads(Path(job_file).read_text())
    results = {}
    for eng in job["engines"]:
        os.environ.update(eng.get("env", {}))
        t0 = time.perf_counter()
        llm = LLM(**eng["llm"])
        startup = time.perf_counter() - t0
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], min_tokens=job["max_tokens"],
                                logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
        res = []
        for out in outs:
            comp = out.outputs[0]
            res.append({"tokens": list(comp.token_ids),
                        "logprobs": [float(step[t].logprob) for t, step in zip(comp.token_ids, comp.logprobs)]})
        results[eng["name"]] = {"outputs": res, "startup_s": startup, "total_s": time.perf_counter() - t0}
        shutdown_vllm_engine(llm)
        for key in eng.get("env", {}):
            os.environ.pop(key, None)
    Path(out_file).write_text(json.dumps(results))


def run_vllm(engines: list[dict], prompts: list[list[int]], timeout: float = 1800) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"engines": engines, "prompts": prompts, "max_tokens": MAX_NEW_TOKENS}))
        proc = subprocess.run([sys.executable, __file__, str(job), str(out)], env=env, capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
            raise AssertionError(f"vLLM driver failed (rc={proc.returncode}):\n{tail}")
        results = json.loads(out.read_text())
    results["_log"] = proc.stdout + proc.stderr
    return results


def _llm(model: Path, **extra) -> dict:
    return dict(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=4, seed=0,
                **extra)


@pytest.fixture(scope="module")
def nvfp4_folder(real, tmp_path_factory) -> Path:
    from verl_qerl.cli.quantize import main as qerl_quantize

    dst = tmp_path_factory.mktemp(real["key"]) / "nvfp4"
    assert qerl_quantize([str(real["folder"]), str(dst)]) == 0
    return dst


@pytest.mark.slow
def test_vllm_bf16_and_qerl_nvfp4_engines(real, gguf_greedy):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    from verl_qerl.modeling import load_nvfp4_model

    engines = [
        {"name": "bf16", "llm": _llm(real["folder"])},
        # BF16 checkpoint quantized at load; the FP4 GEMM layout forced, so the K-tile rule decides per layer.
        {"name": "nvfp4", "llm": _llm(real["folder"], quantization="qerl_nvfp4"),
         "env": {"QERL_NVFP4_BACKEND": "kernel"}},
    ]
    res = run_vllm(engines, real["ids"])
    tok = real["tok"]
    for prompt, want, out in zip(PROMPTS, gguf_greedy, res["bf16"]["outputs"]):
        assert out["tokens"] == want, (prompt, tok.decode(want), tok.decode(out["tokens"]))
    hidden = json.loads((real["folder"] / "config.json").read_text())["hidden_size"]
    if hidden % 128:
        assert "cannot use the FP4 GEMM layout" in res["_log"] and f"K={hidden}" in res["_log"]

    # The NVFP4 engine's log-probabilities equal the HF NVFP4 policy's (load_nvfp4_model quantizing the BF16
    # folder at load: the same quantization as the engine's, bit for bit), teacher-forced on the engine's own
    # tokens, both in float32.
    model = load_nvfp4_model(real["folder"], dtype=torch.float32)
    worst = 0.0
    for prompt_ids, out in zip(real["ids"], res["nvfp4"]["outputs"]):
        seq = torch.tensor([prompt_ids + out["tokens"]])
        with torch.no_grad():
            logits = model(seq).logits[0, len(prompt_ids) - 1:-1].float()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out["tokens"])[:, None])[:, 0]
        diff = (ref - torch.tensor(out["logprobs"])).abs().max().item()
        worst = max(worst, diff)
        assert diff < 2e-3, (tok.decode(out["tokens"]), diff)
    print(f"\n[{real['key']}] vLLM startup bf16 {res['bf16']['startup_s']:.0f} s, nvfp4 "
          f"{res['nvfp4']['startup_s']:.0f} s; nvfp4 |logprob - HF| max {worst:.1e}; nvfp4 says: "
          + " | ".join(repr(tok.decode(o["tokens"])) for o in res["nvfp4"]["outputs"]))


@pytest.mark.slow
def test_nvfp4_lora_trains_on_real_model(real, nvfp4_folder):
    pytest.importorskip("peft")
    from verl_qerl.modeling import NVFP4Linear, get_lora_model, load_nvfp4_model

    model = load_nvfp4_model(nvfp4_folder, dtype=torch.bfloat16)
    assert sum(isinstance(m, NVFP4Linear) for m in model.modules()) == 7 * model.config.num_hidden_layers
    seq = torch.tensor([real["ids"][0]])
    with torch.no_grad():
        base = model(seq).logits
    peft_model = get_lora_model(model, r=8, lora_alpha=16)
    out = peft_model(seq, labels=seq)
    assert torch.equal(out.logits, base)  # B = 0 at init: LoRA changes nothing yet
    out.loss.backward()
    trainable = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, _ in trainable)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for _, p in trainable)
    assert torch.isfinite(out.loss) and out.loss.item() < 10


if __name__ == "__main__":
    _driver(*sys.argv[1:])
