"""Make the embedded default: a tiny random-weight Qwen2 + tokenizer and generated GSM8K-format data.

usage: python examples/tiny/prepare.py WORKDIR   (writes WORKDIR/model, WORKDIR/data/{train,test}.parquet;
reuses them when present, so repeated runs start at once). Nothing is downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

from verl_qerl.testing.data import write_arith_parquet
from verl_qerl.testing.tiny import make_tiny_model


def main() -> int:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny")
    if not (work / "model" / "config.json").is_file():
        make_tiny_model(work / "model")
    if not (work / "data" / "train.parquet").is_file():
        write_arith_parquet(work / "data", n_train=64, n_val=8)
    print(f"[tiny] model {work / 'model'}, data {work / 'data'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
