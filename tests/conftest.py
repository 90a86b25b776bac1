"""Shared fixtures: tiny local checkpoints (no hub), GPU-test skipping."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_bf16(tmp_path_factory):
    """A random-weight tiny Qwen2 checkpoint folder (bf16, one shard)."""
    from verl_qerl.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "bf16")


@pytest.fixture(scope="session")
def tiny_nvfp4(tiny_bf16, tmp_path_factory):
    """``qerl-quantize`` of :func:`tiny_bf16` (compressed-tensors NVFP4A16)."""
    from verl_qerl.checkpoint_conversion import quantize_checkpoint

    dst = tmp_path_factory.mktemp("tiny") / "nvfp4"
    quantize_checkpoint(tiny_bf16, dst)
    return dst


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A tiny GGUF file (the pretrained-model tests' stand-in for a packaged model's GGUF)."""
    from verl_qerl.testing.tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", name="Tiny GGUF Test Model")


@pytest.fixture(scope="module")
def sass_census():
    """benchmarks/sass_census.py as a module, where nvcc and nvdisasm exist (the CI machine has both; else skip)."""
    import shutil

    from verl_qerl.testing.scripts import load_script

    mod = load_script("benchmarks/sass_census.py", "sass_census")
    if not shutil.which("nvcc"):
        pytest.skip("nvcc not installed")
    try:
        mod.find_nvdisasm()
    except mod.CensusError as exc:
        pytest.skip(str(exc))
    return mod
