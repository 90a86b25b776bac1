"""``qerl-quantize SRC DST``: a BF16 Hugging Face checkpoint folder -> an NVFP4 checkpoint."""

from __future__ import annotations

import argparse
import sys
import time

from tqdm import tqdm

from ..nvfp4.quantize import DEFAULT_SCALE_RULE, SCALE_RULES
from .stopping import Terminated, sigterm_raises, stopped_exit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="qerl-quantize",
        description="Quantize the Linear layers of a local BF16 Qwen2/Qwen2.5/Llama checkpoint to NVFP4 "
        "(compressed-tensors NVFP4A16 layout, loadable by vLLM and by verl-qerl). lm_head, the embeddings and "
        "the other non-Linear tensors are not quantized: they are written as stored, in the source's dtype "
        "(BF16 for a BF16 checkpoint; a float32 or float16 one keeps them so). Tokenizer and generation config "
        "are copied. SRC and DST may start with ~.",
    )
    parser.add_argument("src", help="source checkpoint folder (config.json + *.safetensors; BF16, float16 or "
                        "float32)")
    parser.add_argument("dst", help="destination folder (must not exist or be empty, unless --force)")
    parser.add_argument("--ignore", action="append", default=[], metavar="PATTERN",
                        help="keep matching modules unquantized: an exact module name, a dotted suffix "
                        "(e.g. 'down_proj') or 're:<regex>'; repeatable. lm_head is always kept.")
    parser.add_argument("--force", action="store_true", help="replace a non-empty DST once the new one is complete")
    parser.add_argument("--scale-rule", choices=SCALE_RULES, default=None,
                        help="how the global and block scales are rounded (recorded in config.json as "
                        "'qerl_scale_rule'). Default: the scale_rule a qerl_nvfp4 quantization_config in SRC's "
                        "config.json declares (what vLLM uses for SRC; a different --scale-rule is refused), else "
                        f"{DEFAULT_SCALE_RULE}. bf16: as llm-compressor's NVFP4A16 on a BF16 model, "
                        "bit-exact with llm-compressor 0.14.0.1 / compressed-tensors 0.19.0; fp32: scales in "
                        "float32, bit-exact with compressed-tensors' functions on the float32 weight (0.17.0), "
                        "this tool's output before the bf16 rule. Codes are round-to-nearest-even under both.")
    parser.add_argument("--device", default="cpu",
                        help="where the weights are quantized: cpu (default) or a GPU such as cuda / cuda:1 "
                        "(the same bytes; a 7B checkpoint in seconds instead of minutes). Files are written from "
                        "the CPU either way.")
    args = parser.parse_args(argv)

    from .. import checkpoint_conversion
    from ..nvfp4.checkpoint import PatternError, check_patterns

    def progress(iterable, total, desc):
        return tqdm(iterable, total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False)

    try:
        ignore = check_patterns(args.ignore, "--ignore")
    except PatternError as err:
        print(f"qerl-quantize: error: {err}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        with sigterm_raises():
            report = checkpoint_conversion.quantize_checkpoint(args.src, args.dst, ignore=ignore, force=args.force,
                                                               progress=progress, scale_rule=args.scale_rule,
                                                               device=args.device)
    except (FileExistsError, ValueError) as err:
        print(f"qerl-quantize: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. the disk filled up while writing: the temporary folder is already removed
        print(f"qerl-quantize: error: {err}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated) as err:
        return stopped_exit("qerl-quantize", err)
    dt = time.perf_counter() - t0
    ratio = report.bytes_out / max(report.bytes_in, 1)
    print(f"qerl-quantize: wrote {report.dst}: {len(report.quantized)} Linear layers in NVFP4, "
          f"{len(report.kept)} tensors kept; {report.bytes_in / 2**20:.1f} MiB -> {report.bytes_out / 2**20:.1f} MiB "
          f"({ratio:.2f}x) in {dt:.1f} s, scale rule {report.scale_rule}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
