"""Prepare GSM8K, MATH500 or BigMath for verl (parquet in verl's RL schema).

usage:
  python examples/data/prepare.py gsm8k   --out ~/data/gsm8k   [--source openai/gsm8k | ./gsm8k_jsonl_dir]
  python examples/data/prepare.py math500 --out ~/data/math500 [--source HuggingFaceH4/MATH-500 | ./test.jsonl]
  python examples/data/prepare.py bigmath --out ~/data/bigmath [--levels 4,5] [--source ... ] [--max-chars 1024]
Writes train.parquet (gsm8k, bigmath) and test.parquet (gsm8k, math500). --source accepts a hub name or
local files; nothing is downloaded when it is a local path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from verl_qerl import datasets as ds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["gsm8k", "math500", "bigmath"])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--source", help="hub dataset name or local file/folder (default: the public dataset)")
    ap.add_argument("--limit", type=int, help="keep at most this many rows per split")
    ap.add_argument("--levels", default="3,4,5", help="bigmath: difficulty levels 3,4,5 (7B/14B) or 4,5 (32B)")
    ap.add_argument("--max-chars", type=int, default=1024, help="bigmath: drop prompts longer than this")
    args = ap.parse_args(argv)
    out = Path(args.out)
    hub, config = ds.HUB_NAMES[args.kind]
    source = args.source or hub
    try:
        if args.kind == "gsm8k":
            for split in ("train", "test"):
                src = source
                if Path(source).is_dir():  # a local copy: one file per split, e.g. train.jsonl / test.jsonl
                    matches = sorted(Path(source).glob(f"{split}.*"))
                    if not matches:
                        raise ds.DatasetFormatError(f"{source}: no {split}.* file (expected train.* and test.*)")
                    src = str(matches[0])
                n = ds.write_parquet(ds.convert(ds.load_rows(src, split, config), "gsm8k", split, args.limit),
                                     out / f"{split}.parquet")
                print(f"[prepare] gsm8k {split}: {n} rows -> {out / f'{split}.parquet'}")
        elif args.kind == "math500":
            n = ds.write_parquet(ds.convert(ds.load_rows(source, "test", config), "math500", "test", args.limit),
                                 out / "test.parquet")
            print(f"[prepare] math500: {n} rows -> {out / 'test.parquet'}")
        else:
            if args.source is None:
                config = "level_4_5" if args.levels.replace(" ", "") == "4,5" else "level_3_4_5"
            rows = (r for r in ds.load_rows(source, "train", config) if len(str(r.get("prompt", ""))) <= args.max_chars)
            n = ds.write_parquet(ds.convert(rows, "bigmath", "train", args.limit), out / "train.parquet")
            print(f"[prepare] bigmath ({config}): {n} rows -> {out / 'train.parquet'}")
    except ds.DatasetFormatError as err:
        print(f"prepare: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
