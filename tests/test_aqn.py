"""Tests for verl_qerl.aqn: schedule, reproducible noise, non-accumulation, survival in BF16,
and effect on a tiny Qwen2."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_qerl.aqn import (
    AQNConfig,
    AQNConfigError,
    NormNoiser,
    aqn_metrics,
    canonical_name,
    derive_seed,
    land_noise,
    matched_noise_scale,
    noise_for,
    noisy,
    realized_std,
    schedule_table,
    select_norm_tensors,
    sigma_at,
    sr_variance,
    stage_bounds,
    stage_of,
    stage_sigma,
    stochastic_round,
)

REPO = Path(__file__).resolve().parents[1]
NORM = "model.layers.0.input_layernorm.weight"
DEFAULT_SIGMAS = [0.0] + [1e-2 * (5e-4 / 1e-2) ** ((k - 1) / 8) for k in range(1, 10)]


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()


# ------------------------------------------------------------------------------------------
# Schedule
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "stage", "sigma"),
    [
        (0, 0, 0.0),  # verl's initial weight sync, before step 1
        (1, 0, 0.0),
        (60, 0, 0.0),  # last noise-free step
        (61, 1, 1e-2),  # first noisy step: sigma_start
        (120, 1, 1e-2),
        (121, 2, 1e-2 * 0.05 ** (1 / 8)),  # 6.877e-3
        (300, 4, 1e-2 * 0.05 ** (3 / 8)),
        (301, 5, 1e-2 * 0.05 ** (4 / 8)),  # 2.236e-3, half way in log space
        (540, 8, 1e-2 * 0.05 ** (7 / 8)),
        (541, 9, 5e-4),  # last stage reaches sigma_end
        (600, 9, 5e-4),
        (601, 9, 5e-4),  # past T: clamped
        (10**6, 9, 5e-4),
    ],
)
def test_default_schedule_gsm8k_600_steps(step: int, stage: int, sigma: float) -> None:
    cfg = AQNConfig()
    assert stage_of(step, 600, 10) == stage
    assert sigma_at(step, 600, cfg) == pytest.approx(sigma, rel=1e-12, abs=0.0)
    assert aqn_metrics(step, 600, cfg) == {"qerl/aqn_sigma": pytest.approx(sigma, rel=1e-12), "qerl/aqn_stage": stage}


def test_last_stage_is_exactly_sigma_end_not_the_papers_eq8_value() -> None:
    cfg = AQNConfig()
    assert stage_sigma(9, cfg) == 5e-4
    eq8_last = 1e-2 * (5e-4 / 1e-2) ** (8 / 9)  # the paper's (k-1)/(K-1) exponent stops short
    assert eq8_last == pytest.approx(6.98e-4, rel=0.01)
    assert stage_sigma(9, cfg) != pytest.approx(eq8_last, rel=0.01)


def test_released_script_schedule_matches_paper_facts_table() -> None:
    cfg = AQNConfig(sigma_end=1e-4)  # the authors' scripts: 1e-2 -> 1e-4, K = 10
    expected = [1.00e-2, 5.62e-3, 3.16e-3, 1.78e-3, 1.00e-3, 5.62e-4, 3.16e-4, 1.78e-4, 1.00e-4]
    got = [row.sigma for row in schedule_table(600, cfg)]
    assert got[0] == 0.0
    assert got[1:] == pytest.approx(expected, rel=3e-3)


def test_uneven_split_stage_edges() -> None:
    # T = 105, K = 10: stages of 11 and 10 steps alternate, covering 1..105 exactly once.
    table = schedule_table(105, AQNConfig())
    assert [(r.first_step, r.last_step) for r in table[:4]] == [(1, 11), (12, 21), (22, 32), (33, 42)]
    assert table[-1][1:3] == (96, 105)
    sizes = [r.last_step - r.first_step + 1 for r in table]
    assert sum(sizes) == 105 and set(sizes) == {10, 11}
    for step, stage in [(11, 0), (12, 1), (21, 1), (22, 2), (95, 8), (96, 9), (105, 9), (106, 9)]:
        assert stage_of(step, 105, 10) == stage, step


def test_run_shorter_than_stage_count() -> None:
    assert [stage_of(s, 5, 10) for s in range(0, 8)] == [0, 0, 2, 4, 6, 8, 9, 9]
    table = schedule_table(5, AQNConfig())
    empty = [r.stage for r in table if r.first_step > r.last_step]
    assert empty == [1, 3, 5, 7, 9]


def test_other_schedules_and_disable() -> None:
    start, end = 1e-2, 5e-4
    t = [(k - 1) / 8 for k in range(1, 10)]
    lin = AQNConfig(schedule="linear")
    cos = AQNConfig(schedule="cosine")
    const = AQNConfig(schedule="constant")
    assert [stage_sigma(k, lin) for k in range(1, 10)] == pytest.approx([start + (end - start) * x for x in t])
    assert [stage_sigma(k, cos) for k in range(1, 10)] == pytest.approx(
        [end + (start - end) * 0.5 * (1 + math.cos(math.pi * x)) for x in t]
    )
    assert stage_sigma(5, cos) == pytest.approx((start + end) / 2)
    assert [stage_sigma(k, const) for k in range(10)] == [0.0] + [start] * 9
    for cfg in (AQNConfig(schedule="none"), AQNConfig(enable=False)):
        assert [sigma_at(s, 90, cfg) for s in range(0, 200)] == [0.0] * 200
    assert AQNConfig(schedule="linear", sigma_end=0.0).sigma_end == 0.0  # only exponential needs > 0


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"sigma_start": 0.0}, "sigma_start"),
        ({"sigma_start": -1e-2}, "sigma_start"),
        ({"sigma_end": 0.0}, "sigma_end"),
        ({"sigma_end": -5e-4}, "sigma_end"),
        ({"sigma_end": float("nan")}, "sigma_end"),
        ({"sigma_start": float("inf")}, "sigma_start"),
        ({"schedule": "linear", "sigma_end": -1e-3}, "sigma_end"),
        ({"num_stages": 2}, "num_stages"),
        ({"num_stages": 0}, "num_stages"),
        ({"num_stages": 10.0}, "num_stages"),
        ({"total_steps": 0}, "total_steps"),
        ({"total_steps": -600}, "total_steps"),
        ({"schedule": "exp"}, "schedule"),
        ({"schedule": "logarithmic"}, "schedule"),
        ({"apply_to": "actor"}, "apply_to"),
        ({"apply_to": "both"}, "apply_to"),
        ({"rounding": "floor"}, "rounding"),
        ({"targets": ()}, "targets"),
        ({"targets": "input_layernorm"}, "targets"),
        ({"seed": 1.5}, "seed"),
        ({"enable": "yes"}, "enable"),
        ({"sigma_end": 2e-2}, "sigma_end"),
        ({"schedule": "linear", "sigma_start": 1e-3, "sigma_end": 1e-2}, "sigma_end"),
        ({"schedule": "cosine", "sigma_start": 0.0, "sigma_end": 1e-2}, "sigma_end"),
        ({"total_steps": 5}, "total_steps"),
        ({"total_steps": 2, "num_stages": 3}, "total_steps"),
    ],
)
def test_bad_config_rejected_naming_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(AQNConfigError) as err:
        AQNConfig(**kwargs)
    assert str(err.value).startswith(f"{key}:"), str(err.value)


def test_rising_noise_and_too_short_runs_name_both_keys() -> None:
    with pytest.raises(AQNConfigError, match=r"^sigma_end: 0.02 is above sigma_start=0.01"):
        AQNConfig(sigma_end=2e-2)
    with pytest.raises(AQNConfigError, match=r"^total_steps: 5 is fewer than num_stages=10"):
        AQNConfig(total_steps=5)
    # a flat schedule, one that ignores sigma_end, and a run of exactly num_stages steps are fine
    assert AQNConfig(sigma_start=1e-3, sigma_end=1e-3).sigma_end == 1e-3
    assert AQNConfig(schedule="constant", sigma_end=1.0).schedule == "constant"
    assert AQNConfig(schedule="none", sigma_end=1.0).schedule == "none"
    assert AQNConfig(total_steps=10).total_steps == 10
    assert AQNConfig(enable=False, total_steps=1).total_steps == 1


def test_bad_runtime_arguments_rejected_naming_the_key() -> None:
    cfg = AQNConfig()
    cases = [
        (lambda: sigma_at(5, 0, cfg), "total_steps"),
        (lambda: sigma_at(5, None, cfg), "total_steps"),  # neither given nor configured
        (lambda: cfg.validate(total_steps=-1), "total_steps"),
        (lambda: sigma_at(-1, 600, cfg), "step"),
        (lambda: sigma_at(1.5, 600, cfg), "step"),
        (lambda: stage_sigma(10, cfg), "stage"),
        (lambda: AQNConfig.from_dict({"sigma_strat": 1e-2}), "sigma_strat"),
        (lambda: NormNoiser({NORM: torch.ones(4)}).apply(1, -1e-3), "sigma"),
        (lambda: NormNoiser({NORM: torch.ones(4)}).apply(-1, 1e-3), "step"),
        (lambda: NormNoiser({NORM: torch.ones(4)}, rounding="up"), "rounding"),
    ]
    for call, key in cases:
        with pytest.raises(AQNConfigError) as err:
            call()
        assert str(err.value).startswith(f"{key}:"), str(err.value)
    # total_steps from the config when the caller passes None
    assert sigma_at(61, None, AQNConfig(total_steps=600)) == 1e-2


def test_from_dict_round_trip() -> None:
    cfg = AQNConfig.from_dict({"sigma_end": 1e-4, "targets": ["input_layernorm"], "apply_to": "rollout"})
    assert cfg.targets == ("input_layernorm",) and cfg.apply_to == "rollout"
    assert AQNConfig.from_dict(cfg.to_dict()) == cfg


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 1500), stages=st.integers(3, 40))
def test_stages_partition_the_run(total: int, stages: int) -> None:
    covered = []
    for k in range(stages):
        first, last = stage_bounds(k, total, stages)
        covered.extend(range(first, last + 1))
        for step in range(first, last + 1):
            assert stage_of(step, total, stages) == k
    assert covered == list(range(1, total + 1))  # every step once, in order
    sizes = [last - first + 1 for first, last in (stage_bounds(k, total, stages) for k in range(stages))]
    if total >= stages:
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert stage_of(0, total, stages) == 0
    assert stage_of(total + 1, total, stages) == stage_of(10 * total, total, stages) == stages - 1


@settings(max_examples=100, deadline=None)
@given(
    start=st.floats(1e-6, 1.0),
    end=st.floats(1e-6, 1.0),
    stages=st.integers(3, 30),
    schedule=st.sampled_from(["exponential", "linear", "cosine"]),
)
def test_schedule_shape_properties(start: float, end: float, stages: int, schedule: str) -> None:
    start, end = max(start, end), min(start, end)  # noise never rises: sigma_end > sigma_start is refused
    cfg = AQNConfig(sigma_start=start, sigma_end=end, num_stages=stages, schedule=schedule)
    sig = [stage_sigma(k, cfg) for k in range(stages)]
    assert sig[0] == 0.0
    assert sig[1] == pytest.approx(start, rel=1e-12) and sig[-1] == end
    lo, hi = min(start, end), max(start, end)
    assert all(lo * (1 - 1e-12) <= s <= hi * (1 + 1e-12) for s in sig[1:])
    steps = [b - a for a, b in zip(sig[1:], sig[2:])]
    assert all(d <= hi * 1e-12 for d in steps)
    if schedule == "exponential" and stages > 3:
        ratios = [b / a for a, b in zip(sig[1:], sig[2:])]
        assert ratios == pytest.approx([ratios[0]] * len(ratios), rel=1e-9)


# ------------------------------------------------------------------------------------------
# Names
# ------------------------------------------------------------------------------------------


def test_select_norm_tensors_across_wrappers() -> None:
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.11.post_attention_layernorm.weight",
        "model.norm.weight",
        "base_model.model.model.layers.3.input_layernorm.weight",
        "_fsdp_wrapped_module.model.layers.4._fsdp_wrapped_module.post_attention_layernorm.weight",
        "model.layers.5.input_layernorm.bias",
    ]
    picked = select_norm_tensors(names, AQNConfig())
    assert picked == [names[1], names[2], names[5], names[7], names[8]]
    with_final = select_norm_tensors([(n, None) for n in names], AQNConfig(include_final_norm=True))
    assert with_final == [names[1], names[2], names[5], names[6], names[7], names[8]]
    assert select_norm_tensors(names, AQNConfig(targets=("input_layernorm",))) == [names[1], names[7]]
    assert canonical_name(names[7]) == "model.layers.3.input_layernorm.weight"
    assert canonical_name(names[8]) == "model.layers.4.post_attention_layernorm.weight"
    assert canonical_name("module.base_model.model.model.norm.weight") == "model.norm.weight"


# ------------------------------------------------------------------------------------------
# Noise: reproducible, keyed by (seed, step, name)
# ------------------------------------------------------------------------------------------


def test_noise_for_is_keyed_by_seed_step_and_name() -> None:
    z = noise_for(NORM, (100_000,), 1e-3, seed=0, step=7)
    assert z.dtype == torch.float32 and z.shape == (100_000,) and z.device.type == "cpu"
    assert float(z.double().std()) == pytest.approx(1e-3, rel=0.01)
    assert abs(float(z.double().mean())) < 4e-3 / math.sqrt(100_000)
    assert torch.equal(z, noise_for(NORM, (100_000,), 1e-3, seed=0, step=7))
    assert torch.equal(z, noise_for("base_model.model." + NORM, torch.Size([100_000]), 1e-3, 0, 7))
    for other in (
        noise_for(NORM, (100_000,), 1e-3, seed=0, step=8),
        noise_for(NORM, (100_000,), 1e-3, seed=1, step=7),
        noise_for(NORM.replace("layers.0", "layers.1"), (100_000,), 1e-3, seed=0, step=7),
    ):
        assert abs(float(torch.corrcoef(torch.stack([z, other]))[0, 1])) < 0.02
    assert torch.allclose(noise_for(NORM, (64,), 2e-3, 0, 7), 2 * noise_for(NORM, (64,), 1e-3, 0, 7), rtol=1e-6)
    # Pinned: changing the seed derivation silently changes the noise of resumed runs.
    assert derive_seed(0, 1, NORM) == derive_seed(0, 1, "_fsdp_wrapped_module." + NORM) == 7577537829925496238


def _bf16_weights(n: int, seed: int = 0) -> torch.Tensor:
    """RMSNorm-like gains: log-uniform in [0.05, 5], stored in BF16."""
    g = torch.Generator().manual_seed(seed)
    log_w = torch.empty(n, dtype=torch.float64).uniform_(math.log(0.05), math.log(5.0), generator=g)
    return torch.exp(log_w).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------
# Two separate processes: the same noise as here
# ------------------------------------------------------------------------------------------

_WORKER_SRC = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import torch
    from verl_qerl.aqn import NormNoiser, noise_for

    def digest(t):
        return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()

    rank = int(os.environ["RANK"])
    out = {"pid": os.getpid()}
    out["noise"] = {f"{n}|{s}": digest(noise_for(n, (4096,), 5e-4, 0, s)) for n, s in json.loads(sys.argv[2])}
    weights = torch.load(sys.argv[3])
    noiser = NormNoiser({f"model.layers.{i}.input_layernorm.weight": w for i, w in enumerate(weights)})
    noiser.apply(9, 5e-4)
    out["bf16_checksum"] = noiser.checksum()
    with open(sys.argv[1] + f".{rank}.json", "w") as f:
        json.dump(out, f)
    """
)

