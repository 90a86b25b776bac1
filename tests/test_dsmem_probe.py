"""benchmarks/dsmem_probe.py / .cu on CPU: the probe builds for sm_90a (nvcc, no GPU), its output parses, and the
decision target refuses rates from wrong transfers. The probe itself runs on the GPU machine only."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from verl_qerl.testing.scripts import load_script


@pytest.fixture(scope="module")
def probe():
    return load_script("benchmarks/dsmem_probe.py", "dsmem_probe_test")


OUTPUT = """# device\tNVIDIA H200\tSMs\t132
mode\tcluster\tclusters\tctas\tshare_bytes\trounds\tus_per_round\tGBps_per_sm\tTBps_total\tbad
barrier_only\t3\t44\t132\t32768\t200\t0.800\t0.0\t0.000\t0
pull_ld_v4\t3\t44\t132\t32768\t200\t3.000\t21.8\t2.883\t0
push_st_async\t3\t44\t132\t32768\t200\t1.500\t43.7\t5.767\t0
push_bulk\t3\t44\t132\t32768\t200\t1.000\t65.5\t8.651\t0
"""


def test_output_parses_and_the_decision_uses_cluster_three(probe):
    device, rows = probe.parse_tsv(OUTPUT)
    assert device == "NVIDIA H200" and len(rows) == 4
    assert rows[1] == {"mode": "pull_ld_v4", "cluster": 3, "clusters": 44, "ctas": 132, "share_bytes": 32768,
                       "rounds": 200, "us_per_round": 3.0, "GBps_per_sm": 21.8, "TBps_total": 2.883, "bad": 0}
    (t,) = probe.decision_targets(rows)
    # net of the 0.8 us barrier: pull 2 x 32 KB in 2.2 us, bulk in 0.2 us
    assert t["measured"] == round(2.2 / 0.2, 3) and t["op"] == ">=" and t["target"] == 2.0


def test_a_wrong_transfer_is_no_rate(probe):
    _, rows = probe.parse_tsv(OUTPUT)
    for r in rows:
        if r["mode"] == "push_bulk":
            r["bad"] = 5  # the bulk copies moved wrong data: only st.async counts
    assert probe.decision_targets(rows)[0]["measured"] == round(2.2 / 0.7, 3)
    for r in rows:
        if r["mode"] == "pull_ld_v4":
            r["bad"] = 1
    assert probe.decision_targets(rows)[0]["measured"] is None


def test_without_the_barrier_row_no_net_rate_is_claimed(probe):
    _, rows = probe.parse_tsv(OUTPUT)
    (t,) = probe.decision_targets([r for r in rows if r["mode"] != "barrier_only"])
    assert t["measured"] is None and "barrier_only" in t["note"]


def test_malformed_output_is_named(probe):
    with pytest.raises(ValueError, match="no header"):
        probe.parse_tsv("# device\tX\n")
    with pytest.raises(ValueError, match="fields"):
        probe.parse_tsv(OUTPUT + "push_bulk\t3\n")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_probe_builds_for_sm90a(probe, tmp_path):
    out = subprocess.run(["nvcc", "-c", "-Werror", "all-warnings", *probe.NVCC_FLAGS, str(probe.SOURCE),
                          "-o", str(tmp_path / "p.o")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
