"""Which tensors AQN perturbs, and the wrapper-free name their noise is keyed by."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .schedule import AQNConfig

#: RMSNorms whose gain feeds a quantized linear layer (q/k/v and gate/up) [P section 3.3].
DEFAULT_TARGETS = ("input_layernorm", "post_attention_layernorm")

#: Path segments that wrappers insert and that must not change the noise of a tensor.
_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
#: Leading paths added by wrappers: DDP (``module.``) and peft (``base_model.model.``).
_WRAPPER_PREFIXES = ("module.", "base_model.model.")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.\d+\.")


def canonical_name(name: str) -> str:
    """The name noise is keyed by: wrapper segments and prefixes removed.

    ``base_model.model.model.layers.0.input_layernorm.weight`` (peft),
    ``_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.input_layernorm.weight`` (FSDP1)
    and vLLM's ``model.layers.0.input_layernorm.weight`` all map to the last one, so the same
    weight draws the same noise whichever wrapper holds it.
    """
    parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
    out = ".".join(parts)
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if out.startswith(prefix):
                out = out[len(prefix) :]
                changed = True
    return out


def _target_regex(targets: Iterable[str]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(t) for t in targets)
    return re.compile(rf"(?:^|\.)layers\.\d+\.(?:{alternatives})\.weight$")


def _is_final_norm(key: str) -> bool:
    return (key == "norm.weight" or key.endswith(".norm.weight")) and not _LAYER_RE.search(key)


def select_norm_tensors(named: Iterable[tuple[str, Any]] | Iterable[str], cfg: AQNConfig) -> list[str]:
    """Names (as given, in order) of the RMSNorm weights AQN perturbs.

    Matches ``...layers.N.<target>.weight`` for each of ``cfg.targets`` (default
    ``input_layernorm`` and ``post_attention_layernorm``) and, with ``include_final_norm``, the
    final ``...norm.weight`` outside the layer stack. ``q_norm``/``k_norm`` are not targets:
    they feed no quantized layer. Accepts ``named_parameters()`` pairs or bare names.
    """
    pattern = _target_regex(cfg.targets)
    out = []
    for item in named:
        name = item if isinstance(item, str) else item[0]
        key = canonical_name(name)
        if pattern.search(key) or (cfg.include_final_norm and _is_final_norm(key)):
            out.append(name)
    return out


def unmatched_targets(names: Iterable[str], cfg: AQNConfig) -> list[str]:
    """What selects nothing among ``names``: each entry of ``cfg.targets`` that matches no tensor (as
    ``qerl.aqn.targets entry 'x'``) and, with ``include_final_norm``, a missing final norm. Empty when all
    match. A misspelled target would otherwise leave its norms clean without a word whenever another one matches."""
    keys = [canonical_name(n) for n in names]
    out = []
    for target in cfg.targets:
        pattern = _target_regex([target])
        if not any(pattern.search(k) for k in keys):
            out.append(f"qerl.aqn.targets entry {target!r}")
    if cfg.include_final_norm and not any(_is_final_norm(k) for k in keys):
        out.append("the final norm that qerl.aqn.include_final_norm=true asks for (a ...norm.weight outside the "
                   "layer stack)")
    return out
