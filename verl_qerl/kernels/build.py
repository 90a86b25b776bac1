"""Building and loading the CUDA extension (``cuda/`` sources).

Two routes, one set of sources:

* ahead of time: ``setup.py`` adds :func:`cuda_extension` (a ``CUDAExtension`` named
  ``verl_qerl._C``) when a CUDA torch and ``nvcc`` are present;
* just in time: :func:`load` builds the same sources with ninja on first use through
  ``torch.utils.cpp_extension.load`` and caches the result (``TORCH_EXTENSIONS_DIR``, else
  ``~/.cache/torch_extensions``); torch rebuilds only when a source changes.

Loading the library registers the CUDA kernels of the ``qerl::*`` ops (``TORCH_LIBRARY_IMPL`` in
``cuda/qerl_torch.cpp``); the schemas, CPU fallbacks and fake impls live in Python (``ops.py``), so
nothing here runs at import and a machine without CUDA never compiles anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

#: Kernel sources, torch-free (compiled alone by .ci/compile_cuda.sh).
CU_SOURCES = (
    "nvfp4_gemm.cu",
    "nvfp4_gemm_streamk.cu",
    "nvfp4_gemm_wgmma.cu",
    "nvfp4_gemm_wgmma_ss.cu",
    "nvfp4_gemm_wgmma_wide.cu",
    "nvfp4_gemm_decode_tma.cu",
    "nvfp4_dequant.cu",
)
#: The thin torch binding: the ops and their registration, and the GEMM dispatch they run.
CPP_SOURCES = ("qerl_torch.cpp", "gemm_route.cpp")
JIT_NAME = "qerl_nvfp4_jit"
# No -std flag: torch's cpp_extension picks the C++ standard its own headers need.
NVCC_FLAGS = ("-O3", "--expt-relaxed-constexpr", "-lineinfo")
CXX_FLAGS = ("-O3",)


class SettingError(ValueError):
    """An environment setting of the kernels that is neither unset nor a value they take; the message names it."""


#: Values of a boolean switch (:func:`env_flag`), after strip() and lower().
_FLAG_VALUES = {"0": False, "false": False, "no": False, "off": False, "1": True, "true": True, "yes": True, "on": True}


def env_flag(name: str, default: bool = False) -> bool:
    """``$name`` as an on/off switch: ``1`` / ``true`` / ``yes`` / ``on`` or ``0`` / ``false`` / ``no`` / ``off`` (any
    case, surrounding spaces ignored); unset or empty: ``default``. Anything else raises ``ValueError`` naming the
    variable, because reading every value but ``"0"`` as on turned ``false``, ``off`` or ``" 0"`` into *on*."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value not in _FLAG_VALUES:
        raise SettingError(f"{name}={raw!r} is not a switch value; expected 1 / true / yes / on or "
                           "0 / false / no / off (or unset)")
    return _FLAG_VALUES[value]


#: Macro telling the host side of the wgmma kernels (cuda/nvfp4_gemm_wgmma*.cu) that they were compiled for sm_90a.
SM90A_DEFINE = "-DQERL_HAVE_SM90A=1"


def arch_flags(capabilities: list[tuple[int, int]], arch_list: str | None) -> list[str]:
    """nvcc target flags for the JIT build, or [] to let torch choose (``TORCH_CUDA_ARCH_LIST`` set).

    Why not torch's default: for an sm_90 GPU torch targets plain sm_90, which has no ``wgmma``; the Hopper
    GEMM needs the architecture-specific sm_90a target (code that runs on sm_90 devices only). So each
    visible device's capability becomes one ``-gencode`` (9.0 -> compute_90a / sm_90a) and, when sm_90a is
    among them, :data:`SM90A_DEFINE` enables the wgmma launcher. An explicit ``TORCH_CUDA_ARCH_LIST`` wins
    (with ``9.0a`` in it the define is added too; ``9.0a+PTX``, sm_90a plus its PTX to torch, counts as ``9.0a``).
    """
    if arch_list:
        archs = [a.removesuffix("+PTX") for a in arch_list.replace(" ", ";").split(";")]  # torch's own split
        return [SM90A_DEFINE] if "9.0a" in archs else []
    flags: list[str] = []
    for major, minor in sorted(set(capabilities)):
        num = f"{major}{minor}"
        if (major, minor) == (9, 0):
            flags += ["-gencode=arch=compute_90a,code=sm_90a", SM90A_DEFINE]
        else:
            flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return flags


#: Environment variable naming the folder of the ``.cu``/``.cpp`` sources (overrides the search in :func:`source_dir`).
SRC_ENV = "VERL_QERL_CUDA_SRC"


