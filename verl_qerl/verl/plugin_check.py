"""Refuse a ``+qerl=...`` command line whose process did not load the verl plugin.

Why: the ``qerl`` config group is found by hydra (``hydra_plugins/verl_qerl``) whether or not verl loaded our
``verl.plugins`` entry point; without the plugin nothing reads ``qerl.*``, so the run would be plain verl (no NVFP4, no
AQN) with no error. verl skips the plugin when ``VERL_USE_EXTERNAL_PLUGINS`` is ``none`` or a list without ``qerl``,
and logs a failed plugin import at DEBUG only. The hydra search-path plugin calls :func:`check_command_line` while the
driver composes its config (after ``import verl`` has loaded or skipped the plugins), so the user sees why at once.

Kept free of torch / verl imports: hydra imports this in every hydra app.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Sequence

#: The entry point's name in the ``verl.plugins`` group (setup.py).
ENTRY_POINT = "qerl"
#: The module that entry point loads.
PLUGIN_MODULE = "verl_qerl.verl.plugin"
_GROUP_OVERRIDE = re.compile(r"^\+{0,2}qerl=")


class QeRLPluginNotLoaded(RuntimeError):
    """``+qerl=...`` was given to a verl process that did not load the verl-qerl plugin."""


def qerl_group_override(argv: Sequence[str]) -> str | None:
    """The command line's selection of the ``qerl`` config group (``+qerl=nvfp4``), or None."""
    for arg in argv:
        if _GROUP_OVERRIDE.match(arg):
            return arg
    return None


def plugin_loaded() -> bool:
    """Whether this process imported and activated the verl plugin."""
    module = sys.modules.get(PLUGIN_MODULE)
    return module is not None and bool(getattr(module, "_loaded", False))


def _policy_allows_plugin(policy: str) -> bool:
    """verl's rule (verl/__init__.py): "auto" loads every plugin, "none" none, else the named ones."""
    if policy == "auto":
        return True
    if policy == "none":
        return False
    return ENTRY_POINT in {name.strip() for name in policy.split(",")}


def check_command_line(argv: Sequence[str] | None = None) -> None:
    """Raise :class:`QeRLPluginNotLoaded` where ``argv`` selects the ``qerl`` group in a verl process without the
    plugin; a no-op in hydra apps that are not verl's and on command lines without the group."""
    override = qerl_group_override(sys.argv[1:] if argv is None else argv)
    if override is None or "verl" not in sys.modules or plugin_loaded():
        return
    policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    if not _policy_allows_plugin(policy):
        why = (f"VERL_USE_EXTERNAL_PLUGINS={policy!r} excludes it: unset it, or add {ENTRY_POINT!r} to the list "
               f"(e.g. VERL_USE_EXTERNAL_PLUGINS={ENTRY_POINT})")
    else:
        try:  # verl swallowed the import error (DEBUG log): show it
            importlib.import_module(PLUGIN_MODULE)
            why = (f"verl did not load the entry point {ENTRY_POINT!r} of group 'verl.plugins' (is verl-qerl "
                   "installed in this environment? `pip show verl-qerl`)")
        except Exception as ex:  # noqa: BLE001 - any import failure is the answer
            why = f"importing {PLUGIN_MODULE} fails: {type(ex).__name__}: {ex}"
    raise QeRLPluginNotLoaded(
        f"{override} is set, but verl did not load the verl-qerl plugin in this process, so the run would be plain "
        f"verl (no NVFP4, no AQN) without an error: {why}")
