"""Format reward: 1.0 when a response states its answer in the expected form, else 0.0.

Useful as a shaping term or a metric separate from correctness ("did the model answer at all?").
The form is a preset name or any regular expression; presets exist for the two answer styles
the rule-based scorers read, so format and correctness agree on what counts as an answer.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from .gsm8k import CLIP_CHARS, STRICT_RE
from .math_boxed import extract_boxed_answer

_THINK_ANSWER_RE = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)

PRESETS: dict[str, Callable[[str], bool]] = {
    # exactly what the GSM8K strict scorer extracts from
    "gsm8k": lambda text: STRICT_RE.search(text[-CLIP_CHARS:]) is not None,
    # a closed \boxed{...} the MATH scorer can read (brace matching, not a regex)
    "boxed": lambda text: extract_boxed_answer(text) is not None,
    # R1-style reasoning then answer tags, nothing else around them
    "think_answer": lambda text: _THINK_ANSWER_RE.fullmatch(text.strip()) is not None,
}


@functools.lru_cache(maxsize=64)
def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"format pattern {pattern!r} is not a valid regular expression: {e}") from e


def format_reward(solution_str: str, pattern: str = "gsm8k", full_match: bool = False) -> float:
    """1.0 if `solution_str` has the answer form `pattern`, else 0.0.

    pattern: a preset name (`gsm8k`, `boxed`, `think_answer`) or a regular expression (compiled
    with DOTALL, so `.` spans lines). full_match: for a regex, the whole stripped response must
    match instead of any part of it (ignored for presets, which define their own rule).
    """
    check = PRESETS.get(pattern)
    if check is not None:
        return 1.0 if check(solution_str) else 0.0
    regex = _compile(pattern)
    found = regex.fullmatch(solution_str.strip()) if full_match else regex.search(solution_str)
    return 1.0 if found is not None else 0.0


def compute_score(
    solution_str: str,
    ground_truth: object = None,
    pattern: str = "gsm8k",
    full_match: bool = False,
) -> float:
    """verl-style signature (ground truth accepted and ignored): the format alone is scored."""
    return format_reward(solution_str, pattern=pattern, full_match=full_match)
