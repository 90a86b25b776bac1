"""Turn a Hugging Face Qwen2/Qwen2.5/Llama causal LM into the trainable QeRL policy's base.

``quantize_model(model, mode=...)`` is the one entry point for the three bases every comparison
uses: ``"nvfp4"`` (QeRL: frozen NVFP4 ``NVFP4Linear``), ``"bf16"`` (plain LoRA: unchanged) and
``"nf4"`` (QLoRA: bitsandbytes ``Linear4bit``).

For NVFP4 the weights come from one of three places, all giving identical buffers:

* the model's own BF16 weights, quantized in place group by group (fused q/k/v and gate/up
  share one global scale, as in ``qerl-quantize`` and vLLM), so the peak stays about one layer
  above the quantized model;
* a BF16 checkpoint folder (``checkpoint=``), read one tensor at a time, so a model built on the
  meta device never materializes its BF16 Linear weights;
* an NVFP4 checkpoint (compressed-tensors NVFP4A16 or ModelOpt NVFP4), copied straight into the
  buffers without any dense weight at all.

:func:`load_nvfp4_model` builds the model with its parameters on the meta device and fills it
from a checkpoint that way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Iterable, Iterator

import torch
import torch.nn as nn

from ..nvfp4 import BLOCK_SIZE, DEFAULT_SCALE_RULE, NVFP4FormatError, check_scale_rule, fused_global_scale
from ..nvfp4.arch import DEFAULT_IGNORE, SUPPORTED_MODEL_TYPES, fused_group
from ..nvfp4.checkpoint import (
    FORMAT_BF16,
    SCALE_RULE_KEY,
    CheckpointError,
    CheckpointReader,
    PatternError,
    check_ignore,
    check_patterns,
    matches_pattern,
    validate_nvfp4,
)
from ..nvfp4.quant_config import quantize_at_load_layers
from .linear import NVFP4Linear, quantize_rows

MODES = ("nvfp4", "bf16", "nf4")


class ModelConversionError(ValueError):
    """A model, module or checkpoint that quantize_model cannot convert; the message names it."""


def check_dtype(dtype: torch.dtype | str | None, where: str) -> torch.dtype | None:
    """``dtype`` as a torch floating-point dtype of 16 bits or more: a ``torch.dtype`` or its name, as transformers
    takes it (``"bfloat16"``, ``"torch.float16"``); None stays None. Anything else is refused naming ``where`` and
    ``dtype`` (a string used to fail deep inside with an AttributeError naming neither)."""
    if dtype is None:
        return None
    value = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype) or not value.is_floating_point or value.itemsize < 2:
        raise ModelConversionError(f"{where}: dtype={dtype!r}; expected a torch floating-point dtype such as "
                                   "torch.bfloat16, or its name ('bfloat16', 'float16', 'float32')")
    return value


def _split(name: str) -> tuple[str, str]:
    parent, _, leaf = name.rpartition(".")
    return parent, leaf


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, leaf = _split(name)
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _check_model(model: nn.Module, strict_arch: bool) -> None:
    try:
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - peft is an install requirement of training
        PeftModel, BaseTunerLayer = (), ()  # type: ignore[assignment]
    if isinstance(model, PeftModel) or any(isinstance(m, BaseTunerLayer) for m in model.modules()):
        raise ModelConversionError("quantize_model: the model already has peft adapters; quantize the base model "
                                   "first, then add LoRA (see verl_qerl.modeling.get_lora_model)")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if strict_arch and model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConversionError(f"quantize_model: model_type={model_type!r} is not supported "
                                   f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}; pass strict_arch=False to try "
                                   "another architecture whose Linear layers are plain torch.nn.Linear)")


def _select_targets(model: nn.Module, ignore: Iterable[str], targets: Iterable[str] | None,
                    must_match: Iterable[str] = ()) -> list[str]:
    """Names of the modules to convert, in model order; errors name any unsupported module and any pattern of
    ``must_match`` (the caller's own ignore patterns) that keeps no Linear layer (a misspelling)."""
    ignore = list(ignore)
    modules = dict(model.named_modules())
    linear = [n for n, m in modules.items() if isinstance(m, (nn.Linear, NVFP4Linear))]
    try:  # a fused group (q/k/v, gate/up) is all NVFP4 or all BF16, as vLLM serves it
        check_ignore(linear, ignore, "ignore", must_match=must_match)
    except PatternError as err:
        raise ModelConversionError(f"quantize_model: {err}") from err
    if targets is None:
        names = [n for n, m in modules.items() if isinstance(m, nn.Linear) and not matches_pattern(n, ignore)]
    else:
        patterns = list(targets)
        names = [n for n in modules if n and matches_pattern(n, patterns) and not matches_pattern(n, ignore)]
        unmatched = [p for p in patterns if not any(matches_pattern(n, [p]) for n in modules if n)]
        if unmatched:
            raise ModelConversionError(f"quantize_model: target pattern(s) {unmatched} match no module of the model")
    for n in names:
        m = modules[n]
        if type(m) is not nn.Linear and not isinstance(m, NVFP4Linear):
            raise ModelConversionError(
                f"quantize_model: module {n!r} is a {type(m).__module__}.{type(m).__qualname__}; only plain "
                "torch.nn.Linear layers can be converted (is the model already quantized, or is this an "
                "embedding/conv? add it to ignore=)")
    if targets is not None:
        _check_target_groups(linear, names, modules)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied and any(n == "lm_head" or n.endswith(".lm_head") for n in names):
        raise ModelConversionError("quantize_model: lm_head is tied to the input embeddings (tie_word_embeddings); "
                                   "keep it in ignore=")
    return [n for n in names if not isinstance(modules[n], NVFP4Linear)]


def _check_target_groups(linear: list[str], names: list[str], modules: dict[str, nn.Module]) -> None:
    """The ``targets`` selection ``names`` (plus the layers already NVFP4) against the fused groups (q/k/v,
    gate/up): each is converted whole or not at all, the rule :func:`check_ignore` applies to ``ignore``.

    Why: a target such as ``q_proj`` alone quantized it with a global scale of its own while k/v stayed dense, a
    model no NVFP4 checkpoint or vLLM fused layer can hold; ``ignore=["k_proj"]`` was already refused."""
    chosen = set(names) | {n for n in linear if isinstance(modules[n], NVFP4Linear)}
    groups: dict[str, list[str]] = {}
    for n in linear:
        groups.setdefault(fused_group(n), []).append(n)
    for key, members in groups.items():
        picked = [m for m in members if m in chosen]
        if picked and len(picked) < len(members):
            rest = [m for m in members if m not in chosen]
            leaves = "/".join(m.rpartition(".")[2] for m in members)
            raise ModelConversionError(f"quantize_model: targets: selects {picked[0]} but not {rest[0]}: {leaves} are "
                                       f"one fused layer ({key}) in vLLM and share one global scale; target all of "
                                       "them or none")


def _groups(names: list[str]) -> list[list[str]]:
    """Fused groups (q/k/v, gate/up) in model order; other layers alone."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(fused_group(n), []).append(n)
    return list(groups.values())


def quantize_model(
    model: nn.Module,
    mode: str = "nvfp4",
    *,
    ignore: Iterable[str] = DEFAULT_IGNORE,
    targets: Iterable[str] | None = None,
    checkpoint: str | os.PathLike | CheckpointReader | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    strict_arch: bool = True,
    progress: Callable[[Iterable, int, str], Iterable] | None = None,
    scale_rule: str = DEFAULT_SCALE_RULE,
    compute_device: torch.device | str | None = None,
    ignore_must_match: bool = True,
) -> nn.Module:
    """Replace the Linear layers of ``model`` in place by the ``mode``'s frozen base layers.

    ``ignore``: module patterns kept as they are (exact name, dotted suffix or ``re:<regex>``;
    lm_head by default; embeddings are not Linear layers and are never touched). ``targets``:
    convert only modules matching these patterns (default: every ``nn.Linear`` not ignored).
    ``checkpoint``: a BF16 or NVFP4 checkpoint folder (or a ``CheckpointReader``) to take the weights
    from instead of the model (its Linear weights may then be on the meta device; other meta
    parameters are filled from the checkpoint too). ``device``/``dtype``: where the new layers
    live and their compute dtype (default: those of the replaced layer; CPU for meta layers; ``dtype`` may be
    a torch float dtype or its name, e.g. ``"bfloat16"``).
    ``scale_rule``: how NVFP4 scales are computed when quantizing dense weights (see
    ``verl_qerl.nvfp4.SCALE_RULES``; vLLM's quantize-at-load must use the same). ``compute_device``: where dense
    weights are quantized (e.g. the GPU of a verl worker whose model is still on the CPU: the same torch ops give
    the same bits, in seconds instead of minutes); the results go back to each layer's device (nvfp4 from dense
    weights only: nf4 and NVFP4 checkpoints ignore it). ``ignore_must_match``: each ``ignore`` pattern beyond the
    default must keep a Linear layer (a misspelled ``donw_proj`` is refused, not silently quantized); False for
    patterns a checkpoint declared. Returns ``model``.
    """
    if mode not in MODES:
        raise ModelConversionError(f"quantize_model: mode={mode!r}; expected one of {MODES}")
    try:
        ignore = check_patterns(ignore, "quantize_model: ignore")
        targets = None if targets is None else check_patterns(targets, "quantize_model: targets")
        check_scale_rule(scale_rule, "quantize_model: scale_rule")
    except (PatternError, NVFP4FormatError) as exc:
        raise ModelConversionError(str(exc)) from exc
    dtype = check_dtype(dtype, "quantize_model")
    _check_model(model, strict_arch)
    if mode == "bf16":
        if checkpoint is not None:
            raise ModelConversionError("quantize_model: mode='bf16' takes no checkpoint (load it with transformers)")
        return model
    must_match = [p for p in ignore if p not in DEFAULT_IGNORE] if ignore_must_match else []
    names = _select_targets(model, ignore, targets, must_match)
    if mode == "nf4":
        if checkpoint is not None:
            raise ModelConversionError("quantize_model: mode='nf4' quantizes the model's own weights; no checkpoint")
        from .nf4 import convert_to_nf4

        return convert_to_nf4(model, names, compute_dtype=dtype, progress=progress)
    wrap = progress or (lambda it, total, desc: it)
    reader = None
    if checkpoint is not None:
        reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    # Every step checks all layers before it replaces any, so a refused conversion leaves the model as it was.
    def before_replacing(replaced: Collection[str]) -> None:
        if reader is not None:
            check_meta_fill(model, reader, skip=replaced)

    if reader is not None and reader.format != FORMAT_BF16:
        _load_nvfp4_layers(model, reader, ignore, targets, device, dtype, wrap, before_replacing)
    else:
        _quantize_layers(model, names, reader, device, dtype, wrap, before_replacing, scale_rule, compute_device)
    if reader is not None:
        fill_meta_from_checkpoint(model, reader, device=device, dtype=dtype)
    return model


def _layer_dtype(linear: nn.Module, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    w = getattr(linear, "weight", None)
    if isinstance(w, torch.Tensor) and w.dtype.is_floating_point:
        return w.dtype
    return getattr(linear, "compute_dtype", torch.bfloat16)


def _target_device(linear: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    t = next(iter(list(linear.parameters()) + list(linear.buffers())), None)
    return torch.device("cpu") if t is None or t.is_meta else t.device


def _quantize_layers(
    model: nn.Module,
    names: list[str],
    reader: CheckpointReader | None,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    wrap: Callable[[Iterable, int, str], Iterable],
    before_replacing: Callable[[Collection[str]], None],
    scale_rule: str,
    compute_device: torch.device | str | None = None,
) -> None:
    """Quantize group by group from the model's (or a BF16 checkpoint's) dense weights (on ``compute_device`` when
    given, the results moved back to each weight's device).

    Two passes, so that nothing is replaced until every layer is known to convert: the first
    checks each group (meta placement, checkpoint shapes, biases) and computes its shared global
    scale, which reads every weight once and refuses K not a multiple of 16 or NaN/Inf; the second
    quantizes and swaps the layers in. Peak memory stays one group above the model.
    """
    groups = _groups(names)
    shells: list[list[str]] = []
    dense: list[list[str]] = []
    for group in groups:
        mods = [model.get_submodule(n) for n in group]
        if reader is None and any(m.weight.is_meta for m in mods):
            _check_meta_group(group, mods, device)
            shells.append(group)
        else:
            dense.append(group)
    scales: dict[str, torch.Tensor] = {}
    biases: dict[str, nn.Parameter | None] = {}

    def on_compute(w: torch.Tensor) -> torch.Tensor:
        return w if compute_device is None else w.to(compute_device)

    for group in wrap(dense, len(dense), "check NVFP4 layers"):
        weights = [on_compute(_dense_weight(model, n, reader, device)) for n in group]
        try:
            scales[group[0]] = fused_global_scale(weights, [f"{n}.weight" for n in group], scale_rule)
        except NVFP4FormatError as exc:
            raise ModelConversionError(f"quantize_model: {exc}") from exc
        for n in group:
            biases[n] = _layer_bias(model.get_submodule(n), n, reader)
        del weights
    before_replacing(names)
    for group in shells:
        _meta_shells(model, group, [model.get_submodule(n) for n in group], dtype)
    for group in wrap(dense, len(dense), "quantize NVFP4"):
        for n in group:
            m = model.get_submodule(n)
            w = _dense_weight(model, n, reader, device)
            wc = on_compute(w)
            q = quantize_rows(wc, scales[group[0]].to(wc.device), name=f"{n}.weight", scale_rule=scale_rule)
            q = q.to(w.device)
            bias = biases[n]
            new = NVFP4Linear.from_nvfp4(q, None if bias is None else bias.data, dtype=_layer_dtype(m, dtype),
                                         device=w.device, name=n)
            _set_module(model, n, new)
            del w, wc, q


def _dense_weight(
    model: nn.Module, name: str, reader: CheckpointReader | None, device: torch.device | str | None
) -> torch.Tensor:
    """The dense weight of layer ``name``: the checkpoint's (shape-checked) or the model's own."""
    m = model.get_submodule(name)
    if reader is None:
        w = m.weight.detach()
        return w if device is None else w.to(device)
    w = reader.get(f"{name}.weight")
    if tuple(w.shape) != (m.out_features, m.in_features):
        raise CheckpointError(f"{reader.folder}: tensor '{name}.weight' is {list(w.shape)} but the model's "
                              f"layer is [{m.out_features}, {m.in_features}]")
    return w.to(_target_device(m, device))


def _check_meta_group(group: list[str], mods: list[nn.Module], device: torch.device | str | None) -> None:
    """A meta group can become meta shells: all parts on meta, no real device asked for, K fits NVFP4."""
    if not all(m.weight.is_meta for m in mods):
        raise ModelConversionError(f"quantize_model: fused layers {group} are partly on the meta device; a shared "
                                   "global scale needs all of their weights (or none)")
    if device is not None and torch.device(device).type != "meta":
        raise ModelConversionError(f"quantize_model: {group[0]!r} is on the meta device (no data to quantize); "
                                   "load the weights or pass checkpoint=")
    for n, m in zip(group, mods):
        if m.in_features % BLOCK_SIZE:
            raise ModelConversionError(f"quantize_model: {n}.weight: in_features K={m.in_features} is not a "
                                       f"multiple of the NVFP4 block size {BLOCK_SIZE}")


def _meta_shells(
    model: nn.Module,
    group: list[str],
    mods: list[nn.Module],
    dtype: torch.dtype | None,
) -> None:
    """Meta Linear in, meta NVFP4Linear out (checked by :func:`_check_meta_group` first): the buffers
    are filled later by a state-dict load or a broadcast from a rank that has the data (verl builds
    non-zero ranks on the meta device and broadcasts rank 0's parameters *and buffers* when it
    shards the model)."""
    for n, m in zip(group, mods):
        new = NVFP4Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta",
                          dtype=_layer_dtype(m, dtype))
        _set_module(model, n, new)


def _layer_bias(linear: nn.Module, name: str, reader: CheckpointReader | None) -> nn.Parameter | None:
    """The bias to keep: the module's, or the checkpoint's where the module's is on meta."""
    bias = getattr(linear, "bias", None)
    key = f"{name}.bias"
    if reader is not None and key in reader:
        if bias is None:
            raise CheckpointError(f"{reader.folder}: tensor {key!r} exists but the model's layer {name!r} has no bias")
        if bias.is_meta:
            t = reader.get(key)
            if tuple(t.shape) != tuple(bias.shape):
                raise CheckpointError(f"{reader.folder}: tensor {key!r} is {list(t.shape)}, the model expects "
                                      f"{list(bias.shape)}")
            return nn.Parameter(t, requires_grad=False)
    if bias is not None and bias.is_meta:
        raise CheckpointError(f"model layer {name!r} has its bias on the meta device and the checkpoint has no {key!r}")
    return None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)


