"""The stream-K schedule's segment orders (cuda/streamk_schedule.cuh, ``CtaRange``) on the host: compiled with g++ from
the header's own text, every CTA range of many schedules walked in unit order and in K-aligned order (the wide
kernel's order at several token tiles). Each unit must be visited exactly once per order, every segment must be
non-empty, and in the aligned order a range that starts inside a tile and runs on must start at k = 0. The GPU tests
check the kernels' results; this checks the order over ~84,000 schedules no GPU test reaches."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEADER = REPO / "cuda" / "streamk_schedule.cuh"

PRELUDE = r"""
#include <algorithm>
#include <cstdio>
#include <vector>
#define __device__
#define __forceinline__ inline
using std::min;
struct { int x; } blockIdx;
"""

DRIVER = r"""
int main() {
  long checked = 0;
  for (int S = 1; S <= 40; ++S)
    for (int tiles = 1; tiles <= 30; ++tiles)
      for (int grid = 1; grid <= 70; ++grid) {
        const int units = tiles * S, per = (units + grid - 1) / grid, ctas = (units + per - 1) / per;
        for (int ka = 0; ka < 2; ++ka) {
          std::vector<int> seen(units, 0);
          for (int c = 0; c < ctas; ++c) {
            blockIdx.x = c;
            const CtaRange r(units, S, per);
            int n = 0;
            for (int u = r.first_unit(ka); u >= 0; u = r.next_unit(r.after(r.segment_at(u)), ka)) {
              const Segment s = r.segment_at(u);
              if (s.count() <= 0 || ++n > 1000) {
                printf("FAIL empty or endless S=%d tiles=%d grid=%d c=%d\n", S, tiles, grid, c);
                return 1;
              }
              if (ka && n == 1 && r.begin % S != 0 && (r.begin / S + 1) * S < r.end && s.kb != 0) {
                printf("FAIL not aligned S=%d tiles=%d grid=%d c=%d\n", S, tiles, grid, c); return 1;
              }
              for (int k = s.kb; k < s.ke; ++k) seen[s.tile * S + k]++;
            }
          }
          for (int u = 0; u < units; ++u)
            if (seen[u] != 1) {
              printf("FAIL unit %d seen %d times S=%d tiles=%d grid=%d order %d\n", u, seen[u], S, tiles, grid, ka);
              return 1;
            }
          ++checked;
        }
      }
  printf("ok %ld\n", checked);
  return 0;
}
"""


def _struct(text: str, name: str) -> str:
    start = text.index(f"struct {name} {{")
    end = text.index("\n};\n", start) + 4
    return text[start:end]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_both_segment_orders_visit_every_unit_once(tmp_path):
    text = HEADER.read_text()
    source = PRELUDE + _struct(text, "Segment") + _struct(text, "CtaRange") + DRIVER
    assert re.search(r"aligned_begin|first_unit", source)
    (tmp_path / "order.cpp").write_text(source)
    subprocess.run(["g++", "-std=c++17", "-O1", "-o", str(tmp_path / "order"), str(tmp_path / "order.cpp")],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([str(tmp_path / "order")], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"ok {40 * 30 * 70 * 2}", out.stdout
