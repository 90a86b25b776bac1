"""The ``qerl_sync`` trainer mode: verl's synchronous PPO trainer plus the per-step AQN hook.

Before each step's rollout, every vLLM server's workers write ``clean + noise(sigma_step)`` into their
RMSNorm weights (through the worker extension, in place so CUDA graphs stay valid) and the prefix
cache is cleared (cached KV was computed under the previous noise). Validation runs on the clean
policy: noise is removed before it and put back after. ``qerl/aqn_sigma`` and ``qerl/aqn_stage`` are
logged with the step metrics.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from ..aqn import aqn_metrics, short_run, sigma_at, stage_of
from .config import TRAINER_MODE, QeRLConfig, read_qerl

logger = logging.getLogger("verl_qerl")

#: Worker-extension methods (verl_qerl.vllm.worker_extension) called through ``collective_rpc``.
RPC_SETUP = "qerl_aqn_setup"
RPC_APPLY = "qerl_aqn_apply"
RPC_RESTORE = "qerl_aqn_restore"


class AQNDriver:
    """Decides the sigma of each step and pushes it to the rollout servers; framework glue kept thin."""

    def __init__(self, qerl: QeRLConfig, total_steps: int, servers_fn) -> None:
        self.qerl = qerl
        self.cfg = qerl.aqn
        # qerl.aqn.total_steps, where the user set it, spans the schedule; else the trainer's run length
        self.total_steps = int(self.cfg.total_steps if self.cfg.total_steps is not None else total_steps)
        self._servers_fn = servers_fn
        self.current: tuple[int, float] | None = None
        self._ready = False
        if self.cfg.enable:
            self.cfg.validate(self.total_steps)
            short = short_run(self.total_steps, self.cfg)
            if short:  # a fixed trainer.total_training_steps this short is refused by apply_qerl already
                logger.warning(
                    "[verl-qerl] AQN: the run has %d training steps, fewer than qerl.aqn.num_stages=%d: %s. Set "
                    "trainer.total_training_steps >= %d (or more data / epochs), lower qerl.aqn.num_stages, or turn "
                    "AQN off (qerl.aqn.enable=false)", self.total_steps, self.cfg.num_stages, short,
                    self.cfg.num_stages)

    def sigma(self, step: int) -> float:
        return sigma_at(step, self.total_steps, self.cfg) if self.cfg.enable else 0.0

    def _call_all(self, method: str, **kwargs: Any) -> None:
        import ray

        servers = self._servers_fn()
        if not servers:
            raise RuntimeError(f"[verl-qerl] AQN {method}: the trainer has no vLLM rollout server (its "
                               "llm_server_manager.rollout_replicas is empty or missing), so the noise would reach "
                               "no rollout; is the rollout a vLLM server of this verl version?")
        if not self._ready:  # pick the targeted norms and snapshot their clean values, once
            setup = {"seed": int(self.cfg.seed), "targets": list(self.cfg.targets),
                     "include_final_norm": bool(self.cfg.include_final_norm), "rounding": self.cfg.rounding}
            ray.get([s.collective_rpc.remote(RPC_SETUP, kwargs=setup) for s in servers])
            self._ready = True
        ray.get([s.collective_rpc.remote(method, kwargs=kwargs) for s in servers])
        ray.get([s.clear_kv_cache.remote() for s in servers])

    def apply(self, step: int) -> dict[str, float]:
        """Noise for ``step`` on every server; returns the metrics to log."""
        if not self.cfg.enable:
            return {}
        sigma = self.sigma(step)
        if sigma > 0:
            self._call_all(RPC_APPLY, step=int(step), sigma=float(sigma), seed=int(self.cfg.seed))
        elif self.current is not None and self.current[1] > 0:
            self._call_all(RPC_RESTORE)
        self.current = (step, sigma)
        return aqn_metrics(step, self.total_steps, self.cfg)

    def clean(self) -> None:
        """Remove the noise (validation runs on the clean policy)."""
        if self.cfg.enable and self.current is not None and self.current[1] > 0:
            self._call_all(RPC_RESTORE)

    def restore_current(self) -> None:
        if self.cfg.enable and self.current is not None and self.current[1] > 0:
            step, sigma = self.current
            self._call_all(RPC_APPLY, step=int(step), sigma=float(sigma), seed=int(self.cfg.seed))

    def describe(self) -> str:
        if not self.cfg.enable:
            return "AQN off"
        edges = [(s, stage_of(s, self.total_steps, self.cfg.num_stages)) for s in (1, self.total_steps)]
        return (f"AQN {self.cfg.schedule} sigma {self.cfg.sigma_start:g}->{self.cfg.sigma_end:g} over "
                f"{self.cfg.num_stages} stages of {self.total_steps} steps (stages {edges[0][1]}..{edges[1][1]})")


def register_trainer(trainer_sync: ModuleType) -> None:
    """Define and register ``qerl_sync`` once verl's ``trainer_sync`` module exists (post-import hook)."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    from verl.trainer.ppo.v1.trainer_base import register_trainer as verl_register

    if TRAINER_MODE in TRAINER_REGISTRY:
        return
    base = trainer_sync.PPOTrainerSync

    class QeRLSyncTrainer(base):
        """verl's sync trainer with QeRL's AQN hook (see module docstring)."""

        # verl 0.9.1 picks sync-vs-async behaviour (replay buffer, refill, checkpointing) by comparing
        # ``self.trainer_mode`` with the literal "sync"; this mode must behave as "sync" everywhere.
        @property
        def trainer_mode(self) -> str:
            return "sync"

        @trainer_mode.setter
        def trainer_mode(self, value: str) -> None:  # verl assigns the configured name in __init__
            return None

        def _qerl_driver(self) -> AQNDriver | None:
            driver = getattr(self, "_qerl_aqn", None)
            if driver is None:
                qerl = read_qerl(self.config)
                if qerl is None:
                    return None

                def servers():
                    manager = getattr(self, "llm_server_manager", None)
                    replicas = getattr(manager, "rollout_replicas", None) or []
                    return [srv for rep in replicas for srv in rep.servers]

                driver = AQNDriver(qerl, self.total_training_steps, servers)
                self._qerl_aqn = driver
                logger.warning("[verl-qerl] trainer %s: %s", TRAINER_MODE, driver.describe())
            return driver

        def _build_replay_buffer(self):
            """verl's buffer, polled every ``qerl.replay_poll_s`` instead of its fixed 2 s (see QeRLConfig)."""
            buffer = super()._build_replay_buffer()
            qerl = read_qerl(self.config)
            if qerl is not None and hasattr(buffer, "poll_interval"):
                buffer.poll_interval = float(qerl.replay_poll_s)
            return buffer

        def on_init_end(self):
            super().on_init_end()
            self._qerl_driver()

        def on_step_begin(self):
            super().on_step_begin()
            driver = self._qerl_driver()
            if driver is not None:
                metrics = driver.apply(self.global_steps)
                pending = getattr(self, "_pending_sync_metrics", None) or {}
                self._pending_sync_metrics = {**pending, **metrics}

        def on_validate_begin(self):
            super().on_validate_begin()
            driver = self._qerl_driver()
            if driver is not None:
                driver.clean()

        def on_validate_end(self):
            super().on_validate_end()
            driver = self._qerl_driver()
            if driver is not None:
                driver.restore_current()

    QeRLSyncTrainer.__module__ = __name__
    verl_register(TRAINER_MODE)(QeRLSyncTrainer)
