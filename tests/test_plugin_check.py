"""``+qerl=...`` in a verl process without the verl plugin is refused at composition, with the reason; the ``qerl``
config group composes from any working directory, editable install included (hydra's namespace scan misses it there:
the verl plugin registers the search path by hand)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from verl_qerl.verl import plugin_check
from verl_qerl.verl.plugin_check import QeRLPluginNotLoaded, check_command_line, qerl_group_override

REPO = Path(__file__).resolve().parents[1]


def test_the_group_override_is_recognised():
    assert qerl_group_override(["a=1", "+qerl=nvfp4"]) == "+qerl=nvfp4"
    assert qerl_group_override(["++qerl=bf16"]) == "++qerl=bf16"
    assert qerl_group_override(["qerl=nf4"]) == "qerl=nf4"
    assert qerl_group_override(["+qerl.aqn.enable=false", "qerl_x=1", "trainer.qerl=1"]) is None


@pytest.fixture
def verl_without_plugin(monkeypatch):
    """A process where verl is imported and the plugin module is not (or not active)."""
    monkeypatch.setitem(sys.modules, "verl", types.ModuleType("verl"))
    monkeypatch.delitem(sys.modules, plugin_check.PLUGIN_MODULE, raising=False)
    monkeypatch.delenv("VERL_USE_EXTERNAL_PLUGINS", raising=False)
    return monkeypatch


def test_excluded_by_the_policy_is_refused_with_the_fix(verl_without_plugin):
    verl_without_plugin.setenv("VERL_USE_EXTERNAL_PLUGINS", "none")
    with pytest.raises(QeRLPluginNotLoaded, match=r"\+qerl=nvfp4 is set, but verl did not load the verl-qerl plugin.*"
                       r"VERL_USE_EXTERNAL_PLUGINS='none' excludes it"):
        check_command_line(["+qerl=nvfp4"])
    verl_without_plugin.setenv("VERL_USE_EXTERNAL_PLUGINS", "other,plugins")
    with pytest.raises(QeRLPluginNotLoaded, match=r"add 'qerl' to the list"):
        check_command_line(["+qerl=bf16"])


def test_a_failing_plugin_import_is_shown(verl_without_plugin):
    def failing_import(name, *args, **kwargs):
        assert name == plugin_check.PLUGIN_MODULE
        raise ImportError("libfoo.so: cannot open shared object file")

    verl_without_plugin.setattr(plugin_check.importlib, "import_module", failing_import)
    with pytest.raises(QeRLPluginNotLoaded, match=r"importing verl_qerl.verl.plugin fails: ImportError: libfoo.so"):
        check_command_line(["+qerl=nvfp4"])


def test_nothing_to_refuse(verl_without_plugin):
    check_command_line(["trainer.total_epochs=1"])  # no qerl group
    loaded = types.ModuleType(plugin_check.PLUGIN_MODULE)
    loaded._loaded = True
    verl_without_plugin.setitem(sys.modules, plugin_check.PLUGIN_MODULE, loaded)
    check_command_line(["+qerl=nvfp4"])  # the plugin is active
    verl_without_plugin.delitem(sys.modules, plugin_check.PLUGIN_MODULE)
    verl_without_plugin.delitem(sys.modules, "verl")
    check_command_line(["+qerl=nvfp4"])  # not a verl process: another hydra app's business


def _main_ppo_cfg(cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """verl's real entry point, composing only (``--cfg job`` prints the config and exits)."""
    full_env = {**os.environ, "VERL_QERL_QUIET": "1", **env}
    return subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "+qerl=nvfp4", "--cfg", "job"], cwd=cwd,
                          env=full_env, capture_output=True, text=True, timeout=300)


def test_main_ppo_composes_the_group_outside_the_repository(tmp_path):
    """From a folder that is not the repository root (where an editable install's hydra_plugins is invisible to
    hydra's scan) the group still composes: the loaded plugin registered the search path."""
    out = _main_ppo_cfg(tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "qerl:\n  mode: nvfp4\n" in out.stdout


def test_main_ppo_without_the_plugin_stops_before_running():
    out = _main_ppo_cfg(REPO, VERL_USE_EXTERNAL_PLUGINS="none")
    assert out.returncode != 0
    assert "QeRLPluginNotLoaded: +qerl=nvfp4 is set, but verl did not load the verl-qerl plugin" in out.stderr


def test_the_search_path_is_registered_once_where_hydras_scan_finds_it():
    """From the repository folder hydra's own scan finds the plugin; the verl plugin must not add it a second time
    (each registration composes the group's search path and runs the check again)."""
    full_env = {**os.environ, "VERL_QERL_QUIET": "1"}
    out = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "--info", "searchpath"], cwd=REPO,
                         env=full_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("pkg://verl_qerl.verl.hydra") == 1, out.stdout[-3000:]
