"""Reward for the tiny default job: GSM8K exact match, plus a small dense shaping term.

A random-weight tiny model never produces the right answer, so GSM8K's 0/1 reward alone gives zero
advantages and zero gradients, and a run could not show that LoRA trains and reaches the rollout. The
shaping term (fraction of digit characters in the response, scaled by 0.5) varies between samples of a
group, so GRPO has a signal from step 1. Not for real training.
"""

from __future__ import annotations


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    from verl.utils.reward_score import default_compute_score

    exact = float(default_compute_score(data_source, solution_str, ground_truth, extra_info))
    text = solution_str or ""
    digits = sum(ch.isdigit() for ch in text) / max(len(text), 1)
    return exact + 0.5 * digits
