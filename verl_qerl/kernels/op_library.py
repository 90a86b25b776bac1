"""The ``qerl`` torch.library namespace every verl-qerl op is registered in, and Triton where the stack has it.

One place for both so that the op modules (:mod:`.ops`, :mod:`.lora_shrink`, :mod:`.lora_expand`) cannot drift
apart: an op is called as ``torch.ops.qerl.<name>`` and traced by torch.compile under that namespace, and the
Triton kernels fall back to torch ops on one shared condition (no Triton, or a build without a usable backend).
"""

from __future__ import annotations

import torch

LIB_NAME = "qerl"

try:  # Triton ships with the CUDA stack; the CPU build has none (or one without a CPU backend)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

__all__ = ["LIB_NAME", "library", "tl", "triton"]


def library() -> torch.library.Library:
    """A fragment of the ``qerl`` namespace for one module's ops (keep it alive as long as the module)."""
    return torch.library.Library(LIB_NAME, "FRAGMENT")
