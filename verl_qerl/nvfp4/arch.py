"""Architecture facts every side of NVFP4 agrees on: which models, which layers stay dense, which share a scale.

The checkpoint converter (``qerl-quantize``), the in-memory model conversion, the merged-weight export,
the verl config check and the ``qerl_nvfp4`` vLLM method all read these, so a model that one side accepts
is quantized the same way by the others.
"""

from __future__ import annotations

#: HF ``model_type`` values whose Linear layout (q/k/v/o, gate/up/down, lm_head) has been tested on the
#: training side and in vLLM: dense decoders with plain RMSNorm gains (what AQN perturbs).
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("qwen2", "llama")

#: Modules left in BF16 unless the user says otherwise (embeddings are not Linear layers at all).
DEFAULT_IGNORE: tuple[str, ...] = ("lm_head",)

#: Projections that inference engines fuse into one GEMM (leaf name -> fused name), so their parts
#: share one global scale.
FUSED_GROUPS: dict[str, str] = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                                "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def fused_group(module: str) -> str:
    """The fused-layer key a module belongs to (itself when it is not fused)."""
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{FUSED_GROUPS[leaf]}" if leaf in FUSED_GROUPS else module
