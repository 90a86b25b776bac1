"""The fused-kernel variants ``benchmarks/kernel.py --variants`` times side by side: their names, where each one
measures anything, the tile-width variant's knob, and their ratios to split-K in rows and printed lines.

Kept apart from the timing loop so the variant rules (which kernel a forced mode runs at which shape, which names
are timing-only) are read and tested in one place; ``kernel_diagnostics.py``'s ``--profile`` uses the same names.
"""

from __future__ import annotations

from verl_qerl import kernels

#: fused-kernel variant -> the ``qerl::nvfp4_gemm`` mode that forces it (cuda/gemm_modes.h)
VARIANT_KERNEL_MODES = kernels.GEMM_KERNEL_FORCED_MODES
#: the variant every other one is compared with (always timed, first)
BASELINE = "splitk"
#: benchmark-only variants: a kernel the op also runs, with its tile choice moved (variant -> the kernel it times).
#: ``wgmma_rs_t128``: the register-A wgmma kernel held at 128-token tiles where the op runs its wide ones (M >= 129);
#: ``wgmma_rs_t256``: the wide kernel held at 256-token tiles where the op fits a narrower one to M (wide_tile): so
#: the tile widths are timed side by side in one run.
TILE_VARIANTS = {"wgmma_rs_t128": "wgmma_rs", "wgmma_rs_t256": "wgmma_rs"}
#: the M from which ``wgmma_rs_t128`` keeps the 128-token tiles (far above any benchmarked M)
NARROW_WIDE_MIN_M = 1 << 40
#: the M from which the op runs the wide kernel (cuda/gemm_route.cpp, g_wgmma_wide_min_m)
WIDE_MIN_M = 129


