"""The settings of ``benchmarks/grpo_step.py``: variants, presets and the reuse of earlier runs (``--baseline``).

Kept apart from the runner so that what a run *is* (which ``+qerl=`` option a variant selects, the learning rate it
trains at, the defaults a ``--preset`` changes, the per-phase targets it is held to) and the rule that decides
whether an earlier results JSON may stand in for a run (the settings both must share, and what a setting missing
from an older file meant) are read in one place, apart from launching ``main_ppo`` and from scoring its metrics.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from results_format import read_earlier, read_json  # benchmarks/: this module's own folder

REPO = Path(__file__).resolve().parent.parent

#: variant -> the hydra group option of ``+qerl=`` (verl_qerl/verl/hydra/qerl/*.yaml)
VARIANTS = {"qerl": "nvfp4", "nvfp4": "nvfp4_noaqn", "lora": "bf16", "qlora": "nf4"}
#: the paper's learning rates (QeRL Table 4 and its released scripts): 1e-5 for the 4-bit variants, 5e-6 for BF16
#: LoRA (which "collapses" above 5e-6); ``--lr paper`` gives each variant its own
PAPER_LR = {"qerl": 1e-5, "nvfp4": 1e-5, "qlora": 1e-5, "lora": 5e-6}
#: the random checkpoints' real tokenizer for --preset reasoning (git-ignored; carried to the GPU machine)
DEFAULT_TOKENIZER = REPO / ".tokenizers" / "qwen2.5"
TOKENIZER_COMMAND = f"qerl-pretrained qwen2.5-coder-0.5b --tokenizer-only --out {DEFAULT_TOKENIZER}"
#: the run settings that --preset sets (explicit flags win); everything else keeps its own default
GENERIC = dict(steps=4, batch=16, n=8, prompt_length=128, response_length=512, micro_batch=8, lora_rank=32, lr=1e-5,
               gpu_memory_utilization=0.3, timeout=900.0, ignore_eos=False, tokenizer=None)
PRESETS = {
    # Reasoning RL (module docstring): 32 prompts x 8 = 256 sequences of exactly 2048 tokens, real vocabulary
    "reasoning": dict(steps=3, batch=32, n=8, prompt_length=128, response_length=2048, micro_batch=4, lora_rank=32,
                      lr="paper", gpu_memory_utilization=0.5, timeout=1650.0, ignore_eos=True,
                      tokenizer=str(DEFAULT_TOKENIZER)),
}
#: issue 20's targets for --preset reasoning, QeRL / BF16 LoRA per phase: step, generation, and no training phase
#: slower than 1.05x
PRESET_TARGETS = {"reasoning": {"step": 0.80, "gen": 0.70, "old_log_prob": 1.05, "update_actor": 1.05}}
#: settings a --baseline must share with this invocation for its rows to be comparable
BASELINE_SETTINGS = ("model", "batch", "n", "prompt_length", "response_length", "micro_batch", "lora_rank", "lr",
                     "steps", "seed", "tp", "gpu_memory_utilization", "gradient_checkpointing", "enforce_eager",
                     "data", "reward", "tiny", "replay_poll_s", "preset", "ignore_eos", "tokenizer_id")
#: what a setting missing from an older results JSON meant: files written before ``qerl.replay_poll_s`` existed
#: ran under verl's own 2 s rollout polling; before --preset / --ignore-eos / --tokenizer, runs had none of them
#: (``tokenizer_id`` None = the checkpoint's own tokenizer: the tiny 512-id one of the random checkpoints)
BASELINE_DEFAULTS = {"replay_poll_s": 2.0, "preset": None, "ignore_eos": False, "tokenizer_id": None}


class StepBenchError(RuntimeError):
    """A setup problem the user can fix; printed without a traceback."""


def lr_for(args: argparse.Namespace, variant: str) -> float:
    """The actor learning rate of ``variant``: ``--lr`` as given, or the paper's for that variant (``--lr paper``)."""
    return PAPER_LR[variant] if args.lr == "paper" else float(args.lr)


def load_baselines(paths: list[str], args: argparse.Namespace, device: str) -> dict[tuple[str, int], dict]:
    """{(variant, gpus): row} of earlier results JSONs (their rows without "error"), each row marked
    ``from_baseline``; refused unless measured on ``device`` with this invocation's settings. Why: one remote call
    is limited to 10 minutes, so a comparison's runs are spread over calls. A later file wins a duplicate row."""
    found: dict[tuple[str, int], dict] = {}
    for path in paths:
        try:
            res = read_earlier(path, flag="--baseline", script="grpo_step.py", section="settings", device=device,
                               keys=BASELINE_SETTINGS, here=vars(args), defaults=BASELINE_DEFAULTS)
        except ValueError as exc:
            raise StepBenchError(str(exc)) from exc
        for row in res["rows"]:
            if "error" not in row:
                found[(row["variant"], row["gpus"])] = {**row, "from_baseline": str(path)}
    return found


def baseline_origin(paths: list[str]) -> tuple[str, dict]:
    """(device, versions) of the --baseline files for ``--merge-only``: the files must agree on the device (their
    settings are checked against this invocation by ``load_baselines``); versions are the first file's."""
    found = []
    for path in paths:
        try:
            res = read_json(path, "--baseline")
        except ValueError as exc:
            raise StepBenchError(str(exc)) from exc
        if not isinstance(res, dict):
            raise StepBenchError(f"--baseline {path}: not a grpo_step.py results JSON (a JSON "
                                 f"{type(res).__name__}, not an object)")
        found.append((path, res.get("device"), res.get("versions") or {}))
    devices = {dev for _, dev, _ in found}
    if len(devices) != 1 or None in devices:
        raise StepBenchError("--merge-only: the --baseline files were measured on different devices: "
                             + "; ".join(f"{path}: {dev!r}" for path, dev, _ in found))
    return found[0][1], found[0][2]
