"""The actor's two no-flash-attn paths side by side: verl's fallbacks vs verl-qerl's, one GPU, one run.

Where the flash-attn package is missing, verl 0.9.1's FSDP actor (i) takes token log-probs with a Python loop
over rows (``logprobs_from_logits_v2``) and (ii) runs on padded batches with SDPA and an explicit mask. verl-qerl
replaces (i) by chunked log-probs (``verl_qerl.verl.logprobs``) and (ii) by packed rows on PyTorch's
FlashAttention-2 (``qerl_varlen``, ``verl_qerl.verl.varlen_attention``). This times both pairs on one micro-batch
of the GRPO reasoning preset (4 sequences of ~2,176 tokens, Qwen2.5's vocabulary of 151,936; attention of the
Qwen2.5-7B shape, 28 query / 4 KV heads of 128), forward + backward, CUDA events, median of ``--repeats``:

    python benchmarks/actor_paths.py            # writes benchmarks/results/actor_paths-<gpu>.json

Results JSON: ``device``, ``versions``, ``command``, ``date``, ``rows`` and ``targets``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from machine_check import median_cuda_ms  # noqa: E402 - benchmarks/: this script's own folder
from results_format import report_and_write  # noqa: E402

from verl_qerl.verl.logprobs import token_logprobs  # noqa: E402
from verl_qerl.verl.varlen_attention import varlen_attention_forward  # noqa: E402

#: Sequence lengths of one micro-batch (prompts of 52-128 tokens + 2,048-token responses, as the preset draws).
LENGTHS = (2176, 2131, 2100, 2155)


def _timed(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs after two warm-ups."""
    return median_cuda_ms(fn, repeats, warmup=2)


def logprob_rows(vocab: int, repeats: int) -> list[dict]:
    import verl.utils.torch_functional as verl_F

    total = sum(LENGTHS)
    g = torch.Generator(device="cuda").manual_seed(0)
    base = (torch.randn(total, vocab, device="cuda", generator=g) * 3).bfloat16()
    labels = torch.randint(0, vocab, (total,), device="cuda", generator=g)
    rows = []
    for name, fn in (("verl logprobs_from_logits_v2 (per-row loop)", verl_F.logprobs_from_logits_v2),
                     ("verl-qerl token_logprobs (chunked)", token_logprobs)):
        def fwd(fn=fn):
            with torch.no_grad():
                fn(base, labels)

        def fwd_bwd(fn=fn):
            x = base.detach().requires_grad_(True)
            fn(x, labels).float().sum().backward()

        rows.append({"op": "token log-probs", "path": name, "rows": total, "vocab": vocab,
                     "forward_ms": _timed(fwd, repeats), "forward_backward_ms": _timed(fwd_bwd, repeats)})
    return rows


def attention_rows(heads: int, kv_heads: int, head_dim: int, repeats: int) -> list[dict]:
    b, s = len(LENGTHS), max(LENGTHS)
    total = sum(LENGTHS)
    g = torch.Generator(device="cuda").manual_seed(1)
    scale = head_dim ** -0.5

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g).bfloat16()

    # padded: what transformers' SDPA path runs for verl's padded micro-batch (bool mask = causal & key padding)
    qp, kp, vp = rnd(b, heads, s, head_dim), rnd(b, kv_heads, s, head_dim), rnd(b, kv_heads, s, head_dim)
    valid = torch.arange(s, device="cuda")[None, :] < torch.tensor(LENGTHS, device="cuda")[:, None]
    mask = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()[None, None] & valid[:, None, None, :]
    groups = heads // kv_heads

    def padded(q, k, v):
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    # packed: one row of the four sequences, qerl_varlen
    qv, kv_, vv = rnd(1, heads, total, head_dim), rnd(1, kv_heads, total, head_dim), rnd(1, kv_heads, total, head_dim)
    pos = torch.cat([torch.arange(n, device="cuda") for n in LENGTHS])[None]

    def packed(q, k, v):
        return varlen_attention_forward(None, q, k, v, None, scaling=scale, position_ids=pos)[0]

    rows = []
    for name, fn, tensors in (("SDPA, padded batch with mask", padded, (qp, kp, vp)),
                              ("qerl_varlen, packed rows", packed, (qv, kv_, vv))):
        def fwd(fn=fn, tensors=tensors):
            with torch.no_grad():
                fn(*tensors)

        def fwd_bwd(fn=fn, tensors=tensors):
            ts = [t.detach().requires_grad_(True) for t in tensors]
            fn(*ts).float().sum().backward()

        rows.append({"op": "attention, one layer", "path": name, "lengths": list(LENGTHS), "heads": heads,
                     "kv_heads": kv_heads, "head_dim": head_dim, "forward_ms": _timed(fwd, repeats),
                     "forward_backward_ms": _timed(fwd_bwd, repeats)})
    return rows


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "cuda": torch.version.cuda}
    for pkg in ("torch", "transformers", "verl"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--layers", type=int, default=28, help="decoder layers per forward (7B: 28)")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/actor_paths-<gpu>.json)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("actor_paths.py: needs a CUDA GPU (the paths it compares are GPU paths)")
    device = torch.cuda.get_device_name()
    rows = logprob_rows(args.vocab, args.repeats) + attention_rows(28, 4, 128, args.repeats)
    for r in rows:
        print(f"{r['op']:22} {r['path']:46} fwd {r['forward_ms']:9.2f} ms   fwd+bwd {r['forward_backward_ms']:9.2f} ms")
    lp_old, lp_new, at_old, at_new = rows
    # per micro-batch of the update (forward, recomputed forward, backward): log-probs once, attention per layer
    old = lp_old["forward_backward_ms"] + args.layers * (at_old["forward_ms"] + at_old["forward_backward_ms"])
    new = lp_new["forward_backward_ms"] + args.layers * (at_new["forward_ms"] + at_new["forward_backward_ms"])
    print(f"per update micro-batch (log-probs + {args.layers} layers' attention incl. the recompute): "
          f"{old:.1f} -> {new:.1f} ms")
    targets = [
        {"name": "token log-probs fwd+bwd, verl's loop / chunked (x faster)",
         "measured": round(lp_old["forward_backward_ms"] / lp_new["forward_backward_ms"], 2), "op": ">=",
         "target": 1.0},
        {"name": "attention fwd+bwd, padded SDPA / qerl_varlen (x faster)",
         "measured": round(at_old["forward_backward_ms"] / at_new["forward_backward_ms"], 2), "op": ">=",
         "target": 1.0},
    ]
    name = device.lower().replace(" ", "-")
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"actor_paths-{name}.json"
    report_and_write(out, {
        "benchmark": "actor_paths", "device": device, "versions": versions(),
        "command": "python3 benchmarks/actor_paths.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "rows": rows,
        "per_update_micro_batch_ms": {"verl_fallbacks": old, "verl_qerl": new}, "targets": targets})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
