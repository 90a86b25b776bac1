"""Per-rank bytes of the frozen actor base under FSDP2, vs the number of ranks N: QeRL vs BF16 LoRA.

The stored bytes of a frozen base are a function of the shapes alone, so this computes them exactly for the
Qwen2.5 shapes of ``benchmarks/rollout.py`` (+ 72B) and any N (the GPU runs measure the same quantities:
``verl_qerl.modeling.fsdp.base_bytes`` on each rank; ``tests/test_fsdp_sharded.py`` checks that formula and
measurement agree on 2 and 4 gloo ranks). FSDP2 splits dim 0 like ``torch.chunk``: rank 0 holds
``ceil(rows / N)`` rows of every tensor, the most of any rank, and that is what is reported.

Columns (GB = 1e9 bytes), all per rank:

* ``qerl`` - the NVFP4 Linear base sharded (``qerl.shard_base``, the default): codes 0.5 B + E4M3 block scales
  1/16 B per weight, sharded; the 4-byte global scale of each layer replicated;
* ``qerl_repl`` - the same base replicated on every rank (``qerl.shard_base=false``, and FSDP1);
* ``lora_bf16`` - a BF16 LoRA actor's Linear base, 2 B per weight, sharded (``model_dtype=bf16``);
* ``lora_fp32`` - the same in verl's default training dtype (fp32 storage, bf16 compute): 4 B per weight;
* ``emb_fp32`` - embeddings + LM head (dense in both modes; QeRL keeps ``lm_head`` in BF16), sharded,
  in verl's fp32 default (halve for bf16).

LoRA adapters, their gradients and optimizer states are the same for both modes and left out.

    python3 benchmarks/memory_table.py                 # 7b, 32b, 72b x N = 1, 2, 4, 8
    python3 benchmarks/memory_table.py --models 7b --ranks 1,2 --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from rollout import SHAPES  # noqa: E402 - benchmarks/: this script's own folder

#: Qwen2.5-72B (untied embeddings, q/k/v biases), beside the 7b/32b of benchmarks/rollout.py.
QWEN25_72B = dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=152064)
MODELS = {**SHAPES, "72b": QWEN25_72B}

BLOCK = 16         # NVFP4 block size: one E4M3 scale per 16 weights
GLOBAL_SCALE = 4   # bytes of a layer's fp32 global scale


def linear_shapes(shape: dict) -> list[tuple[int, int]]:
    """(rows, in_features) of the quantized Linear layers of one decoder layer (q, k, v, o, gate, up, down)."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    return [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]


def _rows(rows: int, ranks: int) -> int:
    """Rows rank 0 holds when FSDP2 chunks ``rows`` over ``ranks`` (the largest share)."""
    return math.ceil(rows / ranks)


def nvfp4_layer_bytes(rows: int, k: int, ranks: int = 1, *, sharded: bool = True) -> int:
    """Bytes one rank stores for one NVFP4Linear: codes + block scales (sharded or not) + global scale."""
    r = _rows(rows, ranks) if sharded else rows
    return r * (k // 2 + k // BLOCK) + GLOBAL_SCALE


def base_bytes_per_rank(shape: dict, ranks: int) -> dict[str, int]:
    """The columns of the table (module docstring), in bytes, for ``shape`` over ``ranks`` FSDP2 ranks."""
    layers = shape["num_hidden_layers"]
    lin = linear_shapes(shape)
    emb = 2 * _rows(shape["vocab_size"], ranks) * shape["hidden_size"]  # embed_tokens + lm_head, elements
    return {
        "qerl": layers * sum(nvfp4_layer_bytes(n, k, ranks) for n, k in lin),
        "qerl_repl": layers * sum(nvfp4_layer_bytes(n, k, ranks, sharded=False) for n, k in lin),
        "lora_bf16": layers * sum(2 * _rows(n, ranks) * k for n, k in lin),
        "lora_fp32": layers * sum(4 * _rows(n, ranks) * k for n, k in lin),
        "emb_fp32": 4 * emb,
    }


def table(models: list[str], ranks: list[int]) -> list[dict]:
    return [{"model": m, "ranks": n, **base_bytes_per_rank(MODELS[m], n)} for m in models for n in ranks]


def markdown(rows: list[dict]) -> str:
    cols = ("qerl", "qerl_repl", "lora_bf16", "lora_fp32", "emb_fp32")
    out = ["| model | N | " + " | ".join(f"{c} GB" for c in cols) + " | qerl / lora_bf16 |",
           "|---|---|" + "---|" * (len(cols) + 1)]
    for r in rows:
        cells = " | ".join(f"{r[c] / 1e9:.2f}" for c in cols)
        out.append(f"| {r['model']} | {r['ranks']} | {cells} | {r['qerl'] / r['lora_bf16']:.3f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="7b,32b,72b", help=f"comma list of {','.join(MODELS)}")
    p.add_argument("--ranks", default="1,2,4,8", help="comma list of FSDP world sizes")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a markdown table")
    args = p.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")
    try:
        ranks = [int(n) for n in args.ranks.split(",")]
    except ValueError:
        p.error(f"--ranks {args.ranks!r}: expected a comma list of positive integers")
    if any(n < 1 for n in ranks):
        p.error(f"--ranks {args.ranks!r}: world sizes must be >= 1")
    rows = table(models, ranks)
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
