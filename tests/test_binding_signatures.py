"""The CUDA binding's op implementations take exactly the arguments of the schemas the Python side defines.

The ``qerl::*`` schemas are defined in Python (``verl_qerl/kernels/ops.py``) and cuda/qerl_torch.cpp registers C++
functions for them with ``m.impl("name", &function)``; torch infers the C++ function's schema and refuses a
mismatch only when the extension loads, which happens on the GPU machine alone (the CPU CI compiles the binding but
never loads it). A parameter added to a registered function (even one with a default value: defaults do not count)
left the whole extension unloadable once (NOTES, "Outcome of `lora-overlap`"). This test reads the C++ signatures and
compares them with the registered schemas, argument by argument, on any machine.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import verl_qerl.kernels  # noqa: F401 - defines the qerl::* schemas

BINDING = Path(__file__).resolve().parents[1] / "cuda" / "qerl_torch.cpp"

#: C++ parameter type -> the schema type torch infers for it
CPP_TO_SCHEMA = {
    "const at::Tensor&": "Tensor",
    "const c10::optional<at::Tensor>&": "Tensor?",
    "const std::optional<at::Tensor>&": "Tensor?",
    "int64_t": "int",
    "at::IntArrayRef": "int[]",
    "bool": "bool",
    "double": "float",
    "at::ScalarType": "ScalarType",
}


def registered_impls(text: str) -> dict[str, str]:
    """op name -> C++ function name, from ``m.impl("op", &function)`` lines."""
    return dict(re.findall(r'm\.impl\("(\w+)",\s*&(\w+)\)', text))


def cpp_params(text: str, function: str) -> list[str]:
    """The parameter types of ``function``'s definition (the one with a body) in ``text``."""
    m = re.search(rf"\n(?:at::Tensor|std::tuple<[^>]*>)\s+{function}\(([^)]*)\)\s*\{{", text)
    assert m, f"no definition of {function} in {BINDING.name}"
    params = [p.strip() for p in " ".join(m.group(1).split()).split(",") if p.strip()]
    types = []
    for p in params:
        p = p.split("=")[0].strip()  # a default value does not change the inferred schema
        ctype = p.rsplit(" ", 1)[0].strip()
        assert ctype in CPP_TO_SCHEMA, f"{function}: parameter '{p}' has a type this test does not map"
        types.append(CPP_TO_SCHEMA[ctype])
    return types


def schema_params(op: str) -> list[str]:
    schema = getattr(torch.ops.qerl, op).default._schema
    return [str(a.real_type).replace("List[int]", "int[]").replace("Optional[Tensor]", "Tensor?")
            for a in schema.arguments]


IMPLS = registered_impls(BINDING.read_text())


def test_the_binding_registers_the_gemm_ops() -> None:
    assert {"nvfp4_gemm", "nvfp4_gemm_lora", "nvfp4_lora_linear", "nvfp4_dequant"} <= set(IMPLS)


@pytest.mark.parametrize("op", sorted(IMPLS))
def test_registered_function_matches_the_schema(op: str) -> None:
    assert cpp_params(BINDING.read_text(), IMPLS[op]) == schema_params(op), (
        f"qerl::{op}: cuda/qerl_torch.cpp's {IMPLS[op]} does not take the schema's arguments (the extension would "
        "fail to load on the GPU machine)"
    )


def test_the_check_sees_an_added_parameter() -> None:
    """A parameter added to a registered function, with a default value, is a mismatch."""
    head = "int64_t mode_value, int64_t splits, bool pdl) {\n  const GemmMode mode = check_gemm_args("
    tail = 'x, qw, qs, gs, n, mode_value, splits, "qerl::nvfp4_gemm_lora")'
    text = BINDING.read_text()
    assert head + tail in text
    text = text.replace(head + tail, head.replace("bool pdl)", "bool pdl, bool extra = false)") + tail, 1)
    assert cpp_params(text, IMPLS["nvfp4_gemm_lora"]) != schema_params("nvfp4_gemm_lora")