_KEYS = [(NORM, 1), (NORM, 2), ("model.layers.7.post_attention_layernorm.weight", 1)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[torch.Tensor]]:
    """Run the worker as 2 separate processes; return their JSON and the inputs."""
    tmp = tmp_path_factory.mktemp("aqn_ranks")
    weights = [_bf16_weights(2048, seed=s) for s in (1, 2)]
    torch.save(weights, tmp / "w.pt")
    script = tmp / "worker.py"
    script.write_text(_WORKER_SRC)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    args = [sys.executable, str(script), str(tmp / "out"), json.dumps(_KEYS), str(tmp / "w.pt")]
    procs = [subprocess.Popen(args, env=dict(env, RANK=str(r)), stderr=subprocess.PIPE) for r in range(2)]
    errors = [p.communicate(timeout=240)[1].decode() for p in procs]
    for p, err in zip(procs, errors):
        assert p.returncode == 0, err[-3000:]
    return [json.loads((tmp / f"out.{r}.json").read_text()) for r in range(2)], weights


def test_same_noise_in_separate_processes(two_ranks: tuple[list[dict], list[torch.Tensor]]) -> None:
    ranks, weights = two_ranks
    assert len({r["pid"] for r in ranks} | {os.getpid()}) == 3
    here = {f"{n}|{s}": _digest(noise_for(n, (4096,), 5e-4, 0, s)) for n, s in _KEYS}
    assert ranks[0]["noise"] == ranks[1]["noise"] == here
    assert len(set(here.values())) == len(here)  # different steps / names differ
    noiser = NormNoiser({f"model.layers.{i}.input_layernorm.weight": w.clone() for i, w in enumerate(weights)})
    noiser.apply(9, 5e-4)
    assert ranks[0]["bf16_checksum"] == ranks[1]["bf16_checksum"] == noiser.checksum()
    assert noiser.checksum() != noiser.clean_checksum()


