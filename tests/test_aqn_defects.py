"""Reproduced AQN defects: each test failed before its fix (settings read the wrong way round, silent no-ops,
misleading errors); CPU only."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VERL_QERL_QUIET", "1")
import verl  # noqa: E402, F401  (required in CI: a missing verl must fail, not skip)

from verl_qerl.aqn import AQNConfig, AQNConfigError, NormNoiser, schedule_table  # noqa: E402
from verl_qerl.testing.ppo_config import composed  # noqa: E402
from verl_qerl.verl.config import QeRLConfig, QeRLConfigError, apply_qerl  # noqa: E402

NORM = "model.layers.0.input_layernorm.weight"


def _named_norms(layers: int = 2, final: bool = True) -> list[tuple[str, torch.Tensor]]:
    named = [(f"model.layers.{i}.{t}.weight", torch.ones(8, dtype=torch.bfloat16))
             for i in range(layers) for t in ("input_layernorm", "post_attention_layernorm")]
    return named + ([("model.norm.weight", torch.ones(8, dtype=torch.bfloat16))] if final else [])


# -- 1: qerl.aqn=false / null turned AQN on -------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["false", "null", "0"])
def test_aqn_false_or_null_is_refused_not_read_as_defaults(value):
    with pytest.raises(QeRLConfigError, match=r"qerl.aqn=.*to turn AQN off set qerl.aqn.enable=false"):
        apply_qerl(composed("+qerl=nvfp4_noaqn", f"qerl.aqn={value}"))
    with pytest.raises(QeRLConfigError, match=r"qerl.aqn=False: .*qerl.aqn.enable=false"):
        QeRLConfig.from_dict({"mode": "nvfp4", "aqn": False})


def test_aqn_default_is_the_same_everywhere():
    """Only a missing block means the defaults, and they are the README's (``enable: true``) whichever way the
    config is built."""
    assert QeRLConfig().aqn == QeRLConfig.from_dict({"mode": "nvfp4"}).aqn == AQNConfig()
    assert QeRLConfig(mode="nvfp4").aqn.enable
    assert apply_qerl(composed("+qerl.mode=nvfp4")).aqn.enable


# -- 2: a misspelled target passed when another one matched ---------------------------------------------------------


def test_each_target_that_matches_nothing_is_named():
    cfg = AQNConfig(targets=("input_layernorm", "post_attn_layernorm"))
    with pytest.raises(ValueError, match=r"qerl.aqn.targets entry 'post_attn_layernorm'") as err:
        NormNoiser.from_config(_named_norms(), cfg)
    assert "'input_layernorm'" not in str(err.value).split(";")[0]  # the matching entry is not blamed
    both = AQNConfig(targets=("inptu_layernorm", "post_attn_layernorm"))
    with pytest.raises(ValueError, match=r"'inptu_layernorm'.*'post_attn_layernorm'"):
        NormNoiser.from_config(_named_norms(), both)
    assert len(NormNoiser.from_config(_named_norms(), AQNConfig())) == 4


def test_include_final_norm_without_a_final_norm_is_refused():
    with pytest.raises(ValueError, match=r"qerl.aqn.include_final_norm=true"):
        NormNoiser.from_config(_named_norms(final=False), AQNConfig(include_final_norm=True))
    assert len(NormNoiser.from_config(_named_norms(), AQNConfig(include_final_norm=True))) == 5


# -- 3: qerl.aqn.total_steps vs the run's length -------------------------------------------------------------------


def test_run_ending_before_the_first_noisy_step_of_aqn_total_steps_is_refused():
    with pytest.raises(QeRLConfigError, match=r"trainer.total_training_steps=20 .*qerl.aqn.total_steps=1000.*"
                                              r"starts at step 101"):
        apply_qerl(composed("+qerl=nvfp4", "+qerl.aqn.total_steps=1000", "trainer.total_training_steps=20"))
    # one step short of the first noisy stage is refused, reaching it is not
    with pytest.raises(QeRLConfigError, match=r"qerl.aqn.total_steps=1000"):
        apply_qerl(composed("+qerl=nvfp4", "+qerl.aqn.total_steps=1000", "trainer.total_training_steps=100"))
    assert apply_qerl(composed("+qerl=nvfp4", "+qerl.aqn.total_steps=1000", "trainer.total_training_steps=101"))


def test_shorter_run_that_gets_noise_under_aqn_total_steps_is_accepted():
    from verl_qerl.verl.trainer import AQNDriver

    qerl = apply_qerl(composed("+qerl=nvfp4", "+qerl.aqn.total_steps=10", "trainer.total_training_steps=5"))
    driver = AQNDriver(qerl, 5, lambda: [])
    assert [driver.sigma(s) for s in range(1, 6)] == [row.sigma for row in schedule_table(10, qerl.aqn)[:5]]
    assert driver.sigma(2) == qerl.aqn.sigma_start
    # without qerl.aqn.total_steps the schedule spans the run, and a run shorter than the stages is still refused
    with pytest.raises(QeRLConfigError, match=r"trainer.total_training_steps=5 is fewer than qerl.aqn.num_stages"):
        apply_qerl(composed("+qerl=nvfp4", "trainer.total_training_steps=5"))
    # AQN off: nothing to reach
    assert not apply_qerl(composed("+qerl=nvfp4_noaqn", "+qerl.aqn.total_steps=1000",
                                   "trainer.total_training_steps=20")).aqn.enable


# -- 4: every README key overrides plainly in every group -----------------------------------------------------------


@pytest.mark.parametrize("group", ["nvfp4", "nvfp4_noaqn", "bf16", "nf4"])
def test_every_aqn_key_overrides_without_plus_in_every_group(group):
    cfg = composed(f"+qerl={group}", "qerl.aqn.enable=true", "qerl.aqn.sigma_start=0.02", "qerl.aqn.sigma_end=1e-4",
                   "qerl.aqn.num_stages=4", "qerl.aqn.schedule=linear", "qerl.aqn.noise_from_start=true",
                   "qerl.aqn.seed=3", "qerl.aqn.apply_to=rollout", "qerl.aqn.targets=[input_layernorm]",
                   "qerl.aqn.include_final_norm=true", "qerl.aqn.rounding=nearest", "qerl.aqn.total_steps=40")
    got = apply_qerl(cfg).aqn
    assert got == AQNConfig(sigma_start=0.02, sigma_end=1e-4, num_stages=4, schedule="linear", noise_from_start=True,
                            seed=3, targets=("input_layernorm",), include_final_norm=True, rounding="nearest",
                            total_steps=40)


@pytest.mark.parametrize("group", ["nvfp4", "nvfp4_noaqn", "bf16", "nf4"])
def test_groups_keep_their_meaning_and_the_aqn_defaults(group):
    got = apply_qerl(composed(f"+qerl={group}")).aqn
    assert got == AQNConfig(enable=group == "nvfp4")
    # `+key=` (what worked before for the keys the groups lacked) still does for the keys shipped as null / lists
    plus = composed(f"+qerl={group}", "+qerl.aqn.targets=[post_attention_layernorm]",
                    "+qerl.aqn.include_final_norm=true", "+qerl.aqn.rounding=nearest", "+qerl.aqn.total_steps=100")
    got = apply_qerl(plus).aqn
    assert (got.targets, got.include_final_norm, got.rounding, got.total_steps) == (
        ("post_attention_layernorm",), True, "nearest", 100)


# -- 5: a NaN in a targeted norm ------------------------------------------------------------------------------------


def test_non_finite_weight_is_refused_at_construction_naming_it():
    for bad in (float("nan"), float("inf")):
        w = torch.ones(8, dtype=torch.bfloat16)
        w[3] = bad
        with pytest.raises(ValueError, match=r"'model.layers.5.input_layernorm.weight' holds 1 non-finite"):
            NormNoiser({"model.layers.5.input_layernorm.weight": w})


def test_refresh_clean_refuses_a_non_finite_value_and_changes_nothing():
    tensors = {NORM: torch.ones(8, dtype=torch.bfloat16),
               "model.layers.1.input_layernorm.weight": torch.ones(8, dtype=torch.bfloat16)}
    noiser = NormNoiser(tensors)
    noiser.apply(1, 1e-2)
    noisy = tensors["model.layers.1.input_layernorm.weight"].clone()
    with torch.no_grad():
        tensors[NORM][2] = float("nan")  # e.g. a broken weight sync
    with pytest.raises(ValueError, match=rf"'{NORM}' holds 1 non-finite .*refresh_clean"):
        noiser.refresh_clean()
    assert torch.equal(tensors["model.layers.1.input_layernorm.weight"], noisy)  # nothing written
    with torch.no_grad():
        tensors[NORM].fill_(1.5)  # a good sync
    noiser.refresh_clean()
    assert torch.equal(tensors[NORM], torch.full((8,), 1.5, dtype=torch.bfloat16))
    assert torch.equal(tensors["model.layers.1.input_layernorm.weight"], torch.ones(8, dtype=torch.bfloat16))


def test_unchanged_check_is_nan_safe():
    """A NaN that the noiser's own snapshot holds (bypassing the construction check) is no outside change."""
    noiser = NormNoiser({NORM: torch.ones(8)})
    entry = noiser._entries[0]
    with torch.no_grad():
        entry.live[1] = float("nan")
    entry.clean = entry.live.detach().clone()
    noiser.restore()  # raised "changed outside NormNoiser" before
    with torch.no_grad():
        entry.live[2] = 3.0
    with pytest.raises(RuntimeError, match="changed outside NormNoiser"):
        noiser.restore()


# -- 7: minor -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("schedule", "sigma_end"), [("linear", 0.0), ("cosine", 0.0), ("constant", 5e-4)])
def test_aqn_on_with_zero_sigma_start_is_refused(schedule, sigma_end):
    with pytest.raises(AQNConfigError, match=rf"^sigma_start: 0 with enable=true and schedule={schedule} adds no "
                                             r"noise.*schedule=none or enable=false"):
        AQNConfig(schedule=schedule, sigma_start=0.0, sigma_end=sigma_end)
    assert AQNConfig(enable=False, schedule=schedule, sigma_start=0.0, sigma_end=sigma_end).sigma_start == 0.0
    assert AQNConfig(schedule="none", sigma_start=0.0, sigma_end=0.0).schedule == "none"
    with pytest.raises(QeRLConfigError, match=r"qerl.aqn: sigma_start: 0"):
        apply_qerl(composed("+qerl=nvfp4", "qerl.aqn.schedule=linear", "qerl.aqn.sigma_start=0",
                            "qerl.aqn.sigma_end=0"))
