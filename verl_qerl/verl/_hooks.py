"""Run a callback right after a module is first imported (a post-import hook).

verl loads ``verl.plugins`` entry points on every ``import verl``: in the driver, the TaskRunner, each
training worker, the vLLM server actors and vLLM's own subprocesses. Importing verl's trainer or
engine modules there just to patch or register something would be slow and, in vLLM's subprocesses,
pointless. Instead the plugin registers hooks that fire only in the processes that import those modules.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType

_callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}
_lock = threading.Lock()
_finder_installed = False


class _LoaderWrapper(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec):  # noqa: D401 - delegate
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        with _lock:
            callbacks = _callbacks.pop(self._name, [])
        for cb in callbacks:
            cb(module)

    def __getattr__(self, item):  # is_package, get_source, ... for tools that ask
        return getattr(self._loader, item)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None and spec.loader is not None:
                spec.loader = _LoaderWrapper(spec.loader, fullname)
                return spec
        return None


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``module_name`` has executed; at once if it already has."""
    global _finder_installed
    module = sys.modules.get(module_name)
    if module is not None and getattr(module, "__spec__", None) is not None and not _initializing(module):
        callback(module)
        return
    with _lock:
        _callbacks.setdefault(module_name, []).append(callback)
        if not _finder_installed:
            sys.meta_path.insert(0, _PostImportFinder())
            _finder_installed = True


def _initializing(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))