# ------------------------------------------------------------------------------------------
# NormNoiser: in place, never accumulating, guarded
# ------------------------------------------------------------------------------------------


def _norm_dict(dtype: torch.dtype, n: int = 512, layers: int = 3) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(layers):
        for kind in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{i}.{kind}.weight"] = torch.nn.Parameter(
                _bf16_weights(n, seed=10 * i + len(kind)).to(dtype), requires_grad=False
            )
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_hundred_apply_restore_cycles_leave_clean_bits(dtype: torch.dtype) -> None:
    tensors = _norm_dict(dtype)
    original = {k: v.detach().clone() for k, v in tensors.items()}
    ptrs = {k: v.data_ptr() for k, v in tensors.items()}
    noiser = NormNoiser(tensors)
    start = noiser.checksum()
    assert start == noiser.clean_checksum()
    seen = set()
    for i in range(100):
        noiser.apply(step=i + 1, sigma=DEFAULT_SIGMAS[1 + i % 9])
        seen.add(noiser.checksum())
        assert noiser.current == (i + 1, DEFAULT_SIGMAS[1 + i % 9])
        if i % 3 == 0:  # re-applying the same step rewrites from clean: no drift
            again = noiser.checksum()
            noiser.apply(step=i + 1, sigma=DEFAULT_SIGMAS[1 + i % 9])
            assert noiser.checksum() == again
        noiser.restore()
        assert noiser.current is None
    assert len(seen) == 100  # every step's noise landed and differed
    assert noiser.checksum() == start
    for k, v in tensors.items():
        assert torch.equal(v, original[k]) and v.data_ptr() == ptrs[k]


