"""Prepare GSM8K, MATH500 or BigMath for verl (parquet in verl's RL schema).

usage:
  python examples/data/prepare.py gsm8k   --out ~/data/gsm8k   [--source openai/gsm8k | ./gsm8k_jsonl_dir]
  python examples/data/prepare.py gsm8k   --out ~/data/gsm8k   --train-source ./train.jsonl --test-source ./test.jsonl
  python examples/data/prepare.py math500 --out ~/data/math500 [--source HuggingFaceH4/MATH-500 | ./test.jsonl]
  python examples/data/prepare.py bigmath --out ~/data/bigmath [--levels 4,5] [--source ... ] [--max-chars 1024]
Writes train.parquet (gsm8k, bigmath) and test.parquet (gsm8k, math500). --source accepts a hub name or
local files; nothing is downloaded when it is a local path (a path-like source that does not exist is an error,
never a hub lookup). A local --source is:
  * a folder of data files: each split reads the files whose names start with the split name (train.jsonl,
    train-00000-of-00001.parquet, test.csv ...);
  * a folder saved with datasets' save_to_disk: a DatasetDict gives each split by name;
  * a single file (.parquet/.json/.jsonl/.csv): taken whole as the one split math500 (test) or bigmath (train)
    needs; for gsm8k, which needs train and test, say which split each file is with --train-source / --test-source.
--train-source / --test-source set one split's source (a file is taken whole as that split); a split without one
uses --source (default: the public dataset). Rows with an empty question or answer are errors naming the file,
row and field; exact duplicate prompts within a split are dropped (the count is printed). All splits are written
to a temporary folder next to --out and moved into place only when every split succeeded.
--levels (bigmath): 3,4,5 (7B/14B) or 4,5 (32B); with the hub dataset it picks the subset, with --source it keeps
the rows whose 'level' column is in it (a source without that column is an error).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from verl_qerl import datasets as ds

SPLITS = {"gsm8k": ("train", "test"), "math500": ("test",), "bigmath": ("train",)}
#: --levels values (sorted) and the BigMath hub subset each one names.
LEVEL_CONFIGS = {(3, 4, 5): "level_3_4_5", (4, 5): "level_4_5"}


def parse_levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(sorted({int(x) for x in text.replace(" ", "").split(",") if x}))
    except ValueError:
        levels = ()
    if levels not in LEVEL_CONFIGS:
        raise ds.DatasetFormatError(f"--levels {text!r}: choose one of "
                                    f"{[','.join(map(str, k)) for k in LEVEL_CONFIGS]}")
    return levels


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p ``folder``; the folders it created, deepest first (to remove them again on failure)."""
    missing = []
    p = folder
    while not p.exists():
        missing.append(p)
        p = p.parent
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=list(SPLITS))
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--source", help="hub dataset name or local file/folder (default: the public dataset)")
    ap.add_argument("--train-source", help="the train split's source (a local file is taken whole as train)")
    ap.add_argument("--test-source", help="the test split's source (a local file is taken whole as test)")
    ap.add_argument("--limit", type=int, help="keep at most this many rows per split")
    ap.add_argument("--levels", help="bigmath: difficulty levels 3,4,5 (7B/14B, the default) or 4,5 (32B)")
    ap.add_argument("--max-chars", type=int, default=1024, help="bigmath: drop prompts longer than this")
    args = ap.parse_args(argv)
    out = Path(args.out).expanduser()
    splits = SPLITS[args.kind]
    hub, config = ds.HUB_NAMES[args.kind]
    tmp: Path | None = None
    created: list[Path] = []
    try:
        per_split = {"train": args.train_source, "test": args.test_source}
        for split, src in per_split.items():
            if src is not None and split not in splits:
                raise ds.DatasetFormatError(f"--{split}-source: {args.kind} has only the {'/'.join(splits)} split")
        levels = None
        if args.levels is not None:
            if args.kind != "bigmath":
                raise ds.DatasetFormatError(f"--levels is for bigmath, not {args.kind}")
            levels = parse_levels(args.levels)
            if args.source is None and args.train_source is None:
                config = LEVEL_CONFIGS[levels]
        if out.exists() and not out.is_dir():
            raise ds.DatasetFormatError(f"--out {out}: exists and is not a folder")
        created = _make_parents(out.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        done = []
        for split in splits:
            src = per_split[split] or args.source or hub
            stats: dict[str, int] = {}
            single = per_split[split] is not None or len(splits) == 1
            try:
                rows = ds.load_rows(src, split, config, single_file=single)
            except ds.DatasetFormatError as err:
                if single or "several splits" not in str(err):
                    raise
                raise ds.DatasetFormatError(f"{err}: {args.kind} needs {' and '.join(splits)}; name each split's "
                                            f"file with --train-source / --test-source, or give a folder with "
                                            f"{'.* and '.join(splits)}.* files") from None
            kw = {"max_chars": args.max_chars} if args.kind == "bigmath" else {}
            if args.kind == "bigmath" and levels is not None and (args.source or args.train_source):
                kw["levels"] = levels
            converted = ds.convert(rows, args.kind, split, args.limit, source=ds.describe_source(src, split),
                                   stats=stats, **kw)
            n = ds.write_parquet(converted, tmp / f"{split}.parquet")
            done.append((split, n, stats))
        if out.is_dir():
            for f in sorted(tmp.iterdir()):
                os.replace(f, out / f.name)
            tmp.rmdir()
        else:
            os.replace(tmp, out)
        tmp = None
    except (ds.DatasetFormatError, OSError) as err:
        print(f"prepare: error: {err}", file=sys.stderr)
        return 2
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            for folder in created:  # deepest first; only the empty folders this run made
                try:
                    folder.rmdir()
                except OSError:
                    break
    label = args.kind
    if args.kind == "bigmath":
        label += f" ({config})" if not (args.source or args.train_source) else (
            f" (levels {','.join(map(str, levels))})" if levels else "")
    for split, n, stats in done:
        dropped = ", ".join(f"{stats[k]} {what}" for k, what in (
            ("duplicates", "duplicate prompts dropped"), ("too_long", f"prompts over {args.max_chars} characters "
                                                                       "dropped"),
            ("other_level", "rows of other levels dropped")) if stats.get(k))
        print(f"[prepare] {label} {split}: {n} rows -> {out / f'{split}.parquet'}" + (f" ({dropped})" if dropped
                                                                                      else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
