"""How the command-line tools stop on SIGINT / SIGTERM: like an exception, so their temporary output is removed.

Python turns SIGINT into KeyboardInterrupt but lets SIGTERM (what ``kill``, a job scheduler or a container stop
sends) end the process at once, skipping every ``except`` / ``finally`` that removes a half-written folder.
:func:`sigterm_raises` makes SIGTERM raise :class:`Terminated` for the duration of the work, and
:func:`stopped_exit` turns either into the tool's one-line message and the shell's 128 + signal exit status.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator

__all__ = ["Terminated", "sigterm_raises", "stopped_exit"]


class Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that the temporary output folder is removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` inside the block (the previous handler is restored after)."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stopped_exit(tool: str, err: BaseException) -> int:
    """Print ``<tool>: stopped by SIGINT/SIGTERM; no partial output left behind`` and return 128 + the signal.

    A signal that arrived while the finished output was being swapped into place is delivered once the swap is
    done; its exception then carries the written folder as ``output_written``
    (:data:`verl_qerl.checkpoint_conversion.OUTPUT_WRITTEN_ATTR`), and the message says
    ``<tool>: DST written, then stopped by SIGTERM`` instead: DST holds the complete new output."""
    signum = err.signum if isinstance(err, Terminated) else signal.SIGINT
    name = signal.Signals(signum).name
    written = getattr(err, "output_written", None)
    if written is not None:
        print(f"{tool}: {written} written, then stopped by {name} (the new output there is complete)",
              file=sys.stderr)
    else:
        print(f"{tool}: stopped by {name}; no partial output left behind", file=sys.stderr)
    return 128 + signum
