"""MATH-style answers: the last `\\boxed{...}` in a response, compared after light normalisation.

Same contract as verl's MATH scorer (`compute_score(solution_str, ground_truth)` -> 1.0 / 0.0):
the answer is the content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`), found
with brace matching so nested braces (`\\boxed{\\frac{1}{2}}`) survive. The normalisation only
removes notation that does not change the value (spacing, `\\left`/`\\right`, dollars, units in
`\\text{ ...}`, `\\frac12` shorthand, ...); it is not a symbolic checker (`0.5` != `\\frac{1}{2}`).
"""

from __future__ import annotations

import re

_COMMANDS = ("\\boxed", "\\fbox")


def _find_last_command(text: str) -> tuple[int, int] | None:
    """(start, end) of the last `\\boxed` / `\\fbox` that is a whole command name."""
    best: tuple[int, int] | None = None
    for cmd in _COMMANDS:
        pos = len(text)
        while True:
            pos = text.rfind(cmd, 0, pos)
            if pos < 0:
                break
            end = pos + len(cmd)
            if end < len(text) and text[end].isalpha():  # e.g. `\boxedfoo`: another command
                continue
            if best is None or pos > best[0]:
                best = (pos, end)
            break
    return best


def _match_braces(text: str, open_pos: int) -> int | None:
    """Index of the `}` closing the `{` at `open_pos`; escaped `\\{`, `\\}` are not structural."""
    depth = 0
    i = open_pos
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # skip the escaped character (covers `\{` and `\}`)
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def extract_boxed_answer(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` / `\\boxed x`; None if absent or unclosed."""
    found = _find_last_command(text)
    if found is None:
        return None
    _, end = found
    rest = text[end:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        open_pos = end + (len(rest) - len(stripped))
        close = _match_braces(text, open_pos)
        if close is None:
            return None  # truncated answer: no final answer was given
        return text[open_pos + 1:close]
    if rest[:1].isspace():
        # `\boxed 5$`: the argument runs to the closing dollar or the end of the line.
        answer = re.split(r"[$\n]", stripped, maxsplit=1)[0].strip()
        return answer or None
    return None


def _fix_fracs(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}`, `\\frac{a}b` -> `\\frac{a}{b}`."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        args: list[str] = []
        rest = part
        for _ in range(2):
            if rest.startswith("{"):
                close = _match_braces(rest, 0)
                if close is None:
                    break
                args.append(rest[: close + 1])
                rest = rest[close + 1:]
            elif rest and rest[0] not in "\\}":
                args.append("{" + rest[0] + "}")
                rest = rest[1:]
            else:
                break
        out += "".join(args) + rest
    return out


def _fix_a_slash_b(s: str) -> str:
    """`3/4` (integers only) -> `\\frac{3}{4}`: the MATH ground truths use \\frac."""
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def normalize_answer(answer: str) -> str:
    """A canonical string for comparing two final answers (light, value-preserving rewrites)."""
    s = str(answer).strip().replace("\n", "")
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "")
    s = s.replace("\\\\", "\\")
    s = s.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    # A trailing unit written `\text{ cm}` (leading space) is dropped; other \text{} unwrapped.
    s = re.sub(r"\\(?:text|mbox)\{\s[^{}]*\}\s*$", "", s).strip() or s
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.strip().rstrip(".").strip()
    # `x = 5` / `k=5`: a short variable name before a single `=` is not part of the value.
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs.strip()) <= 2:
        s = rhs.strip()
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    s = _fix_a_slash_b(s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # 1,000 -> 1000 (not tuples like 1,2)
        s = s.replace(",", "")
    return s


def is_equiv(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return normalize_answer(a) == normalize_answer(b)


def compute_score(
    solution_str: str,
    ground_truth: object,
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the last boxed answer matches, `format_score` if a boxed answer is present but
    wrong, 0.0 if there is none. A ground truth that is itself boxed is unboxed first."""
    answer = extract_boxed_answer(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    if "\\boxed" in truth or "\\fbox" in truth:
        truth = extract_boxed_answer(truth) or truth
    return float(score) if is_equiv(answer, truth) else float(format_score)
