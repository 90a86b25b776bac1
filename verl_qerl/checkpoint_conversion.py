"""Convert a BF16 Hugging Face checkpoint folder into an NVFP4 (compressed-tensors) one, streaming.

Memory stays near one input tensor plus one output shard: pass 1 reads each Linear weight once to
find its amax (fused q/k/v and gate/up share a global scale, and their parts may sit in different
shards); pass 2 rewrites the checkpoint shard by shard. Output goes to a temporary folder beside
DST and is renamed into place only when complete, so an interrupted run leaves nothing half-written
and an existing DST is replaced only with ``force=True``, after the new one is complete.

DST is checked before any weight is read: it must not be, contain or lie inside SRC (symlinks
resolved: replacing it would delete the source), must be a folder if it exists, and its parent must
take the temporary folder, which is created first as the test that DST can be written at all. SRC and DST may
start with ``~`` (expanded, as a shell would not inside quotes or after ``--opt=``).

Only the Linear layers are quantized; every other tensor (lm_head, the embeddings, norms) is written as stored,
in the source's dtype (BF16 for a BF16 checkpoint; float32 / float16 ones stay so, as llm-compressor keeps them).
The tokenizer and other non-weight files are copied, except other tools' completion markers
(:data:`TOOL_MARKERS`): the output is not what those markers describe.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .nvfp4.arch import DEFAULT_IGNORE, SUPPORTED_MODEL_TYPES, fused_group
from .nvfp4.checkpoint import (
    FORMAT_BF16,
    SCALE_RULE_KEY,
    CheckpointError,
    CheckpointReader,
    check_ignore,
    check_patterns,
    ct_quantization_config,
    ct_tensors,
    matches_pattern,
    write_safetensors,
)
from .nvfp4.quant_config import declared_scale_rule, quantize_at_load_layers
from .nvfp4.quantize import DEFAULT_SCALE_RULE, check_scale_rule, checked_amax, global_scale_from_amax, quantize

WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
#: Marker files that say a folder is some tool's finished output (``qerl-pretrained``'s ``DONE``, the rollout
#: benchmark's ``.complete``); never copied into a converted checkpoint, which is a different folder.
TOOL_MARKERS = frozenset({"DONE", ".complete"})
#: Attribute set on the KeyboardInterrupt / Terminated raised for a SIGINT / SIGTERM that arrived while DST was
#: swapped and was delivered after the swap completed: the folder now holding the new, complete output.
OUTPUT_WRITTEN_ATTR = "output_written"


def linear_module_names(config: dict) -> list[str]:
    """Names of the nn.Linear modules of the architecture in ``config`` (built on the meta device)."""
    return list(linear_module_shapes(config))


def linear_module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """{name: (out_features, in_features)} of the nn.Linear modules of the architecture in ``config``, in model
    order (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"config.json model_type={model_type!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {name: (mod.out_features, mod.in_features) for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear)}


@dataclass
class ConversionReport:
    """What a conversion did, for the CLI's summary and for tests."""

    src: Path
    dst: Path
    quantized: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    #: the NVFP4 scale rule used (the one asked for, else the source's declared one, else the default)
    scale_rule: str = DEFAULT_SCALE_RULE


class DestinationError(ValueError):
    """A DST that must not or cannot be written; raised before any weight is read, nothing on disk changed."""


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_output_folder(dst: Path, tool: str, keep: Mapping[str, Path] | None = None) -> Path:
    """Refuse a DST that cannot be a folder, or whose replacement would delete what ``keep`` names
    ({description: path}: the source checkpoint, the installed packages a GGUF is read from); return its real
    path. Paths are compared after resolving symlinks, so a link to a kept folder's parent is refused like the
    parent itself. Says nothing about a non-empty DST (the callers word that themselves)."""
    real_dst = dst.resolve()
    cwd = Path.cwd().resolve()
    if real_dst == cwd or _is_within(cwd, real_dst):
        raise DestinationError(f"{dst}: is or holds the current working directory, which {tool} would replace under "
                               f"the shell's feet; run it from elsewhere or name another folder")
    for what, path in (keep or {}).items():
        real = Path(path).resolve()
        if real_dst == real or _is_within(real, real_dst):
            raise DestinationError(f"{dst}: contains {what} {path}; replacing it would delete it (choose a new or "
                                   "empty folder)")
    if real_dst.exists() and not real_dst.is_dir():
        raise DestinationError(f"{dst}: exists and is not a folder; {tool} writes a folder (remove the file or "
                               "choose another name)")
    existing = next(p for p in real_dst.parents if p.exists())
    if not existing.is_dir():
        raise DestinationError(f"{dst}: cannot write there: {existing} is not a folder")
    return real_dst


def check_destination(src: Path, dst: Path, force: bool, sources: Iterable[Path] = ()) -> Path:
    """Refuse a DST whose replacement would lose data or that cannot be a folder; return its real path.

    Paths are compared after resolving symlinks, so a link to SRC's parent is refused like the
    parent itself; ``sources``: SRC's files, each resolved too (a shard that is a symlink into DST, as in a
    Hugging Face cache's snapshot -> blobs layout, would be deleted with DST). A non-empty DST needs ``force``
    (``FileExistsError`` otherwise).
    """
    real_src, real_dst = src.resolve(), dst.resolve()
    if real_dst == real_src:
        raise DestinationError(f"{dst}: is the source folder; choose another destination")
    if _is_within(real_src, real_dst):
        raise DestinationError(f"{dst}: contains the source {src}; replacing it would delete the source "
                               "(choose a new or empty folder)")
    if _is_within(real_dst, real_src):
        raise DestinationError(f"{dst}: is inside the source {src}; choose a folder outside it")
    check_output_folder(dst, "qerl-quantize", {f"the target of the source's link {f}:": f.resolve()
                                               for f in sources if f.is_symlink()})
    if real_dst.is_dir() and any(real_dst.iterdir()) and not force:
        raise FileExistsError(f"{dst}: exists and is not empty (pass --force to replace it)")
    return real_dst


def make_temp_folder(dst: Path, shown: Path, tag: str = "tmp") -> tuple[Path, list[Path]]:
    """DST's missing parents and the hidden temporary folder beside DST (``.<name>.<tag>-*``), created before any
    weight is read (the one test of writability that also holds for root). Returns the folder and the parents
    made (:func:`remove_made` takes them back on failure)."""
    made: list[Path] = []
    try:
        for parent in reversed(dst.parents):
            if not parent.exists():
                where = parent.parent
                parent.mkdir()
                made.append(parent)
        where = dst.parent
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.{tag}-", dir=dst.parent))
    except OSError as err:
        remove_made(made)
        raise DestinationError(f"{shown}: cannot write into {where}: {err.strerror or err}") from err
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; give the result the permissions a mkdir would
    return tmp, made


def remove_made(made: list[Path]) -> None:
    for parent in reversed(made):
        with contextlib.suppress(OSError):
            parent.rmdir()


@contextlib.contextmanager
def _signals_deferred(written: list[Path] | None = None) -> Iterator[None]:
    """SIGINT and SIGTERM that arrive inside the block are delivered when it ends.

    Swapping DST for the finished output is two renames (and the old folder's removal): cut off
    between them, DST would be left renamed away. Python handlers run in the main thread only, so
    elsewhere the block runs unprotected. When the block put a folder into ``written`` (the swap
    happened), the exception a delivered signal raises carries it as :data:`OUTPUT_WRITTEN_ATTR`, so
    the caller can say that DST was written rather than that nothing changed.
    """
    signums = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in signums}
    if threading.current_thread() is not threading.main_thread() or None in previous.values():
        yield
        return
    pending: list[int] = []
    for s in signums:
        signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        try:
            for s in dict.fromkeys(pending):
                signal.raise_signal(s)
        except BaseException as err:
            if written:
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(err, OUTPUT_WRITTEN_ATTR, written[-1])
            raise


