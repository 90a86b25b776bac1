"""The GEMM mode table (cuda/gemm_modes.h) is one definition: the C++ compiler and Python's parser read the same
entries, the binding routes by enumerator names, and ``$QERL_GEMM_KERNEL`` maps onto those modes. CPU-only."""

from __future__ import annotations

import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

from verl_qerl import kernels
from verl_qerl.kernels import modes

ROOT = Path(__file__).resolve().parent.parent
#: the torch binding's sources: the ops (qerl_torch.cpp) and the dispatch they run (gemm_route.h / .cpp)
BINDING = tuple(ROOT / "cuda" / f for f in ("qerl_torch.cpp", "gemm_route.h", "gemm_route.cpp"))

# Prints every entry the way the C++ side sees it after the preprocessor (the X-macro expansions of the binding).
PRINTER = r"""
#include <cstdio>
int main() {
#define QERL_GEMM_MODE(id, value, name, doc) std::printf("mode|%s|%d|%s|%s\n", #id, value, name, doc);
#include "gemm_modes.h"
#define QERL_GEMM_KERNEL_DEF(id, value, name, doc) std::printf("kernel|%s|%d|%s|%s\n", #id, value, name, doc);
#include "gemm_modes.h"
  return 0;
}
"""


def compiled_table(tmp_path: Path) -> list[tuple[str, str, int, str, str]]:
    """The header's entries as a C++ program compiled with it prints them (the oracle for Python's parse)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler (g++) is needed to check cuda/gemm_modes.h; CI has one (.ci/compile_cuda.sh)"
    src, exe = tmp_path / "print_modes.cpp", tmp_path / "print_modes"
    src.write_text(PRINTER)
    subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", f"-I{ROOT / 'cuda'}", str(src), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        kind, enumerator, value, name, doc = line.split("|")
        rows.append((kind, enumerator, int(value), name, doc))
    return rows


def test_python_parse_matches_the_compiled_header(tmp_path: Path) -> None:
    want = compiled_table(tmp_path)
    got = [("mode", e.enumerator, e.value, e.name, e.doc) for e in modes.MODE_ENTRIES]
    got += [("kernel", e.enumerator, e.value, e.name, e.doc) for e in modes.KERNEL_ENTRIES]
    assert got == want


def test_mode_names_by_role() -> None:
    assert modes.GEMM_MODES == {"auto": 0, "splitk": 1, "dequant_cublas": 2, "auto_streamk": 4, "streamk": 5,
                                "auto_splitk": 6, "wgmma_rs": 7, "wgmma_ss": 8, "decode_tma": 9, "wgmma_wide": 10}
    assert modes.GEMM_KERNEL_NAMES == ("splitk", "streamk", "wgmma_rs", "dequant_cublas", "wgmma_ss", "decode_tma",
                                       "wgmma_wide")
    assert kernels.GemmMode.SPLITK == 1 and kernels.GemmMode["WGMMA_SS"] == 8
    # every kernel a variant forces is one of the kernels the extension names
    assert set(kernels.GEMM_KERNEL_FORCED_MODES) <= set(modes.GEMM_KERNEL_NAMES)


def test_binding_routes_by_name_not_number() -> None:
    """route() and the checks name modes through the enum: no integer mode literals left in the binding."""
    text = "\n".join(p.read_text() for p in BINDING)
    assert '#include "gemm_modes.h"' in text
    assert not re.findall(r"mode\s*(==|!=|>=|<=|>|<)\s*\d", text)
    assert not re.findall(r"mode\s*-\s*16|mode_value\s*-\s*\d", text)
    for e in modes.MODE_ENTRIES:  # every mode is routed by its enumerator
        assert f"case GemmMode::{e.enumerator}:" in text, e.enumerator


@pytest.mark.parametrize(("line", "problem"), [
    ('QERL_GEMM_MODE(Auto, 0, auto, "doc")', "not an entry"),
    ('QERL_GEMM_MODE(Auto, 0, "Auto", "doc")', "not an entry"),
    ('QERL_GEMM_MODE(Auto, -1, "auto", "doc")', "not an entry"),
    ('QERL_GEMM_MODE(Auto, 0, "auto", "doc") \\', "not an entry"),
])
def test_malformed_entry_is_refused_with_its_line(line: str, problem: str) -> None:
    text = 'QERL_GEMM_KERNEL_DEF(A, 0, "a", "d")\n// comment\n' + line + "\n"
    with pytest.raises(modes.GemmModesError, match=rf"h:3: {problem}"):
        modes.parse(text, "x.h")


@pytest.mark.parametrize(("text", "problem"), [
    ('QERL_GEMM_MODE(A, 0, "a", "d")\nQERL_GEMM_MODE(B, 0, "b", "d")\nQERL_GEMM_KERNEL_DEF(K, 0, "k", "d")',
     "mode values repeated: 0"),
    ('QERL_GEMM_MODE(A, 0, "a", "d")\nQERL_GEMM_MODE(B, 1, "a", "d")\nQERL_GEMM_KERNEL_DEF(K, 0, "k", "d")',
     "mode names repeated: a"),
    ('QERL_GEMM_MODE(A, 0, "a", "d")\nQERL_GEMM_KERNEL_DEF(K, 1, "k", "d")', "kernel ids must be 0, 1, 2"),
    ('QERL_GEMM_KERNEL_DEF(K, 0, "k", "d")', "no mode entries"),
])
def test_inconsistent_table_is_refused(text: str, problem: str) -> None:
    with pytest.raises(modes.GemmModesError, match=problem):
        modes.parse(text, "x.h")


def test_unreadable_header_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(modes.GemmModesError, match="missing.h: cannot read"):
        modes.load(tmp_path / "missing.h")


def test_env_variant_names_and_former_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_warned_aliases", set())
    for raw, want in (("", "auto"), ("splitk", "splitk"), (" StreamK ", "streamk"), ("wgmma_rs", "wgmma_rs"),
                      ("wgmma_ss", "wgmma_ss")):
        monkeypatch.setenv(kernels.GEMM_KERNEL_ENV, raw)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # current names never warn
            assert kernels.gemm_kernel_variant() == want
    for old, new in (("v5", "splitk"), ("WGMMA", "wgmma_rs")):
        monkeypatch.setenv(kernels.GEMM_KERNEL_ENV, old)
        with pytest.warns(FutureWarning, match=rf"QERL_GEMM_KERNEL: '{old.lower()}' is a deprecated name; use '{new}'"):
            assert kernels.gemm_kernel_variant() == new
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process, not at every dispatch
            assert kernels.gemm_kernel_variant() == new
    monkeypatch.setenv(kernels.GEMM_KERNEL_ENV, "dqmm")
    with pytest.raises(ValueError, match=r"QERL_GEMM_KERNEL='dqmm' is not a GEMM kernel variant"):
        kernels.gemm_kernel_variant()


def test_extension_from_another_mode_table_is_refused() -> None:
    """A stale build (its modes or kernel names differ from the header Python parsed) is not used."""

    class Built:
        def __init__(self, modes: dict, names: tuple) -> None:
            self.modes, self.names = modes, names

        def gemm_modes(self) -> list:
            return list(self.modes.items())

        def gemm_kernel_names(self) -> list:
            return list(self.names)

    kernels._check_mode_table(Built(dict(kernels.GEMM_MODES), kernels.GEMM_KERNEL_NAMES))
    stale_modes = {**kernels.GEMM_MODES, "sliced": 3}
    with pytest.raises(RuntimeError, match="rebuild the extension"):
        kernels._check_mode_table(Built(stale_modes, kernels.GEMM_KERNEL_NAMES))
    with pytest.raises(RuntimeError, match="rebuild the extension"):
        kernels._check_mode_table(Built(dict(kernels.GEMM_MODES), ("v5", "streamk", "wgmma", "dqmm", "wgmma_ss")))
