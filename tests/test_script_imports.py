"""Every ``verl_qerl`` name that the scripts under benchmarks/ and examples/ import exists.

Those scripts run on the GPU machine or by hand, mostly with their imports inside functions, so a
module or name moved in the package would otherwise surface only there. Read as text (``ast``): a
module must be found by ``importlib`` and each imported name must be defined at its top level (a
function, class, assignment or import there) or be one of its submodules.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import verl_qerl

REPO = Path(__file__).resolve().parent.parent
PACKAGE = Path(verl_qerl.__file__).resolve().parent
SCRIPTS = sorted(p for folder in ("benchmarks", "examples") for p in (REPO / folder).rglob("*.py"))


def _package_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every absolute ``verl_qerl`` import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "verl_qerl":
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "verl_qerl"]
    return found


def _top_level_names(origin: Path) -> set[str]:
    """Names a module binds at its top level (also under a top-level ``if`` / ``try``)."""
    names: set[str] = set()
    for stmt in ast.parse(origin.read_text(), str(origin)).body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
            continue
        for node in ast.walk(stmt):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
    return names


def _is_submodule(module: str, name: str) -> bool:
    try:
        return importlib.util.find_spec(f"{module}.{name}") is not None
    except ModuleNotFoundError:  # ``module`` is not a package
        return False


def test_scripts_were_found():
    assert any(p.parent.name == "benchmarks" for p in SCRIPTS) and any("examples" in p.parts for p in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_package_names_imported_by_scripts_exist(script):
    missing = []
    for line, module, names in _package_imports(script):
        spec = importlib.util.find_spec(module)
        # an editable install's finder may still map a module this tree no longer has to another checkout
        if spec is None or spec.origin is None or not Path(spec.origin).is_relative_to(PACKAGE):
            missing.append(f"line {line}: module {module}")
            continue
        defined = _top_level_names(Path(spec.origin))
        for name in names:
            if name == "*" or name in defined or _is_submodule(module, name):
                continue
            if "__getattr__" in defined and hasattr(importlib.import_module(module), name):  # a lazy attribute
                continue
            missing.append(f"line {line}: {module}.{name}")
    assert not missing, f"{script.relative_to(REPO)} imports what the package does not have: {missing}"