def source_dir() -> Path:
    """Where the ``.cu``/``.cpp`` sources are: ``$VERL_QERL_CUDA_SRC``, the package's ``csrc``
    (a wheel that ships them) or the repository's ``cuda/`` (a source checkout / editable install).

    A ``$VERL_QERL_CUDA_SRC`` without the sources raises ``FileNotFoundError`` naming the variable and the folder:
    falling through to another folder would build (and parse the mode table of) sources the user did not choose."""
    env = os.environ.get(SRC_ENV, "")
    if env:
        if not (Path(env) / CU_SOURCES[0]).is_file():
            raise FileNotFoundError(f"{SRC_ENV}={env!r}: the folder {Path(env)} holds no CUDA sources "
                                    f"({CU_SOURCES[0]} missing); point it at the repository's cuda/ folder or unset it")
        return Path(env)
    here = Path(__file__).resolve().parent
    candidates = [here / "csrc", here.parent.parent / "cuda"]
    for c in candidates:
        if (c / CU_SOURCES[0]).is_file():
            return c
    raise FileNotFoundError(
        "verl_qerl.kernels: CUDA sources not found (looked in "
        + ", ".join(str(c) for c in candidates)
        + "); set VERL_QERL_CUDA_SRC to the repository's cuda/ folder"
    )


def sources(root: Path | None = None) -> list[str]:
    """Absolute paths of all sources of the extension."""
    root = root or source_dir()
    return [str(root / s) for s in CPP_SOURCES + CU_SOURCES]


def cuda_extension(name: str = "verl_qerl._C", root: str | os.PathLike[str] | None = None) -> Any:
    """A ``torch.utils.cpp_extension.CUDAExtension`` for ``setup.py`` (ahead-of-time build).

    ``root`` is the folder holding the sources; paths are made relative to the current directory
    when possible, because setuptools wants relative source paths.
    """
    from torch.utils.cpp_extension import CUDAExtension

    src_root = Path(root) if root is not None else source_dir()
    srcs = []
    for s in sources(src_root):
        try:
            srcs.append(os.path.relpath(s))
        except ValueError:
            srcs.append(s)
    nvcc = list(NVCC_FLAGS) + arch_flags([], os.environ.get("TORCH_CUDA_ARCH_LIST"))
    return CUDAExtension(
        name=name,
        sources=srcs,
        extra_compile_args={"cxx": list(CXX_FLAGS), "nvcc": nvcc},
    )


def setup_ext_modules() -> tuple[list[Any], dict[str, Any]]:
    """``(ext_modules, cmdclass)`` for ``setup.py``: the CUDA extension when a CUDA build of torch and
    ``nvcc`` (``CUDA_HOME``) are present, else ``([], {})`` (pure-Python install; JIT on first use).

    Set ``VERL_QERL_NO_CUDA_BUILD=1`` (a switch, :func:`env_flag`) to skip the ahead-of-time build;
    ``TORCH_CUDA_ARCH_LIST`` (e.g. ``"8.0;8.9;9.0"``) picks the architectures, as for any torch extension.
    """
    if env_flag("VERL_QERL_NO_CUDA_BUILD"):
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension
    except ImportError:
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        return [], {}
    return [cuda_extension()], {"build_ext": BuildExtension}


#: Macro compiling the per-CTA phase stamps into the wgmma kernels (cuda/anatomy_stamps.cuh); a timing build only.
ANATOMY_DEFINE = "-DQERL_ANATOMY_STAMPS=1"


def anatomy_build() -> bool:
    """Whether ``QERL_ANATOMY_STAMPS=1`` asks for the stamped timing build (benchmarks/kernel_anatomy.py --stamps):
    JIT-built under its own name, never the ahead-of-time module, so it cannot replace the measured kernels."""
    return env_flag("QERL_ANATOMY_STAMPS")


def load(verbose: bool = False) -> ModuleType:
    """Import the ahead-of-time build if there is one, else JIT-build with ninja and load."""
    anatomy = anatomy_build()
    if not anatomy:
        try:
            from verl_qerl import _C  # type: ignore[attr-defined]

            return _C
        except ImportError:
            pass
    import torch
    from torch.utils.cpp_extension import load as _load

    caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    extra_cuda = list(NVCC_FLAGS) + arch_flags(caps, os.environ.get("TORCH_CUDA_ARCH_LIST"))
    defines = [ANATOMY_DEFINE] if anatomy else []
    return _load(
        name=JIT_NAME + ("_anatomy" if anatomy else ""),
        sources=sources(),
        extra_cflags=list(CXX_FLAGS) + defines,
        extra_cuda_cflags=extra_cuda + defines,
        verbose=verbose,
        is_python_module=True,
    )