def _load_nvfp4_layers(
    model: nn.Module,
    reader: CheckpointReader,
    ignore: Iterable[str],
    targets: Iterable[str] | None,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    wrap: Callable[[Iterable, int, str], Iterable],
    before_replacing: Callable[[Collection[str]], None],
) -> None:
    """Fill NVFP4Linear layers straight from an NVFP4 checkpoint's tensors (no dense weight)."""
    modules = dict(model.named_modules())
    stored = reader.nvfp4_modules()
    unknown = [m for m in stored if m not in modules]
    if unknown:
        raise CheckpointError(f"{reader.folder}: checkpoint layer(s) {unknown[:5]} (e.g. tensor "
                              f"'{unknown[0]}.weight_packed') do not exist in the model: wrong model for this "
                              "checkpoint?")
    ignore = list(ignore)
    # ignore= is applied here too: a tied lm_head is never a target (and _select_targets refuses it as one)
    wanted = set(_select_targets(model, ignore, targets))
    wanted |= {n for n, m in modules.items() if isinstance(m, NVFP4Linear)}
    stored_set = set(stored)
    for n in sorted(wanted - stored_set):
        if matches_pattern(n, ignore):
            continue
        if f"{n}.weight" not in reader:
            raise CheckpointError(f"{reader.folder}: model layer {n!r} has neither NVFP4 tensors "
                                  f"('{n}.weight_packed') nor a dense '{n}.weight' in the checkpoint")
    # every stored layer checked (shard headers, global scale, bias) before the first is replaced
    load: dict[str, nn.Parameter | None] = {}
    for n in stored:
        m = modules[n]
        if matches_pattern(n, ignore):
            raise ModelConversionError(f"quantize_model: {n!r} is in ignore= but the checkpoint stores it in NVFP4")
        if type(m) is not nn.Linear and not isinstance(m, NVFP4Linear):
            raise ModelConversionError(f"quantize_model: checkpoint layer {n!r} is a {type(m).__qualname__} in the "
                                       "model, not a torch.nn.Linear")
        if targets is not None and n not in wanted:
            continue
        try:
            reader.check_nvfp4(n, expected_shape=(m.out_features, m.in_features))
        except NVFP4FormatError as exc:
            raise CheckpointError(f"{reader.folder}: {exc}") from exc
        load[n] = _layer_bias(m, n, reader)
    before_replacing(load)
    for n in wrap(list(load), len(load), "load NVFP4"):
        m = modules[n]
        w = reader.read_nvfp4(n)
        try:
            w = validate_nvfp4(n, w.packed, w.scale, w.global_scale, expected_shape=(m.out_features, m.in_features))
        except NVFP4FormatError as exc:
            raise CheckpointError(f"{reader.folder}: {exc}") from exc
        bias = load[n]
        new = NVFP4Linear.from_nvfp4(w, None if bias is None else bias.data, dtype=_layer_dtype(m, dtype),
                                     device=_target_device(m, device), name=n)
        _set_module(model, n, new)