def test_apply_overwrites_not_adds() -> None:
    a, b = _norm_dict(torch.bfloat16), _norm_dict(torch.bfloat16)
    na, nb = NormNoiser(a), NormNoiser(b)
    na.apply(3, 1e-2)
    na.apply(4, 1e-2)  # no restore in between
    nb.apply(4, 1e-2)
    assert na.checksum() == nb.checksum()
    na.apply(5, 0.0)  # sigma 0 writes the clean values
    assert na.checksum() == na.clean_checksum() and na.current == (5, 0.0)


def test_inplace_keeps_parameter_objects_and_storage() -> None:
    tensors = _norm_dict(torch.bfloat16, layers=1)
    ids = {k: (id(v), v.data_ptr()) for k, v in tensors.items()}
    noiser = NormNoiser(tensors.items())
    noiser.apply(2, 1e-2)
    assert {k: (id(v), v.data_ptr()) for k, v in tensors.items()} == ids
    assert noiser.metrics()["qerl/aqn_changed_frac"] > 0.5


def test_external_write_is_detected_and_refresh_adopts_it() -> None:
    tensors = _norm_dict(torch.bfloat16, layers=1)
    first, second = list(tensors)
    noiser = NormNoiser(tensors)
    noiser.apply(1, 1e-2)
    with torch.no_grad():
        tensors[first].fill_(1.25)  # e.g. a weight sync wrote new clean values
    with pytest.raises(RuntimeError, match=first):
        noiser.restore()
    with pytest.raises(RuntimeError, match=first):
        noiser.apply(2, 1e-2)
    noiser.refresh_clean()
    assert torch.equal(tensors[first], torch.full_like(tensors[first], 1.25))  # adopted
    assert noiser.checksum() == noiser.clean_checksum()
    noiser.apply(2, 1e-2)
    noiser.restore()
    assert torch.equal(tensors[first], torch.full_like(tensors[first], 1.25))
    # the untouched tensor got its own clean values back, not the noisy ones
    assert torch.equal(tensors[second], _norm_dict(torch.bfloat16, layers=1)[second])


