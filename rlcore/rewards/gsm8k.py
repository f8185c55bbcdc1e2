"""GSM8K-style answers: the final number after `####`, scored against a numeric ground truth.

Same contract as verl's rule-based GSM8K scorer (`compute_score(solution_str, ground_truth,
method, format_score, score)`): no extractable answer scores 0, an extracted but wrong answer
scores `format_score`, a right one `score`. Two deliberate leniencies over a plain string
compare, because both are formatting noise and not wrong arithmetic: numbers compare by value
("72.0" == "72", "1,000" == "1000"), and a sentence-ending period after the number is ignored.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# Only the tail of a response is searched: the final answer lives at the end, and regexes over
# very long (degenerate, repetitive) outputs would otherwise dominate scoring time.
CLIP_CHARS = 300

_NUMBER = r"-?[0-9,]*\.?[0-9]+"
_NUMBER_RE = re.compile(_NUMBER)
STRICT_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")

METHODS = ("strict", "flexible")


def _clean(number: str) -> str:
    return number.replace(",", "")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer as a plain number string (commas removed), or None if there is none.

    strict: the last `#### <number>` (an optional `$` after `####` is allowed).
    flexible: the last number anywhere in the text.
    """
    if method not in METHODS:
        raise ValueError(f"gsm8k method must be one of {METHODS}, got {method!r}")
    text = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = STRICT_RE.findall(text)
    else:
        found = _NUMBER_RE.findall(text)
    return _clean(found[-1]) if found else None


def normalize_ground_truth(ground_truth: object) -> str:
    """Ground truth as a plain number string; a raw GSM8K answer ("... #### 1,000") works too."""
    text = str(ground_truth).strip()
    if "####" in text:
        extracted = extract_solution(text, "strict")
        if extracted is not None:
            return extracted
    return _clean(text).lstrip("$").strip()


def numbers_equal(a: str, b: str) -> bool:
    """String equality, else equality by decimal value ("72.00" == "72"); never float rounding."""
    if a == b:
        return True
    try:
        return Decimal(a) == Decimal(b)
    except (InvalidOperation, ValueError):
        return False


def compute_score(
    solution_str: str,
    ground_truth: object,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the extracted answer equals the ground truth, `format_score` if an answer was
    extracted but is wrong, 0.0 if no answer could be extracted."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if numbers_equal(answer, normalize_ground_truth(ground_truth)) else float(format_score)
