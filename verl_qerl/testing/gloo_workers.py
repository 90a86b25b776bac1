"""Start and end the CPU (gloo) worker processes of the multi-process FSDP tests.

Why a module: the workers must end the same way in every test. gloo's worker threads can still hold
work objects whose tensors need the GIL while the interpreter is being torn down, which aborts the
process ("terminate called without an active exception", SIGABRT; pytorch/pytorch#179291) after it
has done and written everything. :func:`end_worker` waits for every rank, destroys the process group
and leaves with ``os._exit``, skipping that teardown; a worker that fails before it still exits non-zero.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["end_worker", "worker_failure"]


def end_worker() -> None:
    """Barrier, destroy the default process group, flush, ``os._exit(0)``: call after the results are written."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_failure(proc: subprocess.CompletedProcess, out_dir: Path) -> str:
    """What a failed worker run says: exit code, the result files written, stderr without the warning noise."""
    written = sorted(f.name for f in Path(out_dir).glob("rank*.json"))
    lines = [line for line in proc.stderr.splitlines()
             if "Warning" not in line and "requires_grad" not in line and "base_model." not in line]
    return f"exit {proc.returncode}, results written: {written}\n" + "\n".join(lines)[-4000:]