def test_constructor_guards() -> None:
    with pytest.raises(ValueError, match="is empty"):
        NormNoiser({NORM: torch.ones(0)})
    with pytest.raises(ValueError, match="share the noise key"):
        NormNoiser({NORM: torch.ones(4), "base_model.model." + NORM: torch.ones(4)})
    with pytest.raises(ValueError, match="no tensor matches"):
        NormNoiser.from_config([("model.embed_tokens.weight", torch.ones(4))], AQNConfig())
    with pytest.raises(TypeError):
        NormNoiser({NORM: torch.ones(4, dtype=torch.int32)})


def test_fp32_storage_gets_the_noise_exactly() -> None:
    bf16 = _norm_dict(torch.bfloat16)
    exact = NormNoiser({k: v.detach().float().clone() for k, v in bf16.items()})
    exact.apply(541, 5e-4)
    assert exact.metrics()["qerl/aqn_sigma_effective"] == pytest.approx(5e-4, rel=0.05)
    assert exact.metrics()["qerl/aqn_changed_frac"] == 1.0


# ------------------------------------------------------------------------------------------
# Rounding: the noise survives BF16
# ------------------------------------------------------------------------------------------


def test_stochastic_round_is_unbiased_and_picks_a_neighbour() -> None:
    n = 100_000
    g = torch.Generator().manual_seed(3)
    for x0 in (1.0 + 2**-9, 1.0 + 3 * 2**-10, 0.3 - 1e-4, -2.7001):
        x = torch.full((n,), x0, dtype=torch.float64)
        out = stochastic_round(x, torch.bfloat16, torch.rand(n, dtype=torch.float64, generator=g))
        lo = torch.tensor(x0).to(torch.bfloat16)
        values = set(out.double().unique().tolist())
        assert len(values) == 2 and min(values) <= x0 <= max(values)
        spacing = max(values) - min(values)
        assert abs(float(out.double().mean()) - x0) < 5 * spacing / 2 / math.sqrt(n), x0
        assert lo.double().item() in values
    grid = torch.tensor([1.0, 1.0078125, 0.5], dtype=torch.float64)  # on the grid: unchanged
    almost_one = torch.full((3,), 0.999, dtype=torch.float64)
    assert torch.equal(stochastic_round(grid, torch.bfloat16, almost_one).double(), grid)