def replace_dir(tmp: Path, dst: Path, force: bool) -> None:
    """Move the finished folder ``tmp`` to ``dst``: an empty or missing ``dst`` is simply taken; an
    existing one only with ``force``, renamed aside first and put back if the move fails, so ``dst``
    always holds either the old content or the complete new one. SIGINT/SIGTERM wait until the swap is done;
    raised then, their exception carries ``dst`` as :data:`OUTPUT_WRITTEN_ATTR` (DST already holds the new output)."""
    written: list[Path] = []
    with _signals_deferred(written):
        if dst.is_dir() and not any(dst.iterdir()):
            dst.rmdir()
        if not dst.exists():
            tmp.rename(dst)
            written.append(dst)
            return
        if not force:
            raise FileExistsError(f"{dst}: exists and is not empty (pass --force to replace it)")
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        dst.rename(old)
        try:
            tmp.rename(dst)
        except BaseException:
            old.rename(dst)
            raise
        written.append(dst)
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()


def quantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    ignore: Iterable[str] = (),
    force: bool = False,
    progress: Callable[[Iterable, int, str], Iterable] | None = None,
    scale_rule: str | None = None,
    device: str | torch.device = "cpu",
) -> ConversionReport:
    """Write an NVFP4A16 compressed-tensors checkpoint of the BF16 checkpoint at ``src`` to ``dst``.

    ``ignore``: extra module patterns (exact names, dotted suffixes or ``re:<regex>``) kept in BF16,
    on top of :data:`DEFAULT_IGNORE`. ``progress(iterable, total, desc)`` wraps the loops (tqdm).
    ``scale_rule``: how scales are computed (``verl_qerl.nvfp4.SCALE_RULES``); recorded in config.json. None: the
    ``scale_rule`` ``src``'s qerl_nvfp4 quantize-at-load block declares (what vLLM and ``load_nvfp4_model`` use for
    that folder), else :data:`DEFAULT_SCALE_RULE`; a rule that differs from a declared one is refused.
    ``device``: where the weights are quantized (e.g. ``cuda``: the same bytes, minutes faster at 7B); the
    files are written from the CPU.
    """
    if scale_rule is not None:
        check_scale_rule(scale_rule, "scale_rule")
    try:
        device = torch.device(device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:
        raise CheckpointError(f"device={str(device)!r}: cannot place tensors there ({exc})") from exc
    src, shown = Path(src).expanduser(), Path(dst).expanduser()
    wrap = progress or (lambda it, total, desc: it)
    ignore = check_patterns(ignore, "ignore")
    reader = CheckpointReader(src)  # config.json and shard headers only
    if reader.format != FORMAT_BF16:
        raise CheckpointError(f"{src}: is already quantized ({reader.format}); nothing to convert")
    dst = check_destination(src, shown, force, sources=sorted(src.iterdir()))
    declared_ignore, declared_targets = quantize_at_load_layers(reader.quant_config)
    where = f"{src / 'config.json'}: quantization_config"
    declared_ignore = None if declared_ignore is None else check_patterns(declared_ignore, f"{where}.ignore")
    declared_targets = None if declared_targets is None else check_patterns(declared_targets, f"{where}.targets")
    declared_rule = declared_scale_rule(reader.quant_config)
    if scale_rule is not None and declared_rule is not None and scale_rule != declared_rule:
        raise CheckpointError(f"{where}.scale_rule={declared_rule!r} but scale_rule={scale_rule!r} (--scale-rule) was "
                              f"asked for: vLLM and load_nvfp4_model quantize this folder with {declared_rule!r}, so "
                              "the output would differ from theirs; leave --scale-rule out or pass "
                              f"--scale-rule {declared_rule}")
    scale_rule = scale_rule or declared_rule or DEFAULT_SCALE_RULE
    patterns = list(dict.fromkeys([*DEFAULT_IGNORE, *(declared_ignore or ()), *ignore]))
    shapes = linear_module_shapes(reader.config)
    linear = list(shapes)
    check_ignore(linear, patterns, "ignore", must_match=ignore)
    wanted = [m for m in linear if not matches_pattern(m, patterns)
              and (declared_targets is None or matches_pattern(m, declared_targets))]
    targets = [m for m in wanted if f"{m}.weight" in reader]
    missing = [m for m in wanted if f"{m}.weight" not in reader]
    # (a tied lm_head has no weight of its own, but lm_head is always in the ignore list, so it is never `wanted`: a
    # tie_word_embeddings checkpoint gets no exemption here, or a bare-decoder save would convert with 0 layers)
    if missing:
        raise CheckpointError(f"{src}: Linear weight(s) missing from the checkpoint: "
                              f"{', '.join(m + '.weight' for m in missing[:5])}")
    for m in targets:  # headers only: a weight the architecture would not load is refused before any is read
        got = tuple(reader.metadata(f"{m}.weight")[1])
        if got != shapes[m]:
            raise CheckpointError(f"{src}: tensor {m}.weight is {list(got)} but config.json's architecture has "
                                  f"{list(shapes[m])} (out_features, in_features): a config.json of another model "
                                  "size, or a transposed weight?")

    tmp, made = make_temp_folder(dst, shown)
    umask = os.umask(0)
    os.umask(umask)
    report = ConversionReport(src=src, dst=dst, scale_rule=scale_rule)  # DST's absolute real path, as printed
    target_set = set(targets)
    try:
        # Pass 1: per-group global scale, from the largest amax of the group's parts.
        group_amax: dict[str, torch.Tensor] = {}
        for module in wrap(targets, len(targets), "scan amax"):
            amax = checked_amax(reader.get(f"{module}.weight").to(device), f"{module}.weight").cpu()
            key = fused_group(module)
            group_amax[key] = amax if key not in group_amax else torch.maximum(group_amax[key], amax)
        group_scale = {key: global_scale_from_amax(amax, scale_rule) for key, amax in group_amax.items()}

        weight_map: dict[str, str] = {}
        total = len(reader.names())
        for shard in reader.shards:
            out: dict[str, torch.Tensor] = {}
            names = reader.shard_names(shard)
            for name, tensor in wrap(reader.iter_shard(shard), len(names), f"quantize {shard}"):
                report.bytes_in += tensor.numel() * tensor.element_size()
                module = name.removesuffix(".weight")
                if name.endswith(".weight") and module in target_set:
                    q = quantize(tensor.to(device), group_scale[fused_group(module)], name=name,
                                 rule=scale_rule).to("cpu")
                    out.update(ct_tensors(module, q))
                    report.quantized.append(module)
                else:
                    out[name] = tensor.contiguous()
                    report.kept.append(name)
            write_safetensors(out, tmp / shard)
            os.chmod(tmp / shard, 0o666 & ~umask)
            report.bytes_out += sum(t.numel() * t.element_size() for t in out.values())
            weight_map.update({n: shard for n in out})
            del out
        if len(report.quantized) + len(report.kept) != total:  # (the reader checked the index against the shards)
            raise CheckpointError(f"{src}: read {len(report.quantized) + len(report.kept)} tensors of {total} listed")
        if len(reader.shards) > 1:
            index = {"metadata": {"total_size": report.bytes_out}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = dict(reader.config)
        config.pop("compression_config", None)
        # every Linear left dense, by its full name: compressed-tensors, vLLM's stock loader and transformers
        # match ignore entries exactly (or as re:), so a bare suffix such as "down_proj" matched no layer there
        # and they read the BF16 down_proj as NVFP4 (transformers left it random); our readers take names too
        config["quantization_config"] = ct_quantization_config(m for m in linear if m not in target_set)
        config[SCALE_RULE_KEY] = scale_rule
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for path in sorted(src.iterdir()):
            if (path.is_file() and path.name != "config.json" and path.name not in TOOL_MARKERS
                    and not path.name.endswith(WEIGHT_FILE_SUFFIXES)):
                shutil.copy2(path, tmp / path.name)
        replace_dir(tmp, dst, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_made(made)
        raise
    return report
