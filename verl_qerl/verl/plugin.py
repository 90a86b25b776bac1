"""verl plugin entry point (``verl.plugins`` group): imported on every ``import verl``.

Keeps the import cheap: it only installs post-import hooks, so the QeRL trainer mode is registered in
the processes that import verl's trainer, the FSDP engine hook only where the engine is imported, and
the CPU platform only when ``VERL_PLATFORM=cpu``. verl swallows plugin import errors at DEBUG level,
so this module logs one line of its own in each process that loads it.
"""

from __future__ import annotations

import logging
import os

from .. import __version__
from . import cpu_platform

logger = logging.getLogger("verl_qerl")

_loaded = False


def activate() -> None:
    """Install the hooks (idempotent)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    parts = []
    if cpu_platform.cpu_requested():
        cpu_platform.activate()
        parts.append("CPU platform")
    from . import integration

    parts += integration.install_hooks()
    if os.environ.get("VERL_QERL_QUIET", "0") != "1":
        logging.getLogger("verl_qerl").warning(
            "[verl-qerl %s] plugin active in pid %d: %s", __version__, os.getpid(), ", ".join(parts)
        )


activate()
