"""Step-0 entropy probe: does NVFP4 (and AQN) raise the SFT policy's next-token entropy before any RL step?

The GRPO arms all start from one SFT checkpoint and measure entropy through temperature-1 rollouts, so seed noise
and the rollouts' own randomness sit on top of any effect. Here every variant of the *same* weights scores the
*same* token positions (teacher forcing on held-out problems with their reference solutions), so the differences
are paired and small effects are measurable:

* ``bf16``: the checkpoint as the BF16 LoRA arm starts from it (LoRA is zero-initialised, so it adds nothing);
* ``nvfp4``: its Linear layers quantized exactly as the QeRL actor quantizes them
  (:func:`verl_qerl.modeling.quantize_model`, ``lm_head`` kept in BF16);
* ``nvfp4+aqn@<sigma>``: plus Adaptive Quantization Noise on the RMSNorm weights, drawn as the trainer draws it
  (:class:`verl_qerl.aqn.NormNoiser`, same seed and step for every sigma);
* ``bf16+aqn@<sigma>`` (with ``--bf16-aqn``): the same noise on the unquantized checkpoint (the BF16 LoRA + AQN
  arm's starting sampler).

Per variant: mean next-token entropy at temperature 1 (nats/token), mean KL(bf16 || variant), top-1 agreement
with bf16 and the reference tokens' NLL; per non-bf16 variant the entropy ratio to bf16 with a 95% bootstrap
interval over problems. Writes one JSON with ``targets`` (ratio >= 1.0: "quantization raises entropy", recorded
whatever it measures).

usage: python examples/exploration/entropy_probe.py --model DIR --data DIR --out FILE [--sigmas 0.01,0.005]
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sft import encode_examples, make_batch  # noqa: E402
from summarize import versions  # noqa: E402

STATS = ("entropy", "kl_from_bf16", "top1_agree", "ref_nll")



def read_rows(data: Path, n: int) -> list[dict[str, Any]]:
    """The first ``n`` held-out problems of ``dev.jsonl`` (prompt messages + reference response)."""
    path = data / "dev.jsonl"
    if not path.is_file():
        raise SystemExit(f"entropy_probe.py: {path} not found (problems.py --out {data} writes it)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"entropy_probe.py: {path} is empty")
    return rows[:n] if n > 0 else rows


def position_stats(ref_logits: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sequence sums over the completion positions (``labels != -100``, next-token aligned) of entropy,
    KL(ref || this), top-1 agreement with ``ref`` and the label's NLL, plus the token count ``n``."""
    target = labels[:, 1:]
    keep = target != -100
    lp_ref = torch.log_softmax(ref_logits[:, :-1].float(), dim=-1)
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    p = lp.exp()
    per_pos = {
        "entropy": -(p * lp).sum(-1),
        "kl_from_bf16": (lp_ref.exp() * (lp_ref - lp)).sum(-1),
        "top1_agree": (lp.argmax(-1) == lp_ref.argmax(-1)).float(),
        "ref_nll": -lp.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1),
    }
    out = {k: (v * keep).sum(-1) for k, v in per_pos.items()}
    out["n"] = keep.sum(-1).float()
    return out