def wide_tile(m: int) -> int:
    """The wide kernel's token tile at M >= :data:`WIDE_MIN_M` as the op fits it (cuda/gemm_route.cpp's
    wide_block_t): of 160, 192, 224 and 256 the one whose ceil(M / T) tiles hold the fewest rows, the widest of
    equals."""
    best = 256
    for t in (224, 192, 160):
        if -(-m // t) * t < -(-m // best) * best:
            best = t
    return best


def parse_variants(text: str | None) -> list[str]:
    """``--variants`` ("splitk,streamk") -> ordered, de-duplicated variant names; split-K always first (the
    baseline the ratios divide by). Former names (v5, wgmma) are accepted with a warning; unknown names raise
    ValueError naming them and the known ones."""
    names = [kernels.canonical_kernel_name(v, "--variants") for v in (text or BASELINE).split(",") if v.strip()]
    known = set(VARIANT_KERNEL_MODES) | set(TILE_VARIANTS)
    bad = [v for v in names if v not in known]
    if bad:
        raise ValueError(f"--variants: unknown kernel variant(s) {bad}; known: {sorted(known)}")
    return [BASELINE] + [v for v in dict.fromkeys(names) if v != BASELINE]


#: Largest M at which the decode-size kernels are timed: the mma.sync split-K / stream-K kernels, ``decode_tma`` and
#: the experimental ``wgmma_ss`` (7B gate_up split-K at M = 1,024: 3.5x the register-A wgmma kernel's time).
SMALL_KERNELS_MAX_M = 1024
#: Variants timed at every M: the register-A wgmma kernels (and their tile variants), which the dispatch runs at
#: prefill sizes (7B layer 1.01x BF16 at M = 2,048 on an H200); a table run without them above 1,024 tokens had only
#: dequantize + cuBLAS to compare the op with there.
EVERY_M_VARIANTS = frozenset({"wgmma_rs", "wgmma_wide"})


def timed_at(variant: str, m: int) -> bool:
    """Whether ``variant`` (a kernel name; a tile variant counts as its kernel) is timed at ``m`` tokens at all."""
    return m <= SMALL_KERNELS_MAX_M or TILE_VARIANTS.get(variant, variant) in EVERY_M_VARIANTS


def variant_applies(ext, variant: str, m: int, n: int, k: int) -> bool:  # noqa: ANN001 - the extension module
    """Whether timing ``variant`` at (M, N, K) measures anything but split-K again: the extension says which fused
    kernel the variant's forced mode runs on this device (stream-K: block_m 32 / 64 where the device grants its
    ring, split-K elsewhere); above M = 1,024 only the register-A wgmma kernels are timed (:func:`timed_at`)."""
    if variant == BASELINE:
        return True
    if variant in TILE_VARIANTS:  # only where the tile choice differs from the kernel's own variant
        kernel = TILE_VARIANTS[variant]
        moved = wide_tile(m) != 256 if variant == "wgmma_rs_t256" else True
        moved = moved and m >= WIDE_MIN_M
        return moved and variant_applies(ext, kernel, m, n, k)
    return timed_at(variant, m) and ext.gemm_choice(m, n, k, int(VARIANT_KERNEL_MODES[variant])) == variant


def _under_knob(setter, value, fn):  # noqa: ANN001, ANN202 - an extension knob, its value, a timed callable
    """``fn`` run with ``setter(value)`` in force, the previous value restored after (errors too). The op reads
    its knobs at each call, so a CUDA graph captured through this keeps the tiles chosen under it."""
    def run(r):  # noqa: ANN001, ANN202
        prev = setter(value)
        try:
            return fn(r)
        finally:
            setter(prev)
    return run


def narrow_wgmma_tiles(ext, fn):  # noqa: ANN001, ANN201 - the extension module, a timed callable
    """``fn`` run with the register-A wgmma kernel held at 128-token tiles."""
    return _under_knob(ext.set_wgmma_wide_min_m, NARROW_WIDE_MIN_M, fn)


def wide_256_tiles(ext, fn):  # noqa: ANN001, ANN201 - the extension module, a timed callable
    """``fn`` run with the wide wgmma kernel held at 256-token tiles (no tile fitted to M)."""
    return _under_knob(ext.set_wgmma_wide_fit, False, fn)


def tile_variant(ext, variant: str, fn):  # noqa: ANN001, ANN201 - the extension module, a timed callable
    """``fn`` run under the tile knob of TILE_VARIANTS entry ``variant``."""
    return wide_256_tiles(ext, fn) if variant == "wgmma_rs_t256" else narrow_wgmma_tiles(ext, fn)


def add_variant_ratios(row: dict, variants: list[str]) -> dict:
    """``row["<v>/splitk"]`` = kernel_splitk_graph_ms / kernel_<v>_graph_ms (the variant's speedup over split-K,
    CUDA-graph timing; > 1 means the variant is faster), where both are present."""
    base = row.get(f"kernel_{BASELINE}_graph_ms")
    for v in variants:
        if v != BASELINE and base and row.get(f"kernel_{v}_graph_ms"):
            row[f"{v}/{BASELINE}"] = round(base / row[f"kernel_{v}_graph_ms"], 3)
    return row


def variant_lines(rows: list[dict], variants: list[str]) -> list[str]:
    """Printed comparison of the fused-kernel variants: per GEMM and per layer, graph ms and ratio to split-K."""
    others = [v for v in variants if v != BASELINE]
    if not others:
        return []
    head = f"{'model':12s} {'layer':8s} {'M':>5s} | {BASELINE + ' g':>8s}"
    for v in others:
        head += f" {v + ' g':>10s} {v + '/' + BASELINE:>15s}"
    lines = [f"# fused-kernel variants, CUDA graph ms; <v>/{BASELINE} = {BASELINE} / variant (> 1: variant faster)",
             head]
    for r in rows:
        if not any(r.get(f"kernel_{v}_graph_ms") for v in others):
            continue
        base = r.get(f"kernel_{BASELINE}_graph_ms")
        line = f"{r['model']:12s} {r['layer']:8s} {r['M']:5d} | " + (f"{base:8.4f}" if base else f"{'-':>8s}")
        for v in others:
            t, q = r.get(f"kernel_{v}_graph_ms"), r.get(f"{v}/{BASELINE}")
            line += (f" {t:10.4f}" if t else f" {'-':>10s}") + (f" {q:15.3f}" if q else f" {'-':>15s}")
        lines.append(line)
    return lines
