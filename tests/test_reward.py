"""verl_qerl.verl.reward: the numeric-answer scorer for pretrained instruct policies, and its verl wiring."""

from __future__ import annotations

from fractions import Fraction

import pytest

from verl_qerl.verl import reward as R

# Responses in the shape Qwen2.5-Coder-0.5B-Instruct writes for the generated GSM8K-format problems (step by step,
# LaTeX display math, a final \boxed{}), plus the GSM8K-trained shape ("#### N") and plain prose.
QWEN_BOXED = r"""To determine how many apples Tom has, we follow these steps:

1. Tom starts with 23 apples.
2. He buys 19 more: \( 23 + 19 = 42 \).

Therefore, Tom has \(\boxed{42}\) apples."""
QWEN_MULTI = r"""Let's solve step by step.

1. Ann starts with 12 coins.
2. She finds 5 more: \[ 12 + 5 = 17 \]
3. The coins are multiplied by 3: \[ 17 \times 3 = 51 \]
4. She gives away 7: \[ 51 - 7 = 44 \]

So, the final answer is:
\[
\boxed{44}
\]"""
GSM8K_STYLE = "12 + 5 = 17\n17 * 3 = 51\n51 - 7 = 44\n#### 44"
PROSE = "She has 51 - 7 = 44 coins left. The answer is 44."


@pytest.mark.parametrize("text, truth", [(QWEN_BOXED, "42"), (QWEN_MULTI, "44"), (GSM8K_STYLE, "44"), (PROSE, "44")])
def test_model_like_responses_are_rewarded(text, truth):
    assert R.compute_score("openai/gsm8k", text, truth) == 1.0
    wrong = str(int(truth) + 1)
    assert R.compute_score("openai/gsm8k", text, wrong) == 0.0


def test_strict_verl_scorer_gives_qwen_responses_zero():
    """Why this module exists: verl's own GSM8K scorer reads only '#### N'."""
    from verl.utils.reward_score import default_compute_score

    assert default_compute_score("openai/gsm8k", QWEN_BOXED, "42") == 0
    assert default_compute_score("openai/gsm8k", GSM8K_STYLE, "44") == 1.0
    assert R.compute_score("openai/gsm8k", QWEN_BOXED, "42") == 1.0


@pytest.mark.parametrize("text, expected", [
    (r"First guess \boxed{10}, but recheck: \boxed{12}. Final: \boxed{14}", Fraction(14)),  # several: the last
    (r"\boxed{1,234}", Fraction(1234)),  # thousands separator
    (r"\boxed{-17}", Fraction(-17)),  # negative
    (r"\boxed{ 42. }", Fraction(42)),  # trailing period, spaces
    (r"\boxed{\$5}", Fraction(5)),
    (r"\boxed{42 \text{ apples}}", None),  # text after the number: not one number
    (r"\boxed{\text{42}}", Fraction(42)),
    (r"\boxed{2.5}", Fraction(5, 2)),
    (r"\boxed{x + 1}", None),
    (r"\boxed{\frac{1}{2}}", None),  # braces matched; not a plain number
    (r"\boxed{12} and then \boxed{x}", None),  # the last statement counts even when it is not a number
    ("#### 1,000", Fraction(1000)),
    ("####-3", Fraction(-3)),
    ("#### $7.", Fraction(7)),
    ("#### 12 apples", Fraction(12)),
    ("#### about 12", None),
    (r"#### 5 ... no wait, \boxed{6}", Fraction(6)),  # mixed forms: the later one
    (r"\boxed{6} so #### 5", Fraction(5)),
    ("The answer is -4.", Fraction(-4)),
    ("Final answer: **8**", Fraction(8)),
    ("the answer is 12345", Fraction(12345)),
    ("The answer is not clear, maybe 3", None),
    ("I don't know.", None),
    ("", None),
    ("42", None),  # a bare number is not an answer statement
    (r"\boxed{42", None),  # unclosed
])
def test_final_answer(text, expected):
    assert R.final_answer(text) == expected


def test_numeric_comparison_and_ground_truth_forms():
    assert R.score_numeric(r"\boxed{42.0}", "42") == 1.0
    assert R.score_numeric(r"\boxed{42}", "42.0") == 1.0
    assert R.score_numeric(r"\boxed{1,234}", "1234") == 1.0
    assert R.score_numeric(r"\boxed{-5}", "5") == 0.0
    assert R.score_numeric("no answer", "5", format_score=0.1) == 0.1
    with pytest.raises(R.RewardConfigError, match="ground_truth"):
        R.score_numeric(r"\boxed{1}", "one")


def test_forms_are_configurable():
    assert R.compute_score("openai/gsm8k", QWEN_BOXED, "42", forms=["hash"]) == 0.0
    assert R.compute_score("openai/gsm8k", GSM8K_STYLE, "44", forms=["hash"]) == 1.0
    assert R.compute_score("openai/gsm8k", PROSE, "44", forms="boxed,hash") == 0.0
    assert R.compute_score("openai/gsm8k", PROSE, "44", forms=("answer_is",)) == 1.0
    # a disabled form is ignored entirely, even when it comes last
    assert R.compute_score("openai/gsm8k", r"\boxed{3} #### 4", "3", forms=["boxed"]) == 1.0
    assert R.compute_score("openai/gsm8k", QWEN_BOXED, "42", score=2.0) == 2.0


@pytest.mark.parametrize("forms", [["boxd"], [], "", ["boxed", "latex"]])
def test_bad_forms_name_the_key(forms):
    with pytest.raises(R.RewardConfigError, match="reward_kwargs.forms"):
        R.compute_score("openai/gsm8k", QWEN_BOXED, "42", forms=forms)


def test_other_data_sources_go_to_verls_scorer():
    from verl.utils.reward_score import default_compute_score

    text = "Answer: 42"
    assert R.compute_score("math_dapo", text, "42") == default_compute_score("math_dapo", text, "42")


def test_verl_loads_it_from_the_overrides(tmp_path):
    """The overrides compose in verl's real config, and verl's own loader returns a function that scores with the
    configured forms (reward_kwargs reach compute_score)."""
    from hydra import compose, initialize_config_module
    from verl.trainer.ppo.reward import get_custom_reward_fn

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=R.reward_overrides(["hash"]))
    fn = get_custom_reward_fn(cfg)
    assert fn is not None
    assert fn(data_source="openai/gsm8k", solution_str=GSM8K_STYLE, ground_truth="44", extra_info=None) == 1.0
    assert fn(data_source="openai/gsm8k", solution_str=QWEN_BOXED, ground_truth="42", extra_info=None) == 0.0
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=R.reward_overrides())
    fn = get_custom_reward_fn(cfg)
    assert fn(data_source="openai/gsm8k", solution_str=QWEN_BOXED, ground_truth="42", extra_info=None) == 1.0


def test_default_config_keeps_verls_strict_scorer():
    from hydra import compose, initialize_config_module
    from verl.trainer.ppo.reward import get_custom_reward_fn

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer")
    assert get_custom_reward_fn(cfg) is None