def bootstrap_ratio(num: torch.Tensor, den: torch.Tensor, *, draws: int = 2000,
                    seed: int = 0) -> tuple[float, float, float]:
    """sum(num) / sum(den) over problems (per-problem sums over the same token positions, so this is the ratio
    of per-token means) and its 95% interval with problems resampled."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, num.numel(), (draws, num.numel()), generator=g)
    ratios = num[idx].sum(-1) / den[idx].sum(-1)
    lo, hi = torch.quantile(ratios.double(), torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return float(num.sum() / den.sum()), lo, hi


@torch.no_grad()
def probe(model_dir: Path, data: Path, *, n: int = 256, sigmas: tuple[float, ...] = (0.01, 0.005), seed: int = 0,
          batch_size: int = 64, device: str = "auto", bf16_aqn: bool = False) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_qerl.aqn import AQNConfig, NormNoiser
    from verl_qerl.modeling import quantize_model

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(dev).eval()
    quant = quantize_model(copy.deepcopy(base), "nvfp4").eval()
    noiser = NormNoiser.from_config(quant.named_parameters(), AQNConfig(seed=seed))
    base_noiser = NormNoiser.from_config(base.named_parameters(), AQNConfig(seed=seed)) if bf16_aqn else None
    rows = read_rows(data, n)
    examples = encode_examples(tok, rows)
    variants = ["bf16", "nvfp4"] + [f"nvfp4+aqn@{s:g}" for s in sigmas]
    variants += [f"bf16+aqn@{s:g}" for s in sigmas] if bf16_aqn else []
    sums: dict[str, dict[str, list[torch.Tensor]]] = {v: {k: [] for k in (*STATS, "n")} for v in variants}
    for start in range(0, len(examples), batch_size):
        ids, mask, labels = make_batch(examples[start:start + batch_size], tok.pad_token_id, dev)
        ref = base(input_ids=ids, attention_mask=mask).logits
        for v in variants:
            if v == "bf16":
                logits = ref
            elif v == "nvfp4":
                logits = quant(input_ids=ids, attention_mask=mask).logits
            else:
                model, nz = (base, base_noiser) if v.startswith("bf16+") else (quant, noiser)
                nz.apply(1, float(v.split("@")[1]))
                try:
                    logits = model(input_ids=ids, attention_mask=mask).logits
                finally:
                    nz.restore()
            for k, t in position_stats(ref, logits, labels).items():
                sums[v][k].append(t.cpu())
    per_seq = {v: {k: torch.cat(t) for k, t in d.items()} for v, d in sums.items()}
    tokens = per_seq["bf16"]["n"]
    result: dict[str, Any] = {"variants": {}, "entropy_ratio_to_bf16": {}}
    for v in variants:
        total = float(per_seq[v]["n"].sum())
        result["variants"][v] = {k: float(per_seq[v][k].sum()) / total for k in STATS}
    for v in variants[1:]:
        ratio, lo, hi = bootstrap_ratio(per_seq[v]["entropy"], per_seq["bf16"]["entropy"], seed=seed)
        result["entropy_ratio_to_bf16"][v] = {"ratio": ratio, "ci95": [lo, hi]}
    result.update(
        n_problems=len(examples), n_tokens=int(tokens.sum()), sigmas=list(sigmas), aqn_seed=seed, aqn_step=1,
        aqn_norms=len(noiser.names), device=str(dev),
        targets=[{"name": f"step0_entropy_ratio[{v}/bf16] (same weights, teacher-forced, {len(examples)} problems)",
                  "measured": round(r["ratio"], 5), "op": ">=", "target": 1.0,
                  "note": f"95% bootstrap interval {r['ci95'][0]:.4f}-{r['ci95'][1]:.4f}"}
                 for v, r in result["entropy_ratio_to_bf16"].items()],
    )
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the SFT checkpoint folder (sft.py --out)")
    ap.add_argument("--data", required=True, help="problems.py --out folder (reads dev.jsonl)")
    ap.add_argument("--out", required=True, help="results JSON to write")
    ap.add_argument("--n", type=int, default=256, help="held-out problems (0: all of dev.jsonl)")
    ap.add_argument("--sigmas", default="0.01,0.005", help="AQN sigmas (comma list; the schedule's start is 0.01)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--bf16-aqn", action="store_true", help="also score bf16+aqn@<sigma> (the BF16 + AQN arm)")
    args = ap.parse_args(argv)
    try:
        sigmas = tuple(float(s) for s in args.sigmas.split(",") if s.strip())
    except ValueError:
        ap.error(f"--sigmas {args.sigmas!r}: expected numbers separated by commas")
    if any(s <= 0 for s in sigmas):
        ap.error(f"--sigmas {args.sigmas!r}: every sigma must be > 0")
    out = Path(args.out)
    if out.exists() and out.is_dir():
        ap.error(f"--out {out} is a folder; give a file name")
    res = probe(Path(args.model), Path(args.data), n=args.n, sigmas=sigmas, seed=args.seed,
                batch_size=args.batch_size, device=args.device, bf16_aqn=args.bf16_aqn)
    res.update(benchmark="exploration_entropy_probe", model=str(args.model),
               command="python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
               date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
               versions=versions())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    for v, s in res["variants"].items():
        r = res["entropy_ratio_to_bf16"].get(v)
        extra = f", ratio {r['ratio']:.4f} [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}]" if r else ""
        print(f"[probe] {v}: entropy {s['entropy']:.4f} nats, KL {s['kl_from_bf16']:.2e}, top-1 agree "
              f"{s['top1_agree']:.4f}, ref NLL {s['ref_nll']:.4f}{extra}", flush=True)
    print(f"[probe] wrote {out} ({res['n_problems']} problems, {res['n_tokens']} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
