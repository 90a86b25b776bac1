"""The GPU test modules are skipped in CI (no GPU), so a broken GPU test (a parametrize mark that lost its
function, a misspelled fixture) would surface only on the GPU machine, where a call is scarce. This checks on the
CPU that every test function of ``tests/*_gpu.py`` gets each argument from a parametrize mark or a fixture that
exists (pytest's built-ins, ``tests/conftest.py`` or the module itself)."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from types import ModuleType

import pytest

TESTS = Path(__file__).resolve().parent
BUILTIN_FIXTURES = {"request", "monkeypatch", "tmp_path", "tmp_path_factory", "capsys", "capfd", "caplog",
                    "recwarn", "pytestconfig", "tmpdir", "tmpdir_factory", "record_property", "cache"}


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_wellformed_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _is_fixture(obj: object) -> bool:
    # pytest >= 8.4 wraps fixtures in FixtureFunctionDefinition; older ones mark the function
    return type(obj).__name__ == "FixtureFunctionDefinition" or hasattr(obj, "_pytestfixturefunction")


def fixture_names(*modules: ModuleType) -> set[str]:
    out = set(BUILTIN_FIXTURES)
    for mod in modules:
        for attr, obj in vars(mod).items():
            if _is_fixture(obj):
                out.add(getattr(obj, "name", None) or attr)
    return out


def parametrized(fn: object, module: ModuleType) -> set[str]:
    marks = list(getattr(fn, "pytestmark", [])) + list(getattr(module, "pytestmark", []))
    names: set[str] = set()
    for mark in marks:
        if mark.name == "parametrize":
            arg = mark.args[0]
            names |= {a.strip() for a in (arg.split(",") if isinstance(arg, str) else arg)}
    return names


def unresolved(module: ModuleType, fixtures: set[str]) -> dict[str, set[str]]:
    """test name -> arguments that neither a parametrize mark nor a fixture provides."""
    bad = {}
    for name, fn in vars(module).items():
        if name.startswith("test_") and inspect.isfunction(fn):
            args = set(inspect.signature(fn).parameters)
            missing = args - parametrized(fn, module) - fixtures
            if missing:
                bad[name] = missing
    return bad


@pytest.mark.parametrize("path", sorted(TESTS.glob("test_*_gpu.py")), ids=lambda p: p.name)
def test_gpu_test_arguments_resolve(path: Path) -> None:
    conftest = _load(TESTS / "conftest.py")
    mod = _load(path)
    tests = [n for n in vars(mod) if n.startswith("test_")]
    assert tests, f"{path.name}: no tests found"
    assert unresolved(mod, fixture_names(conftest, mod)) == {}


def test_the_check_catches_a_lost_parametrize() -> None:
    mod = ModuleType("fake_gpu")

    @pytest.mark.parametrize("n", [1, 2])
    def helper(x: int) -> int:  # the decorators went onto a helper, as once happened here
        return x

    def test_shape(n: int, k: int, tmp_path: Path) -> None: ...

    mod.helper, mod.test_shape = helper, test_shape
    assert unresolved(mod, fixture_names()) == {"test_shape": {"n", "k"}}
