"""Small random-weight Qwen2/Llama checkpoints with a local byte-level BPE tokenizer.

Tests, the README's default job and the benchmarks need Hugging Face model folders without
touching a hub. The tokenizer is a byte-level BPE trained here on generated arithmetic text, so
that transformers >= 5.17 (which forces ``Qwen2Tokenizer`` for ``model_type=qwen2``) still
encodes prompts, a newline is one token (verl's Qwen token builder checks this), and ChatML
``<|im_start|>``/``<|im_end|>`` exist with a chat template.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Shapes used across tests: head_dim 64 (vLLM's CPU attention supports it), K and N multiples of 64.
TINY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2)


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ("what is the sum of and plus minus times answer think step by step total each has apples "
             "books more less left gives buys how many then so").split()
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        lines.append(f"{text} {a} + {b} = {a + b}\n#### {a + b}\n")
    return lines


def build_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML specials, trained locally."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000, seed), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer trained to {tok.get_vocab_size()} ids, wanted {vocab_size}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    return fast


def make_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "qwen2",
    vocab_size: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    init_std: float = 0.02,
    **shape: int,
) -> Path:
    """Write a random-weight causal LM (``arch`` ``qwen2`` or ``llama``) and its tokenizer to ``out_dir``.

    ``shape`` overrides :data:`TINY_SHAPE` keys. Weights are N(0, init_std), deterministic in ``seed``.
    Returns the folder. Refuses a non-empty ``out_dir``.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size, seed)
    dims = {**TINY_SHAPE, **shape}
    common = dict(
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        rope_theta=10000.0,
        initializer_range=init_std,
        torch_dtype=str(dtype).removeprefix("torch."),
        **dims,
    )
    if arch == "qwen2":
        cfg = Qwen2Config(**common)
    elif arch == "llama":
        cfg = LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    else:
        raise ValueError(f"arch={arch!r}: expected 'qwen2' or 'llama'")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    meta = {"made_by": "verl_qerl.testing.tiny", "arch": arch, "seed": seed, **dims}
    (out / "tiny_model.json").write_text(json.dumps(meta, indent=1))
    return out


def lora_nvfp4_model(path: str, r: int = 8, seed: int = 1) -> torch.nn.Module:
    """An NVFP4 model from ``path`` (float32) with a LoRA adapter whose A and B are both random
    (peft starts B at 0, which would leave the adapter's gradient paths untested)."""
    from verl_qerl.modeling import get_lora_model, load_nvfp4_model

    model = get_lora_model(load_nvfp4_model(path, dtype=torch.float32), r=r, lora_alpha=2 * r)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model
