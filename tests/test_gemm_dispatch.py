"""Auto mode's calibration table (verl_qerl/kernels/dispatch.py): built from benchmark rows, validated, installed
only for the capability it was measured on. CPU-only: the extension is replaced by a recorder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_qerl.kernels import dispatch, modes

NAMES = list(modes.GEMM_KERNEL_NAMES)


class FakeExt:
    def __init__(self) -> None:
        self.table: list | None = None

    def gemm_kernel_names(self) -> list[str]:
        return NAMES

    def set_dispatch_table(self, points: list) -> None:
        self.table = points


def test_table_from_rows_picks_fastest_graph_time() -> None:
    rows = [
        {"model": "m", "layer": "qkv", "N": 4608, "K": 3584, "M": 64, "kernel_splitk_graph_ms": 0.03,
         "kernel_streamk_graph_ms": 0.02, "kernel_wgmma_rs_graph_ms": 0.01, "dequant_cublas_graph_ms": 0.05},
        {"model": "m", "layer": "o", "N": 3584, "K": 3584, "M": 64, "kernel_wgmma_rs_graph_ms": 0.02,
         "kernel_wgmma_ss_graph_ms": 0.015},
        {"model": "m", "layer": "qkv", "N": 4608, "K": 3584, "M": 1024, "dequant_cublas_graph_ms": 0.1,
         "kernel_wgmma_rs_graph_ms": 0.2},  # the fused kernels are not timed at every M
        {"model": "m", "layer": "sum", "M": 64, "kernel_splitk_graph_ms": 1.0},
    ]
    t = dispatch.table_from_rows(rows, "GPU", (9, 0), "cmd")
    assert t["points"] == [[4608, 3584, 64, "wgmma_rs"], [3584, 3584, 64, "wgmma_ss"],
                           [4608, 3584, 1024, "dequant_cublas"]]
    assert t["capability"] == [9, 0]


def test_table_from_rows_keeps_the_ops_kernel_where_variants_were_not_timed() -> None:
    """Before: a prefill-size row (kernel.py times no forced kernel variant above 1,024 tokens there) gave the only
    timed column, dequantize + cuBLAS, although the op's own column ran wgmma_rs faster (7B at M = 2,048: 1.43 vs
    1.60 ms per layer on an H200): the table would have moved prefill onto the slower kernel."""
    rows = [
        {"layer": "qkv", "N": 4608, "K": 3584, "M": 2048, "ours_runs": "wgmma_rs", "ours_graph_ms": 0.0948,
         "dequant_cublas_graph_ms": 0.1021},
        {"layer": "qkv", "N": 7168, "K": 5120, "M": 2048, "ours_runs": "wgmma_rs", "ours_graph_ms": 0.21,
         "dequant_cublas_graph_ms": 0.20},  # measured slower there: the table takes dequantize + cuBLAS
        {"layer": "o", "N": 3584, "K": 3584, "M": 64, "ours_runs": "wgmma_rs", "ours_graph_ms": 0.001,
         "kernel_wgmma_rs_graph_ms": 0.02, "kernel_splitk_graph_ms": 0.015},  # a forced column wins over `ours`
        {"layer": "o", "N": 3584, "K": 3584, "M": 32, "ours_runs": "not_a_kernel", "ours_graph_ms": 0.001,
         "kernel_splitk_graph_ms": 0.015},
    ]
    assert [p[3] for p in dispatch.table_from_rows(rows, "GPU", (9, 0), "cmd")["points"]] == [
        "wgmma_rs", "dequant_cublas", "splitk", "splitk"]
    assert dispatch.row_times(rows[0]) == {"dequant_cublas": 0.1021, "wgmma_rs": 0.0948}
    # a former kernel name in ours_runs (rows written before the names by role) counts as the current one
    assert dispatch.row_times({"ours_runs": "wgmma", "ours_graph_ms": 0.2}) == {"wgmma_rs": 0.2}
    # under kernel.py --pdl the forced columns ran without PDL: the op's column without it is the comparable one
    assert dispatch.row_times({"ours_runs": "splitk", "ours_graph_ms": 0.009, "ours_nopdl_graph_ms": 0.010}) == {
        "splitk": 0.010}


def test_table_from_rows_reads_former_row_keys() -> None:
    """Result files written before the names by role (kernel = v5, kernel_wgmma, dqmm) give current names."""
    rows = [{"layer": "qkv", "N": 1, "K": 128, "M": 1, "kernel_graph_ms": 0.01, "dqmm_graph_ms": 0.02},
            {"layer": "qkv", "N": 1, "K": 128, "M": 64, "kernel_graph_ms": 0.03, "kernel_wgmma_graph_ms": 0.02},
            {"layer": "qkv", "N": 1, "K": 128, "M": 999, "kernel_graph_ms": 0.03, "dqmm_graph_ms": 0.02}]
    assert [p[3] for p in dispatch.table_from_rows(rows, "GPU", (9, 0), "cmd")["points"]] == [
        "splitk", "wgmma_rs", "dequant_cublas"]


def test_former_kernel_names_in_a_table_load_as_current(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "old.json"
    f.write_text(json.dumps({"capability": [9, 0], "points": [[8, 128, 1, "v5"], [8, 128, 64, "wgmma"],
                                                              [8, 128, 999, "dqmm"], [8, 128, 32, "streamk"]]}))
    monkeypatch.setenv(dispatch.TABLE_ENV, str(f))
    ext = FakeExt()
    dispatch.install(ext, (9, 0))
    assert [NAMES[p[3]] for p in ext.table] == ["splitk", "wgmma_rs", "dequant_cublas", "streamk"]


def test_install_only_for_the_measured_capability(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"device": "H200", "capability": [9, 0], "points": [[4608, 3584, 64, "wgmma_rs"]]}))
    monkeypatch.setenv(dispatch.TABLE_ENV, str(f))
    ext = FakeExt()
    dispatch.install(ext, (9, 0))
    assert ext.table == [[4608, 3584, 64, NAMES.index("wgmma_rs")]]
    dispatch.install(ext, (8, 9))  # another GPU: the rules, not another GPU's measurements
    assert ext.table == []
    monkeypatch.setenv(dispatch.TABLE_ENV, "off")
    ext.table = None
    dispatch.install(ext, (9, 0))
    assert ext.table == []


@pytest.mark.parametrize("content", ['{"capability": [9, 0], "points": []}', "not json",
                                     '{"capability": [9, 0], "points": [[1, 2, 3, "marlin"]]}',
                                     '{"capability": [9, 0], "points": [[0, 2, 3, "splitk"]]}',
                                     # a capability of strings never matched a device: the table was silently unused
                                     '{"capability": ["9", "0"], "points": [[1, 2, 3, "splitk"]]}',
                                     '{"capability": [9, 0], "points": [[true, 2, 3, "splitk"]]}'])
def test_bad_table_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str) -> None:
    f = tmp_path / "bad.json"
    f.write_text(content)
    monkeypatch.setenv(dispatch.TABLE_ENV, str(f))
    with pytest.raises(dispatch.DispatchTableError, match="bad.json"):
        dispatch.install(FakeExt(), (9, 0))


def test_shipped_table_is_valid() -> None:
    if not dispatch.DEFAULT_TABLE.is_file():
        pytest.skip("no shipped table yet")
    raw = json.loads(dispatch.DEFAULT_TABLE.read_text())
    assert {p[3] for p in raw["points"]} <= set(NAMES)  # written with the current names, not the former ones
    t = dispatch.load_table(dispatch.DEFAULT_TABLE, NAMES)
    # a full grid: every GEMM shape of the two benchmark models (8) at every measured M (1, 8, 16, 64, 96 .. 1024, the
    # wide kernel's fitted tiles 129, 160, 192, 320, 384, the band after the 256 multiple 257, 288, prefill 2048, 4096:
    # 18)
    shapes = {(p[0], p[1]) for p in t["points"]}
    ms = {p[2] for p in t["points"]}
    assert tuple(t["capability"]) == (9, 0) and len(t["points"]) == len(shapes) * len(ms) == 8 * 18
    assert ms == {1, 8, 16, 64, 96, 128, 129, 160, 192, 256, 257, 288, 320, 384, 512, 1024, 2048, 4096}
    # the wide kernel's 128-token tiles were measured fastest somewhere at 65-128 tokens, and only there
    assert any(p[3] == "wgmma_wide" for p in t["points"])
    assert all(65 <= p[2] <= 128 for p in t["points"] if p[3] == "wgmma_wide")
    # the decode kernel is measured only where it runs (M <= 16)
    assert all(p[2] <= 16 for p in t["points"] if p[3] == "decode_tma")


def test_a_table_with_two_kernels_for_one_point_is_refused(tmp_path) -> None:
    """Before: accepted, and the C++ side silently took the first of the two."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"capability": [9, 0], "points": [[256, 512, 64, "splitk"], [256, 512, 64, "streamk"]]}))
    with pytest.raises(dispatch.DispatchTableError, match=r"\(256, 512, 64\) has two kernels, splitk and streamk"):
        dispatch.load_table(path, NAMES)
    path.write_text(json.dumps({"capability": [9, 0], "points": [[256, 512, 64, "splitk"], [256, 512, 64, "v5"]]}))
    assert len(dispatch.load_table(path, NAMES)["points"]) == 2  # the same kernel twice (a former name) is one answer
