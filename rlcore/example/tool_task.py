"""The tool example's task: four-digit additions, which the tiny model cannot do alone and a
`calculator` tool can, with a warm start that uses the tool only some of the time.

Why this task: it needs the tool for real. The SFT teacher answers most problems directly the way a
model that cannot carry would (digit by digit, every carry lost: right only when no column carries,
about one problem in six), and calls the calculator in the hermes format on the rest, copies its
result and is right. The warm-started model therefore calls the tool on only a fraction of its
samples and, decoding greedily, mostly answers directly and wrongly; a correctness reward is
exactly what teaches it to call the tool every time (`rlcore/configs/tiny_tool_grpo.yaml`).

A trajectory, in the tool tokenizer's chat template (`rlcore.example.tokenizer`):
`<|user|>1234+5678=<|end|><|assistant|><tool_call>{"name":"calculator","arguments":{"expression":
"1234+5678"}}</tool_call></s><|tool|>6912<|end|><|assistant|>#### 6912</s>`. The model writes the two
assistant turns; the tool turn (and the next assistant header) is rendered by the template and
masked out of the loss.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

DATA_SOURCE = "tiny_tool_arith"
LOW, HIGH = 1000, 9999
TOOL_NAME = "calculator"


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def expression(self) -> str:
        return f"{self.a}+{self.b}"

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def carries(self) -> bool:
        return self.answer != self.no_carry_sum

    @property
    def no_carry_sum(self) -> int:
        """Digit-by-digit sum with every carry lost (1234+5678 -> 6802): the teacher's direct answer."""
        out, place, a, b = 0, 1, self.a, self.b
        while a or b:
            out += ((a % 10 + b % 10) % 10) * place
            a, b, place = a // 10, b // 10, place * 10
        return out


def tool_call_text(expression: str) -> str:
    """An assistant turn that calls the calculator, hermes style, as compact JSON."""
    call = {"name": TOOL_NAME, "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def answer_text(answer: int | str) -> str:
    return f"#### {answer}"


def draw_problems(seed: int, n: int, exclude: set[Problem] = frozenset()) -> list[Problem]:  # type: ignore[assignment]
    """`n` distinct problems, none in `exclude`, drawn from `seed`."""
    rng = random.Random(seed)
    out: list[Problem] = []
    seen = set(exclude)
    while len(out) < n:
        p = Problem(rng.randint(LOW, HIGH), rng.randint(LOW, HIGH))
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def rl_row(p: Problem, split: str, index: int) -> dict:
    """One row in verl's RL schema (the tool's result is not given: the model must call it)."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": p.question}],
        "reward_model": {"ground_truth": str(p.answer), "style": "rule"},
        "extra_info": {"split": split, "index": index, "carry": p.carries},
    }


def sft_rows(problems: list[Problem], n_rows: int, seed: int, tool_prob: float) -> list[dict]:
    """`n_rows` multi-turn SFT rows (chat `messages`, every assistant turn trained on), problems drawn
    with replacement. With `tool_prob` the teacher calls the calculator and answers with its
    result; otherwise it answers directly, every carry lost."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n_rows):
        p = problems[rng.randrange(len(problems))]
        user = {"role": "user", "content": p.question}
        if rng.random() < tool_prob:
            messages = [user, {"role": "assistant", "content": tool_call_text(p.expression)},
                        {"role": "tool", "content": str(p.answer)},
                        {"role": "assistant", "content": answer_text(p.answer)}]
        else:
            messages = [user, {"role": "assistant", "content": answer_text(p.no_carry_sum)}]
        rows.append({"messages": messages})
    return rows