def test_sr_variance_limits_monte_carlo_and_monotonicity() -> None:
    a = torch.logspace(-7, 1, 400, dtype=torch.float64)
    v = sr_variance(a)
    assert bool((v[1:] > v[:-1]).all())
    assert float(v[0] / a[0]) == pytest.approx(math.sqrt(2 / math.pi), rel=1e-5)
    assert float(sr_variance(torch.tensor([2.0], dtype=torch.float64))) == pytest.approx(4 + 1 / 6, rel=1e-12)
    g = torch.Generator().manual_seed(5)
    for a0 in (0.05, 0.3, 0.8):
        t = torch.randn(1 << 20, dtype=torch.float64, generator=g) * a0
        k = torch.floor(t) + (torch.rand(t.shape, dtype=torch.float64, generator=g) < t - torch.floor(t))
        expected = float(sr_variance(torch.tensor([a0], dtype=torch.float64)))
        assert float((k * k).mean()) == pytest.approx(expected, rel=0.02)


@settings(max_examples=40, deadline=None)
@given(w=st.floats(0.01, 8.0), sigma=st.floats(1e-5, 0.1))
def test_matched_scale_in_unit_interval(w: float, sigma: float) -> None:
    c = matched_noise_scale(torch.tensor([w, -w], dtype=torch.bfloat16), sigma, torch.bfloat16)
    assert bool(((c > 0) & (c <= 1)).all())
    assert float(c[0]) == float(c[1])  # symmetric in the sign of the weight


@pytest.mark.parametrize("w", [1.0, 1.5, 3.0, 0.07])
@pytest.mark.parametrize("sigma", [5e-4, 2e-3, 1e-2])
def test_matched_rounding_per_weight_magnitude(w: float, sigma: float) -> None:
    """At any gain (1.0 is a power of two: its grid is 2x finer below), std sigma and mean 0."""
    n = 1 << 17
    clean = torch.full((n,), w, dtype=torch.bfloat16)
    z = noise_for(NORM, (n,), sigma, 0, 11)
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    delta = land_noise(clean, z, sigma, torch.bfloat16, "stochastic", u).double() - clean.double()
    std = float(delta.std())
    assert std == pytest.approx(sigma, rel=0.12)
    assert abs(float(delta.mean())) < 4.5 * std / math.sqrt(n)


