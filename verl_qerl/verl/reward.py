"""A numeric-answer reward that accepts the answer forms pretrained instruct models write.

verl's GSM8K scorer (``data_source="openai/gsm8k"``) only rewards ``#### <number>``. A pretrained
instruct policy such as Qwen2.5-Coder-0.5B-Instruct states its result as ``\\boxed{N}`` (or "The answer
is N") even when the prompt asks for ``####``, so under the strict scorer every one of its responses
scores 0 and GRPO sees no signal. This module is a verl custom reward function that reads the final
answer from any of a configurable set of forms and compares it numerically with the ground truth.

Select it per run (the default stays verl's strict scorer)::

    reward.custom_reward_function.path=pkg://verl_qerl.verl.reward
    reward.custom_reward_function.name=compute_score
    +reward.custom_reward_function.reward_kwargs.forms=[boxed,hash,answer_is]   # optional; this is the default

Rules (all forms together): the final answer is the one whose marker comes *last* in the response,
among the enabled forms (a ``####`` / "answer is" marker without a number does not override an earlier
statement); its text must be a single number (commas or ``{,}`` as thousands separators, ``$``,
``\\text{...}`` / ``\\$`` / ``\\!`` decoration and a trailing period are dropped); correct means numerically
equal to the ground truth (``42`` == ``42.0``). No answer, or a non-numeric one, scores
``format_score`` (0 by default, as verl's scorer). Rows whose ``data_source`` is not a numeric-answer
source listed in :data:`NUMERIC_SOURCES` go to verl's default scorer unchanged.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

#: Answer forms this scorer can read; each names a pattern in :func:`find_answers`.
FORMS = ("boxed", "hash", "answer_is")
DEFAULT_FORMS = FORMS
#: keyword arguments verl's reward managers add to a custom reward function's call (with a reward model router)
VERL_CALL_KWARGS = ("reward_router_address", "reward_model_tokenizer")
#: data sources whose ground truth is one number (verl's GSM8K rows, and the generated arithmetic).
NUMERIC_SOURCES = ("openai/gsm8k",)

#: ``####`` (or a longer run of ``#``) followed by a number, possibly behind ``$`` / ``**`` decoration: a markdown
#: heading such as ``#### Explanation`` is not an answer statement.
_HASH = re.compile(r"#{4,}\s*((?:\*\*|\\?\$)*\s*-?\.?\d[^\n]*)")
_ANSWER_IS = re.compile(r"\b(?:the\s+)?(?:final\s+)?answer\s*(?:is\b|:)\s*:?\s*([^\n]*)", re.IGNORECASE)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_TEXT_WRAP = re.compile(r"\\(?:text|mathrm|textbf|mathbf)\s*\{([^{}]*)\}")


class RewardConfigError(ValueError):
    """A bad ``reward_kwargs`` value; the message names the key."""


def check_forms(forms: Iterable[str] | str) -> tuple[str, ...]:
    """The enabled forms as a tuple; an error naming ``reward_kwargs.forms`` for unknown or empty ones."""
    if isinstance(forms, str):
        forms = [f for f in forms.split(",") if f.strip()]
    out = tuple(str(f).strip() for f in forms)
    bad = [f for f in out if f not in FORMS]
    if not out or bad:
        raise RewardConfigError(f"reward_kwargs.forms={list(out)!r}: unknown or empty; choose a non-empty subset of "
                                f"{list(FORMS)}")
    return out


def _boxed_spans(text: str) -> list[tuple[int, str]]:
    """(position, content) of every ``\\boxed{...}`` / ``\\fbox{...}``, braces matched (``\\boxed{\\frac{1}{2}}``)."""
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append((m.start(), text[m.end():i - 1]))
    return out


def find_answers(text: str, forms: Sequence[str] = DEFAULT_FORMS) -> list[tuple[int, str, str]]:
    """Every answer statement of the enabled forms as ``(position, form, raw text)``, in text order."""
    found: list[tuple[int, str, str]] = []
    if "boxed" in forms:
        found += [(pos, "boxed", body) for pos, body in _boxed_spans(text)]
    if "hash" in forms:
        found += [(m.start(), "hash", m.group(1)) for m in _HASH.finditer(text)]
    if "answer_is" in forms:
        found += [(m.start(), "answer_is", m.group(1)) for m in _ANSWER_IS.finditer(text)]
    return sorted(found, key=lambda x: x[0])


def parse_number(raw: str, form: str = "boxed") -> Fraction | None:
    """The number an answer statement gives, or None when it is not exactly one number.

    ``boxed`` content must be the number alone (after dropping ``$``, ``\\text{}`` wrappers, ``\\!``/``\\,``
    spacing); ``hash`` and ``answer_is`` take the first number at the start of the line
    (``#### 42 apples`` -> 42, ``The answer is $1,234.`` -> 1234) but not one later in a sentence.
    """
    s = _TEXT_WRAP.sub(r"\1", raw).replace("{,}", ",")  # LaTeX's thousands separator: 1{,}200
    s = s.replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\ ", " ").strip()
    s = s.replace("**", "").strip()
    if form == "boxed":
        s = s.rstrip(".").strip()
        m = _NUMBER.fullmatch(s.replace(" ", ""))
    else:
        m = _NUMBER.match(s)
        if m and s[m.end():m.end() + 1].isdigit():
            m = None
    if not m:
        return None
    try:
        return Fraction(m.group(0).replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def final_answer(text: str, forms: Sequence[str] = DEFAULT_FORMS) -> Fraction | None:
    """The number of the last answer statement (by position) of the enabled forms, or None.

    A ``hash`` / ``answer_is`` marker that gives no number ("I hope this answer is helpful!", "Answer: see above")
    does not override an earlier statement; a ``\\boxed{}`` one always counts (``\\boxed{x}`` last: None).
    """
    answers = find_answers(text, forms)
    for i in range(len(answers) - 1, -1, -1):
        _, form, raw = answers[i]
        value = parse_number(raw, form)
        if value is not None or form == "boxed" or i == 0:
            return value
    return None


def score_numeric(text: str, ground_truth: str, forms: Sequence[str] = DEFAULT_FORMS, *, score: float = 1.0,
                  format_score: float = 0.0) -> float:
    """``score`` if the final answer equals ``ground_truth`` numerically, else ``format_score``."""
    truth = parse_number(str(ground_truth), "boxed")
    if truth is None:
        raise RewardConfigError(f"ground_truth={ground_truth!r} is not a number: this scorer is for numeric answers")
    answer = final_answer(text or "", forms)
    return score if answer is not None and answer == truth else format_score


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  forms: Iterable[str] | str = DEFAULT_FORMS, score: float = 1.0, format_score: float = 0.0,
                  **kwargs: Any) -> float:
    """verl custom reward entry point (``reward.custom_reward_function.name=compute_score``).

    ``forms``, ``score`` and ``format_score`` come from ``reward.custom_reward_function.reward_kwargs``; any other
    key there is refused (verl itself passes only :data:`VERL_CALL_KWARGS`, which are accepted and not used).
    Other data sources are scored by verl's default scorer.
    """
    unknown = sorted(set(kwargs) - set(VERL_CALL_KWARGS))
    if unknown:
        raise RewardConfigError(f"reward_kwargs.{unknown[0]}: unknown key of this reward (a misspelling would be "
                                f"dropped without a word); its keys are forms, score, format_score")
    for key, value in (("score", score), ("format_score", format_score)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RewardConfigError(f"reward_kwargs.{key}={value!r}: must be a finite number")
    enabled = check_forms(forms)
    if data_source not in NUMERIC_SOURCES:
        from verl.utils.reward_score import default_compute_score

        return default_compute_score(data_source, solution_str, ground_truth, extra_info)
    return float(score_numeric(solution_str, ground_truth, enabled, score=score, format_score=format_score))


def reward_overrides(forms: Sequence[str] = DEFAULT_FORMS) -> list[str]:
    """Overrides for ``main_ppo`` that make this module the run's reward (train and validation)."""
    enabled = check_forms(forms)
    return ["reward.custom_reward_function.path=pkg://verl_qerl.verl.reward",
            "reward.custom_reward_function.name=compute_score",
            f"+reward.custom_reward_function.reward_kwargs.forms=[{','.join(enabled)}]"]
