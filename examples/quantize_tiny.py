"""Quantize the tiny default to NVFP4 and check it against compressed-tensors (a quick format demo).

Make a tiny random-weight Qwen2 locally, quantize it to NVFP4 with ``qerl-quantize``, load the
result through compressed-tensors (the format's reference implementation) and check every quantized
weight against ours, and compare the NVFP4 model's next-token distribution with the BF16 original.
The README's main job is examples/run_default.sh (a verl main_ppo QeRL run).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

#: The folders this script writes under --workdir; nothing else there is touched.
OUTPUTS = ("tiny-bf16", "tiny-nvfp4")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def write_outputs(work: Path, build: Callable[[Path], None]) -> tuple[Path, Path]:
    """Have ``build(staging)`` write :data:`OUTPUTS` into a fresh folder, then move them into ``work``.

    Only ``work/tiny-bf16`` and ``work/tiny-nvfp4`` are replaced (each by a rename, once both new ones are
    complete); other files in ``work`` are kept. If ``build`` fails, ``work`` is left as it was.
    """
    work.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".quantize_tiny-", dir=work))
    try:
        build(staging)
        missing = [name for name in OUTPUTS if not (staging / name).is_dir()]
        if missing:
            raise RuntimeError(f"{staging}: the build did not write {missing}")
        for name in OUTPUTS:
            old = staging / f"{name}.old"
            if (work / name).exists() or (work / name).is_symlink():
                (work / name).rename(old)  # out of the way first; removed below with the staging folder
            (staging / name).rename(work / name)
    finally:
        _remove(staging)
    return work / OUTPUTS[0], work / OUTPUTS[1]


def _build(staging: Path) -> None:
    from verl_qerl.testing.tiny import make_tiny_model

    t0 = time.perf_counter()
    bf16 = make_tiny_model(staging / OUTPUTS[0])
    print(f"[default] tiny Qwen2 written ({time.perf_counter() - t0:.1f} s)")
    subprocess.run([sys.executable, "-m", "verl_qerl.cli.quantize", str(bf16), str(staging / OUTPUTS[1])],
                   check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", default="runs/default",
                    help="where the tiny model and its NVFP4 copy go (its tiny-bf16 and tiny-nvfp4 folders are "
                    "replaced; other files there are kept)")
    args = ap.parse_args()
    work = Path(args.workdir)
    bf16, nvfp4 = write_outputs(work, _build)
    print(f"[default] wrote {bf16} and {nvfp4}")

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from verl_qerl.nvfp4.checkpoint import CheckpointReader

    ref = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32).eval()
    ct = AutoModelForCausalLM.from_pretrained(
        nvfp4, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.bfloat16
    ).eval()
    reader = CheckpointReader(nvfp4)
    params = dict(ct.named_parameters())
    mismatched = [m for m in reader.nvfp4_modules()
                  if not torch.equal(params[f"{m}.weight"].detach(), reader.read_nvfp4(m).dequantize(torch.bfloat16))]
    ct = ct.float()
    print(f"[default] compressed-tensors loaded {len(reader.nvfp4_modules())} NVFP4 layers; "
          f"{len(mismatched)} differ from our dequantization")

    tok = AutoTokenizer.from_pretrained(nvfp4)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        p = torch.log_softmax(ref(ids).logits[0, -1], -1)
        q = torch.log_softmax(ct(ids).logits[0, -1], -1)
    kl = float((p.exp() * (p - q)).sum())
    ent = lambda lp: float(-(lp.exp() * lp).sum())  # noqa: E731
    print(f"[default] next-token KL(bf16 || nvfp4) = {kl:.2e}; entropy bf16 {ent(p):.4f} vs nvfp4 {ent(q):.4f} nats")
    ok = not mismatched and kl < 0.1
    print("[default] OK" if ok else "[default] FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