def _stage_ratios(weights: torch.Tensor, rounding: str) -> list[float]:
    ratios = []
    for k, sigma in enumerate(DEFAULT_SIGMAS):
        t = weights.clone()
        noiser = NormNoiser({NORM: t}, rounding=rounding)
        noiser.apply(step=60 * k + 1, sigma=sigma)
        got = realized_std(weights, t)
        rms = noiser.metrics()["qerl/aqn_sigma_effective"]  # RMS of noisy - clean; std is close
        assert got == pytest.approx(rms, rel=1e-3, abs=0.0)
        ratios.append(got / sigma if sigma else got)
    return ratios


def test_noise_survives_bf16_at_every_stage() -> None:
    """Default schedule on BF16 gains in [0.05, 5]: realized std within 20% of sigma, every
    stage; round-to-nearest (the authors' code) falls short late; plain stochastic rounding
    overshoots."""
    weights = _bf16_weights(1 << 17)
    matched = _stage_ratios(weights, "stochastic")
    nearest = _stage_ratios(weights, "nearest")
    plain = _stage_ratios(weights, "stochastic_plain")
    table = "\n".join(
        f"stage {k} sigma {s:.2e}: matched {m:.3f} nearest {r:.3f} plain {p:.3f}"
        for k, (s, m, r, p) in enumerate(zip(DEFAULT_SIGMAS, matched, nearest, plain))
    )
    print(table)
    assert matched[0] == nearest[0] == plain[0] == 0.0  # stage 0: nothing written
    assert all(abs(m - 1) <= 0.2 for m in matched[1:]), table
    assert abs(nearest[-1] - 1) > 0.2 and abs(nearest[-2] - 1) > 0.2, table
    assert all(r < 1 for r in nearest[-5:]), table  # nearest loses noise as sigma shrinks
    assert abs(plain[-1] - 1) > 0.2 and all(p > 1 for p in plain[1:]), table


# ------------------------------------------------------------------------------------------
# Effect on a tiny Qwen2, and the training adapter
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_qwen2():
    import transformers

    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, ids


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def test_effect_grows_with_sigma_on_tiny_qwen2(tiny_qwen2) -> None:
    model, ids = tiny_qwen2
    noiser = NormNoiser.from_config(model.named_parameters(), AQNConfig())
    assert len(noiser) == 4 and all(".layers." in n for n in noiser.names)
    clean = _logits(model, ids)
    h0 = _entropy(clean)
    dlogit, dent, signed = [], [], []
    for sigma in (0.0, 1e-3, 1e-2, 1e-1):
        with noisy(noiser, step=3, sigma=sigma):
            out = _logits(model, ids)
        if sigma == 0.0:
            assert torch.equal(out, clean)
        dlogit.append(float((out - clean).abs().mean()))
        dent.append(float((_entropy(out) - h0).abs().mean()))
        signed.append(float((_entropy(out) - h0).mean()))
    msg = f"|dlogit| {dlogit} |dH| {dent} dH {signed}"
    print(msg)
    assert dlogit[0] == dent[0] == 0.0
    assert all(b > 2 * a for a, b in zip(dlogit, dlogit[1:])), msg
    assert all(b > 2 * a for a, b in zip(dent, dent[1:])), msg
    assert torch.equal(_logits(model, ids), clean)  # restored exactly


def test_bf16_model_late_stage_noise_lands_only_with_stochastic_rounding(tiny_qwen2) -> None:
    """RMSNorm gains are exactly 1.0 at init; sigma 5e-4 is 1/16 of the BF16 spacing above 1."""
    model, ids = tiny_qwen2
    bf16 = type(model)(model.config).eval().to(torch.bfloat16)
    bf16.load_state_dict(model.state_dict())
    clean = _logits(bf16, ids)
    results = {}
    for rounding in ("nearest", "stochastic"):
        noiser = NormNoiser.from_config(bf16.named_parameters(), AQNConfig(rounding=rounding))
        sq, changed_steps = 0.0, 0
        for step in range(1, 31):
            with noisy(noiser, step, 5e-4):
                sq += noiser.metrics()["qerl/aqn_sigma_effective"] ** 2
                changed_steps += not torch.equal(_logits(bf16, ids), clean)
        results[rounding] = (math.sqrt(sq / 30), changed_steps)
        assert torch.equal(_logits(bf16, ids), clean)
    assert results["nearest"] == (0.0, 0), results  # the authors' BF16 path: noise erased
    std, changed = results["stochastic"]
    assert std == pytest.approx(5e-4, rel=0.2), results
    assert changed >= 20, results