def _meta_tensors(model: nn.Module, skip: Collection[str] = ()) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(name, module, leaf, tensor)`` of every parameter / persistent buffer still on the meta
    device, outside the modules named in ``skip``."""
    for mod_name, mod in model.named_modules():
        if mod_name in skip:
            continue
        local = list(mod._parameters.items()) + [
            (k, v) for k, v in mod._buffers.items() if k not in mod._non_persistent_buffers_set
        ]
        for leaf, t in local:
            if t is not None and t.is_meta:
                yield (f"{mod_name}.{leaf}" if mod_name else leaf), mod, leaf, t


def check_meta_fill(model: nn.Module, reader: CheckpointReader, skip: Collection[str] = ()) -> None:
    """What :func:`fill_meta_from_checkpoint` would refuse (a missing tensor, a shape mismatch), from
    the shard headers alone; ``skip``: modules about to be replaced, whose tensors do not matter."""
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    missing = []
    for name, _mod, _leaf, t in _meta_tensors(model, skip):
        if name not in reader:
            if not (tied and name.endswith("lm_head.weight")):
                missing.append(name)
            continue
        _dtype, shape = reader.metadata(name)
        if tuple(shape) != tuple(t.shape):
            raise CheckpointError(f"{reader.folder}: tensor {name!r} is {list(shape)}, the model expects "
                                  f"{list(t.shape)}")
    if missing:
        raise CheckpointError(f"{reader.folder}: the model's tensor(s) {missing[:5]} are missing from the checkpoint")


def fill_meta_from_checkpoint(
    model: nn.Module,
    reader: CheckpointReader,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Load every parameter / persistent buffer of ``model`` still on the meta device from ``reader``.

    Tensors already holding data are left alone. Float tensors take ``dtype`` (default: the meta
    tensor's own dtype). Tied output embeddings are re-tied instead of loaded. Everything is
    checked (:func:`check_meta_fill`) before the first tensor is loaded.
    """
    check_meta_fill(model, reader)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    for name, mod, leaf, t in list(_meta_tensors(model)):
        if name not in reader:  # only the tied output embedding (checked above)
            continue
        value = reader.get(name)
        target_dtype = (dtype or t.dtype) if t.dtype.is_floating_point else t.dtype
        value = value.to(device=dev, dtype=target_dtype)
        if leaf in mod._parameters:
            mod._parameters[leaf] = nn.Parameter(value, requires_grad=t.requires_grad)
        else:
            mod._buffers[leaf] = value
    if tied and hasattr(model, "tie_weights"):
        model.tie_weights()


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build modules with their *parameters* on the meta device and their buffers real.

    Rotary-embedding tables and other non-persistent buffers are computed at construction and are
    in no checkpoint, so they must be real; parameters are what a checkpoint fills. Creating a
    parameter then costs nothing (``torch.empty`` pages are never touched), and initializers run
    on meta tensors, i.e. not at all.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def load_nvfp4_model(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | str = torch.bfloat16,
    device: torch.device | str = "cpu",
    ignore: Iterable[str] | None = None,
    scale_rule: str | None = None,
) -> nn.Module:
    """A causal LM with ``NVFP4Linear`` layers, read from a checkpoint folder without dense Linear weights.

    ``path`` holds an NVFP4 checkpoint (compressed-tensors NVFP4A16 such as ``qerl-quantize``
    writes, or ModelOpt NVFP4): its tensors go straight into the buffers. A BF16 checkpoint
    (including one whose config says ``{"quant_method": "qerl_nvfp4"}``: quantize at load, as vLLM
    does) is quantized on load, one fused group at a time. ``ignore``: what stays dense; by default
    the checkpoint's own qerl_nvfp4 ``ignore`` list where it has one (the layers vLLM keeps dense),
    else :data:`DEFAULT_IGNORE`. ``scale_rule``: how the scales are computed; by default the
    checkpoint's own qerl_nvfp4 ``scale_rule`` where it has one (what vLLM would use), else
    :data:`~verl_qerl.nvfp4.DEFAULT_SCALE_RULE`. ``dtype``: a torch float dtype or its name (``"bfloat16"``).
    ``path`` may start with ``~``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = check_dtype(dtype, "load_nvfp4_model")
    reader = CheckpointReader(path)
    folder = reader.folder  # ``~`` expanded: every file of the checkpoint is read from here
    declared_ignore, declared_targets = quantize_at_load_layers(reader.quant_config)
    user_ignore = ignore is not None
    if ignore is None:
        # the declared list adds to the default, as qerl-quantize reads it and as vLLM behaves (its LM head is never
        # a quantized Linear): a declared ["down_proj"] must not quantize lm_head here alone
        ignore = list(dict.fromkeys([*DEFAULT_IGNORE, *(declared_ignore or ())]))
    config = dict(reader.config)
    for key in ("quantization_config", "compression_config", SCALE_RULE_KEY):
        config.pop(key, None)
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ModelConversionError(f"{folder}: model_type={config.get('model_type')!r} is not supported "
                                   f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    hf_config = AutoConfig.for_model(**config)
    # the folder as the model's name, as from_pretrained records it: peft writes it into a saved adapter's
    # base_model_name_or_path (None made AutoPeftModelForCausalLM look for a hub repository named "None")
    hf_config._name_or_path = str(folder.resolve())
    with torch.device(device), params_on_meta():  # buffers (rotary tables) real on ``device``
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    targets = declared_targets if reader.format == FORMAT_BF16 else None
    if scale_rule is None:
        scale_rule = str((reader.quant_config or {}).get("scale_rule", DEFAULT_SCALE_RULE))
    quantize_model(model, "nvfp4", checkpoint=reader, device=device, dtype=dtype, ignore=ignore, targets=targets,
                   scale_rule=scale_rule, ignore_must_match=user_ignore)
    if (folder / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    model.eval()
    return model


def build_nvfp4_model(
    hf_config,
    checkpoint: str | os.PathLike | CheckpointReader,
    *,
    dtype: torch.dtype | str = torch.bfloat16,
    ignore: Iterable[str] = DEFAULT_IGNORE,
    auto_class=None,
    meta: bool = False,
    scale_rule: str = DEFAULT_SCALE_RULE,
    **from_config_kwargs,
) -> nn.Module:
    """Build ``auto_class`` (default ``AutoModelForCausalLM``) from ``hf_config`` with NVFP4Linear layers.

    The model is constructed with its parameters on the meta device and filled from ``checkpoint``
    (an NVFP4 checkpoint: tensors copied into the buffers; a BF16 one: quantized one fused group at
    a time), so no dense Linear weight is ever allocated; embeddings, norms, biases and ``ignore``d
    layers take ``dtype``. A ``quantization_config`` in ``hf_config`` is dropped (on a copy) so that
    transformers never runs its own quantizer. ``meta=True`` builds meta shells only (parameters
    and NVFP4 buffers on meta, the NVFP4 layers being those the checkpoint stores): for the ranks
    that receive their weights by broadcast from rank 0. ``scale_rule`` applies to a BF16 checkpoint.
    """
    import copy

    dtype = check_dtype(dtype, "build_nvfp4_model")
    if auto_class is None:
        from transformers import AutoModelForCausalLM as auto_class
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    cfg = copy.deepcopy(hf_config)
    for key in ("quantization_config", "compression_config"):
        if hasattr(cfg, key):
            delattr(cfg, key)
    with params_on_meta():  # buffers (rotary tables) real, in the caller's device context
        model = auto_class.from_config(cfg, dtype=dtype, **from_config_kwargs)
    if meta:
        stored = reader.nvfp4_modules() if reader.format != FORMAT_BF16 else None
        quantize_model(model, "nvfp4", ignore=ignore, targets=stored, device="meta", dtype=dtype)
        return model
    quantize_model(model, "nvfp4", checkpoint=reader, dtype=dtype, ignore=ignore, scale_rule=scale_rule)
    return model
