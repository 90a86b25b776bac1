"""The modes of ``benchmarks/kernel.py`` that time nothing: ``--sanitize`` (small checked shapes through every kernel
and split path, for compute-sanitizer), ``--repro-throw``, ``--profile`` (one call per shape, for ncu),
``--ncu-summary`` and ``--sass`` (summaries of ncu / cuobjdump listings).

Kept apart from the timing run: each is a short, self-contained job run under an external tool, and the listing
readers need no GPU at all.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from kernel_common import DEV, random_nvfp4  # benchmarks/: this module's own folder
from kernel_marlin import load_marlin, marlin_apply, marlin_layer
from kernel_variants import TILE_VARIANTS, VARIANT_KERNEL_MODES

from verl_qerl import kernels
from verl_qerl.kernels import reference


def parse_modes(text: str) -> set[str]:
    """``--sanitize-modes`` ("streamk,wgmma_ss") -> op mode names (cuda/gemm_modes.h); unknown names raise
    ValueError naming them and the known ones."""
    names = {v.strip().lower() for v in text.split(",") if v.strip()}
    bad = sorted(names - set(kernels.GEMM_MODES))
    if bad:
        raise ValueError(f"--sanitize-modes: unknown mode(s) {bad}; known: {sorted(kernels.GEMM_MODES)}")
    return names


def sanitize_run(modes: set[str] | None = None, max_nk: int | None = None) -> int:
    """Small shapes through every kernel and split path, checked; meant for compute-sanitizer. ``modes``: only the
    cases of these op modes (names, cuda/gemm_modes.h), ``max_nk``: only weights with N x K <= max_nk (racecheck /
    synccheck are slow)."""
    kernels.load_extension()
    torch.manual_seed(0)
    bad = 0
    # (M, N, K, mode, split-K splits (0: the heuristic))
    for m, n, k, mode, splits in [
            (1, 256, 256, "splitk", 0), (5, 272, 512, "splitk", 2), (16, 128, 384, "splitk", 3),
            (40, 384, 256, "splitk", 0), (70, 128, 256, "splitk", 1), (3, 256, 512, "dequant_cublas", 0),
            (300, 2048, 256, "dequant_cublas", 0),
            # the stream-K kernel: whole tiles, many partials, half tiles, M tails
            (17, 272, 128, "streamk", 0), (33, 400, 640, "streamk", 0), (100, 1040, 768, "streamk", 0),
            (200, 528, 896, "streamk", 0), (64, 4352, 3584, "streamk", 0),
            # the register-A wgmma kernel (stream-K / split-K where it is unavailable): every token tile,
            # half 256-row tiles, partial segments, M tails (the wide kernel's 192-token tiles at M = 129 and 300,
            # its last tile of 108 rows as part boxes; its 256-token tiles at M = 193 and 449)
            (1, 272, 128, "wgmma_rs", 0), (64, 1136, 640, "wgmma_rs", 0), (65, 4352, 3584, "wgmma_rs", 0),
            (300, 528, 896, "wgmma_rs", 0), (129, 256, 1024, "wgmma_rs", 0), (193, 256, 1024, "wgmma_rs", 0),
            # the wide kernel (192- and 256-token tiles) with two segments in some CTAs (stream-K: the next
            # segment's first stages issued during a segment's end) or a 5-CTA cluster split: small enough for
            # racecheck / synccheck
            (300, 1024, 1280, "wgmma_rs", 0), (449, 1024, 1280, "wgmma_rs", 0),
            # the wide kernel's 128-token tiles (wgmma_wide at 65-128): a tail, a full tile split over CTAs
            (65, 4352, 3584, "wgmma_wide", 0), (100, 528, 896, "wgmma_wide", 0), (128, 1024, 1280, "wgmma_wide", 0),
            # the 128-token tile on a weight small enough for racecheck / synccheck
            (100, 528, 896, "wgmma_rs", 0),
            # the wgmma SS kernel: the same, plus a tile split among several CTAs
            (1, 272, 128, "wgmma_ss", 0), (64, 1136, 640, "wgmma_ss", 0), (65, 4352, 3584, "wgmma_ss", 0),
            (300, 528, 896, "wgmma_ss", 0), (129, 256, 1024, "wgmma_ss", 0), (64, 3584, 3584, "wgmma_ss", 0),
            # small weights whose tiles are split among CTAs (two segments per CTA, ring wrap across
            # segments, fix-up), both token tiles: small enough for racecheck / synccheck
            (64, 1024, 1280, "wgmma_ss", 0), (200, 512, 1280, "wgmma_ss", 0),
            # the copy-engine decode kernel: both token tiles (8, 16), one stage, ranges crossing tiles (partials and
            # the fix-up), the ring wrapping across segments; small enough for racecheck / synccheck
            (1, 272, 128, "decode_tma", 0), (5, 1136, 640, "decode_tma", 0), (16, 528, 896, "decode_tma", 0),
            (9, 2304, 1280, "decode_tma", 0)]:
        if (modes is not None and mode not in modes) or (max_nk is not None and n * k > max_nk):
            continue
        packed, scale, gs = random_nvfp4(n, k)
        rw = kernels.repack(packed, scale)
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        b = torch.randn(n, device=DEV).to(torch.bfloat16)
        out = torch.ops.qerl.nvfp4_gemm(x, rw.qweight, rw.qscale, gs, b, n, kernels.GEMM_MODES[mode], splits)
        ref = reference.linear_f64(x, packed, scale, gs, b)
        err = float((out.double() - ref).norm() / ref.norm())
        w1 = kernels.dequantize(packed, scale, gs)
        w2 = kernels.dequantize_repacked(rw, gs, n)
        ok = err < 1e-2 and torch.equal(w1, w2)
        bad += not ok
        print(f"sanitize M={m} N={n} K={k} mode={mode} splits={splits}: rel err {err:.2e} "
              f"dequant equal {torch.equal(w1, w2)}")
    # the fused LoRA epilogues (split-K's; the decode kernel's in mode decode_tma; the register-A wgmma kernels' LoRA
    # term at 64-token tiles and at 256: a tile split over a cluster, and stream-K's partial segments): three slices,
    # a masked token. Then (op `linear`, qerl::nvfp4_lora_linear) the shrink in the GEMM's launch: split-K's shrink
    # CTAs, the decode kernel's shrink units at block_m 8 and 16 (48 ranks: two 32-rank columns, the second half
    # zero-filled), with tiles split over CTAs (stream-K partials ahead of the shrink's) and with one K stage (none).
    for m, n, k, mode, op in [(5, 528, 896, "splitk", "gemm_lora"), (5, 528, 896, "decode_tma", "gemm_lora"),
                              (16, 1136, 640, "decode_tma", "gemm_lora"), (40, 528, 896, "wgmma_rs", "gemm_lora"),
                              (300, 528, 896, "wgmma_rs", "gemm_lora"), (600, 4352, 256, "wgmma_rs", "gemm_lora"),
                              (5, 528, 896, "splitk", "linear"), (5, 528, 896, "decode_tma", "linear"),
                              (16, 1136, 640, "decode_tma", "linear"), (3, 528, 128, "decode_tma", "linear")]:
        if (modes is not None and mode not in modes) or (max_nk is not None and n * k > max_nk):
            continue
        packed, scale, gs = random_nvfp4(n, k)
        rw = kernels.repack(packed, scale)
        r, bounds = 16, [0, 256, 384, n]
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        if op == "linear":
            lora_a = (torch.randn(3 * r, k, device=DEV) / k**0.5).to(torch.bfloat16)
            shrunk = (x.double() @ lora_a.double().T).to(torch.bfloat16)  # the reference's shrink
        else:
            shrunk = torch.randn(m, 3 * r, device=DEV).to(torch.bfloat16)
        lora_b = (torch.randn(n, 3 * r, device=DEV) * 0.05).to(torch.bfloat16)
        mask = (torch.arange(m, device=DEV) != 1).to(torch.bfloat16)
        mode_id = kernels.GEMM_MODES[mode]
        if op == "linear":
            out = torch.ops.qerl.nvfp4_lora_linear(x, rw.qweight, rw.qscale, gs, None, n, lora_a, lora_b, mask, bounds,
                                                   mode_id, 0)
            op += f" (shrink in launch {bool(kernels.extension().lora_shrink_in_launch_runs(m, n, k, mode_id, 3 * r))})"
        else:
            out = torch.ops.qerl.nvfp4_gemm_lora(x, rw.qweight, rw.qscale, gs, None, n, shrunk, lora_b, mask, bounds,
                                                 mode_id, 0)
        ref = reference.linear_f64(x, packed, scale, gs, None).clone()
        for i in range(3):
            c = slice(bounds[i], bounds[i + 1])
            ref[:, c] += mask.double()[:, None] * (shrunk[:, i * r:(i + 1) * r].double()
                                                   @ lora_b[c, i * r:(i + 1) * r].double().T)
        err = float((out.double() - ref).norm() / ref.norm())
        bad += not err < 1e-2
        print(f"sanitize LoRA M={m} N={n} K={k} mode={mode} {op}: rel err {err:.2e}")
    torch.cuda.synchronize()
    print("SANITIZE", "OK" if bad == 0 else f"{bad} FAILED")
    return 1 if bad else 0


def repro_throw() -> int:
    """Call the op with a shape it must refuse; print the error (run under cuda-gdb if it crashes)."""
    kernels.load_extension()
    packed, scale, gs = random_nvfp4(64, 256)
    rw = kernels.repack(packed, scale)
    try:
        torch.ops.qerl.nvfp4_gemm(torch.randn(4, 128, device=DEV).to(torch.bfloat16), rw.qweight, rw.qscale,
                                  gs, None, 64, kernels.GemmMode.SPLITK)
    except RuntimeError as ex:
        print("REPRO caught:", str(ex).splitlines()[0][:200])
    try:
        torch.ops.qerl.nvfp4_gemm(torch.randn(4, 256, device=DEV).half(), rw.qweight, rw.qscale, gs, None, 64,
                                  kernels.GemmMode.SPLITK)
    except RuntimeError as ex:
        print("REPRO caught:", str(ex).splitlines()[0][:200])
    print("REPRO done")
    return 0


#: (M, N, K) of the profiled GEMMs: 7B gate_up / o / down at decode, gate_up at M = 16, 64, 256
PROFILE_SHAPES = [(1, 37888, 3584), (1, 3584, 3584), (1, 3584, 18944), (16, 37888, 3584), (64, 37888, 3584),
                  (256, 37888, 3584), (256, 3584, 3584), (256, 5120, 5120)]


def profile_modes(variants: list[str] | None, env_variant: str) -> list[tuple[str, int]]:
    """(variant, op mode) pairs ``--profile`` launches per shape: the ``--variants`` given (forced), else the one
    ``$QERL_GEMM_KERNEL`` selects (forced; ``auto``, the default: the op's own choice)."""
    names = variants if variants else [env_variant]
    tiles = [v for v in names if v in TILE_VARIANTS]
    if tiles:
        raise ValueError(f"--profile: {tiles} are timing-only variants; profile {sorted(set(TILE_VARIANTS.values()))} "
                         "and move its tile width with the extension's set_wgmma_wide_min_m")
    return [(v, int(VARIANT_KERNEL_MODES.get(v, kernels.GEMM_KERNEL_MODES[v]))) for v in names]


def profile_run(marlin: bool = False, ms: set[int] | None = None, variants: list[str] | None = None,
                nks: set[tuple[int, int]] | None = None) -> int:
    """One fused-kernel call per shape and variant (for ncu), after a warm-up call each; with ``marlin`` vLLM's
    Marlin FP4 GEMM on the same weights right after ours (ncu -k 'regex:nvfp4_gemm|Marlin' keeps the GEMMs:
    split-K is ``nvfp4_gemm_splitk_kernel``, stream-K ``nvfp4_gemm_streamk_kernel``)."""
    shapes = [s for s in PROFILE_SHAPES if (ms is None or s[0] in ms) and (nks is None or s[1:] in nks)]
    if not shapes:
        raise ValueError(f"--profile: no shape of {PROFILE_SHAPES} (M, N, K) has M in {ms} and N x K in {nks}")
    kernels.load_extension()
    modes = profile_modes(variants, kernels.gemm_kernel_variant())
    mod = None
    if marlin:
        mod, why = load_marlin(torch.cuda.get_device_capability())
        if mod is None:
            print(f"# marlin profile skipped: {why}", flush=True)
    for m, n, k in shapes:
        packed, scale, gs = random_nvfp4(n, k)
        rw = kernels.repack(packed, scale)
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        calls = [functools.partial(torch.ops.qerl.nvfp4_gemm, x, rw.qweight, rw.qscale, gs, None, n, mode)
                 for _, mode in modes]
        if mod is not None:
            calls.append(functools.partial(marlin_apply(mod, marlin_layer(mod, packed, scale, gs, n, k), n, k), x))
        for call in calls:
            for _ in range(2):
                call()
                torch.cuda.synchronize()
        print(f"# profiled M={m} N={n} K={k} ({', '.join(v for v, _ in modes)}): {len(calls)} GEMM(s) x 2 calls",
              flush=True)
    return 0


#: the ncu "details" metrics the NOTES tables quote, per profiled kernel
NCU_METRICS = ("Duration", "DRAM Throughput", "Compute (SM) Throughput", "Executed Ipc Active", "Issue Slots Busy",
               "Warp Cycles Per Issued Instruction", "Registers Per Thread", "Theoretical Occupancy",
               "Dynamic Shared Memory Per Block", "Waves Per SM", "L2 Hit Rate")


def ncu_summary(path: str) -> list[dict]:
    """One row per kernel launch of an ``ncu --csv --page details`` listing (plain or .gz): ID, kernel, grid,
    block and :data:`NCU_METRICS` (values as ncu prints them, with their unit)."""
    import csv
    import gzip
    import io

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as fh:
        lines = fh.read().splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if head is None:
        raise SystemExit(f"{path}: no ncu CSV header (\"ID\", ...); run ncu with --csv --page details")
    rows: dict[str, dict] = {}
    for rec in csv.DictReader(io.StringIO("\n".join(lines[head:]))):
        row = rows.setdefault(rec["ID"], {"ID": int(rec["ID"]), "kernel": rec["Kernel Name"].split("(")[0],
                                          "grid": rec["Grid Size"], "block": rec["Block Size"]})
        if rec["Metric Name"] in NCU_METRICS:
            row[rec["Metric Name"]] = f"{rec['Metric Value']} {rec['Metric Unit']}".strip()
    return sorted(rows.values(), key=lambda r: r["ID"])


def sass_summary(path: str) -> int:
    """Opcode histogram per kernel of a ``cuobjdump -sass`` listing (instruction mix of the loops)."""
    import collections
    import re

    funcs: dict[str, collections.Counter] = {}
    cur = None
    for line in Path(path).read_text(errors="replace").splitlines():
        mf = re.search(r"Function : (\S+)", line)
        if mf:
            cur = mf.group(1)
            funcs[cur] = collections.Counter()
            continue
        mi = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if cur and mi:
            funcs[cur][mi.group(1)] += 1
    for name, c in funcs.items():
        print(f"{name} ({sum(c.values())} instructions)")
        print("   " + " ".join(f"{op}:{n}" for op, n in c.most_common(28)))
    return 0