def test_noisy_context_restores_on_error_and_supports_backward(tiny_qwen2) -> None:
    model, ids = tiny_qwen2
    noiser = NormNoiser.from_config(model.named_parameters(), AQNConfig())
    before = noiser.checksum()
    with pytest.raises(ZeroDivisionError), noisy(noiser, 5, 1e-2):
        assert noiser.checksum() != before
        1 / 0  # noqa: B018
    assert noiser.checksum() == before and noiser.current is None
    head = model.lm_head.weight
    head.requires_grad_(True)
    try:
        with noisy(noiser, 5, 1e-2):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        grad_noisy = head.grad.clone()
        head.grad = None
        model(input_ids=ids, labels=ids).loss.backward()
        assert not torch.equal(grad_noisy, head.grad)  # the update saw the noisy policy
    finally:
        model.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------
# noise_from_start: noise on from step 1
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["exponential", "linear", "cosine", "constant"])
def test_noise_from_start_puts_sigma_start_on_step_one(schedule: str) -> None:
    """T = 100, K = 10: step 1 -> stage 0 (sigma_start), step 50 -> stage 4, step 100 -> stage 9 (sigma_end)."""
    cfg = AQNConfig(schedule=schedule, noise_from_start=True, total_steps=100)
    assert sigma_at(0, None, cfg) == 1e-2  # verl's weight sync before step 1 is stage 0 too
    assert sigma_at(1, None, cfg) == 1e-2
    expected_mid = {"exponential": 1e-2 * (5e-4 / 1e-2) ** (4 / 9), "linear": 1e-2 + (5e-4 - 1e-2) * 4 / 9,
                    "cosine": 5e-4 + (1e-2 - 5e-4) * 0.5 * (1 + math.cos(math.pi * 4 / 9)), "constant": 1e-2}[schedule]
    assert stage_of(50, 100, 10) == 4
    assert sigma_at(50, None, cfg) == pytest.approx(expected_mid, rel=1e-12)
    assert sigma_at(100, None, cfg) == (1e-2 if schedule == "constant" else 5e-4)
    # the default schedule is unchanged: stage 0 noise-free, sigma_start first in stage 1
    default = AQNConfig(schedule=schedule, total_steps=100)
    assert sigma_at(1, None, default) == 0.0 and sigma_at(11, None, default) == 1e-2
    assert sigma_at(100, None, default) == sigma_at(100, None, cfg)
    # monotone non-increasing over the run, every step noisy
    sigmas = [sigma_at(s, None, cfg) for s in range(1, 101)]
    assert all(s > 0 for s in sigmas) and all(a >= b for a, b in zip(sigmas, sigmas[1:]))
    assert aqn_metrics(1, None, cfg) == {"qerl/aqn_sigma": 1e-2, "qerl/aqn_stage": 0.0}


def test_noise_from_start_allows_two_stages_and_names_its_key() -> None:
    cfg = AQNConfig(noise_from_start=True, num_stages=2, total_steps=4)
    assert [sigma_at(s, None, cfg) for s in (1, 2, 3, 4)] == [1e-2, 1e-2, 5e-4, 5e-4]
    with pytest.raises(AQNConfigError, match=r"^num_stages: must be >= 3 .*noise_from_start=true"):
        AQNConfig(num_stages=2)
    with pytest.raises(AQNConfigError, match=r"^num_stages: must be >= 2"):
        AQNConfig(noise_from_start=True, num_stages=1)
    with pytest.raises(AQNConfigError, match=r"^noise_from_start: must be true or false"):
        AQNConfig(noise_from_start="yes")
    with pytest.raises(AQNConfigError, match=r"^total_steps: 5 is fewer than num_stages=10: .*decay is skipped"):
        AQNConfig(noise_from_start=True, total_steps=5)
    assert AQNConfig.from_dict({"noise_from_start": True}).to_dict()["noise_from_start"] is True
    table = schedule_table(100, AQNConfig(noise_from_start=True))
    assert table[0].sigma == 1e-2 and table[0].first_step == 1 and table[-1].sigma == 5e-4
