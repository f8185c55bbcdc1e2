"""The tiny example's task: two-digit addition graded GSM8K-style, with a flawed teacher.

Why a flawed teacher: RL needs a starting policy that is often wrong greedily but can sample the
right answer. The teacher writing the SFT targets is right on additions without a carry and, on
additions whose units digits carry, drops the carry most of the time (57+68 -> 115). A model
trained on that mixture answers carry problems wrongly when greedy, yet still samples the correct
answer with decent probability: exactly what a correctness reward can fix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DATA_SOURCE = "tiny_arith"
LOW, HIGH = 10, 99  # operands are two-digit numbers: 90 * 90 = 8,100 distinct problems


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def carries(self) -> bool:
        """The units digits carry into the tens: the class the flawed teacher gets wrong."""
        return self.a % 10 + self.b % 10 >= 10

    @property
    def carry_dropped(self) -> int:
        """The teacher's wrong answer: tens and units added digit-wise, the units carry lost."""
        return (self.a // 10 + self.b // 10) * 10 + (self.a % 10 + self.b % 10) % 10


def format_response(answer: int) -> str:
    """The response format the GSM8K strict scorer grades: `#### <answer>`."""
    return f"#### {answer}"


def all_problems() -> list[Problem]:
    return [Problem(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]


def split_problems(seed: int, n_train: int, n_val: int, carry_fraction: float | None = None
                   ) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """Disjoint (train, val, rest) problem sets, drawn deterministically from `seed`.

    With `carry_fraction`, that share of train and val problems carry (the class the flawed
    teacher gets wrong), so the starting policy has plenty of room to improve; otherwise the
    natural share (45%). `rest` is everything else; the SFT data draws from train + rest (never
    val), so validation measures generalisation, not memorised facts.
    """
    problems = all_problems()
    if n_train + n_val > len(problems):
        raise ValueError(f"n_train + n_val = {n_train + n_val} exceeds the {len(problems)} problems")
    rng = random.Random(seed)
    rng.shuffle(problems)
    if carry_fraction is None:
        return problems[:n_train], problems[n_train:n_train + n_val], problems[n_train + n_val:]
    pools = {True: [p for p in problems if p.carries], False: [p for p in problems if not p.carries]}
    taken: dict[bool, int] = {True: 0, False: 0}

    def draw(n: int) -> list[Problem]:
        k = round(n * carry_fraction)
        out = []
        for cls, count in ((True, k), (False, n - k)):
            if taken[cls] + count > len(pools[cls]):
                raise ValueError(f"not enough {'carry' if cls else 'no-carry'} problems for carry_fraction={carry_fraction}")
            out += pools[cls][taken[cls]:taken[cls] + count]
            taken[cls] += count
        rng.shuffle(out)
        return out

    val = draw(n_val)
    train = draw(n_train)
    rest = pools[True][taken[True]:] + pools[False][taken[False]:]
    rng.shuffle(rest)
    return train, val, rest


def teacher_answer(p: Problem, rng: random.Random, drop_carry_prob: float) -> int:
    """The flawed teacher: right unless the units carry, then wrong with `drop_carry_prob`."""
    if p.carries and rng.random() < drop_carry_prob:
        return p.carry_dropped
    return p.answer


def prompt_messages(p: Problem) -> list[dict[str, str]]:
    return [{"role": "user", "content": p.question}]


def rl_row(p: Problem, split: str, index: int) -> dict:
    """One row in verl's RL schema."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": prompt_messages(p),
        "reward_model": {"ground_truth": str(p.answer), "style": "rule"},
        "extra_info": {"split": split, "index": index, "carry": p.carries},
    }


def sft_rows(problems: list[Problem], n_rows: int, seed: int, drop_carry_prob: float) -> list[dict]:
    """`n_rows` SFT rows (prompt messages + teacher response), problems drawn with replacement.

    Each draw asks the teacher anew, so a problem seen several times carries a mixture of right
    and wrong targets: the model learns a probability of carrying, not one memorised answer.
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(n_rows):
        p = problems[rng.randrange(len(problems))]
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": prompt_messages(p),
            "response": format_response(teacher_answer(p, rng, drop_carry_prob)),
            "reward_model": {"ground_truth": str(p.answer), "style": "rule"},
        })
    return rows
