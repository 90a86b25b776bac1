"""Import a repository script (``benchmarks/*.py``, ``examples/**/*.py``) by path, for its tests.

Those scripts are run as files, not installed as packages; their tests still want to call their pure
functions. The script's own folder goes on ``sys.path`` first, so its sibling imports (e.g.
``from rollout import ...`` in ``benchmarks/grpo_step.py``) resolve the same way as when it runs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

#: The repository root (this file is verl_qerl/testing/scripts.py).
REPO = Path(__file__).resolve().parents[2]


def load_script(relpath: str | Path, name: str | None = None) -> ModuleType:
    """The module of ``REPO / relpath``, executed once per call under ``name`` (default: its stem)."""
    path = (REPO / relpath).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"script {relpath}: no such file under {REPO}")
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name or f"_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    # registered before it runs, as an import would: dataclasses (and pickling) look the module up by name
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
