"""Rule-based scorers, the format reward, the registry and reward-function loading."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlcore.rewards import (
    default_compute_score,
    format_reward,
    gsm8k,
    load_reward_fn,
    math_boxed,
    normalize_result,
    scores_to_token_rewards,
)

# --------------------------------------------------------------------------- gsm8k


@pytest.mark.parametrize(
    "text, expected",
    [
        ("So she has 72 left.\n#### 72", "72"),
        ("#### -5", "-5"),
        ("#### 1,234", "1234"),
        ("#### 3.50", "3.50"),
        ("#### $1,000.", "1000"),  # dollar sign and sentence period are not part of the number
        ("####72", "72"),
        ("first #### 1, then corrected #### 2", "2"),  # the last marked answer counts
        ("The answer is 72", None),  # strict needs the marker
        ("#### none", None),
        ("#### 5" + " and then some words" * 20, None),  # only the last 300 chars are searched
    ],
)
def test_gsm8k_strict_extraction(text, expected):
    assert gsm8k.extract_solution(text, "strict") == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3 apples and 4 pears make 7.", "7"),
        ("it is -12", "-12"),
        ("1,000 dollars in total", "1000"),
        ("value is 2.5 exactly", "2.5"),
        ("#### 9 (check: 4 + 5)", "5"),  # last number, marker or not
        ("Hello, world.", None),  # punctuation alone is not a number
        ("", None),
    ],
)
def test_gsm8k_flexible_extraction(text, expected):
    assert gsm8k.extract_solution(text, "flexible") == expected


def test_gsm8k_compute_score_cases():
    assert gsm8k.compute_score("#### 72", "72") == 1.0
    assert gsm8k.compute_score("#### 72", 72) == 1.0  # integer ground truth from parquet
    assert gsm8k.compute_score("#### 72.0", "72") == 1.0  # equal by value
    assert gsm8k.compute_score("#### 1,000", "1000") == 1.0
    assert gsm8k.compute_score("#### 73", "72") == 0.0
    assert gsm8k.compute_score("#### 73", "72", format_score=0.1) == pytest.approx(0.1)
    assert gsm8k.compute_score("72", "72", format_score=0.1) == 0.0  # nothing extracted
    assert gsm8k.compute_score("72", "72", method="flexible") == 1.0
    assert gsm8k.compute_score("#### -3", "-3", score=2.0) == 2.0
    assert gsm8k.compute_score("#### 18", "Janet sells 16 - 3 - 4 = 9 eggs...\n#### 18") == 1.0  # raw GSM8K answer


def test_gsm8k_bad_method_is_named():
    with pytest.raises(ValueError, match="'fuzzy'"):
        gsm8k.extract_solution("#### 1", "fuzzy")


# --------------------------------------------------------------------------- boxed


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"So the answer is $\boxed{42}$.", "42"),
        (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),
        (r"first \boxed{1}, finally \boxed{2}", "2"),
        (r"\fbox{3}", "3"),
        (r"\boxed{1} and later \fbox{x+1}", "x+1"),
        (r"$\boxed 7$", "7"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are not structural
        (r"\boxed{5} \boxedfoo", "5"),  # another command, not \boxed
        (r"\boxed{\frac{1}{2}", None),  # unclosed: truncated answer
        ("no box here", None),
    ],
)
def test_boxed_extraction(text, expected):
    assert math_boxed.extract_boxed_answer(text) == expected


@pytest.mark.parametrize(
    "a, b",
    [
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\frac1{72}", r"\frac{1}{72}"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        ("1/2", r"\frac{1}{2}"),
        (r"10\text{ cm}", "10"),
        (r"\text{(A)}", "(A)"),
        ("5.", "5"),
        ("$5$", "5"),
        ("x = 3", "3"),
        (r"3\!000", "3000"),
        ("1,000", "1000"),
        (r"90^\circ", "90"),
        (r"\sqrt2", r"\sqrt{2}"),
    ],
)
def test_boxed_normalisation_equivalences(a, b):
    assert math_boxed.is_equiv(a, b)


@pytest.mark.parametrize("a, b", [("0.5", r"\frac{1}{2}"), ("(1,2)", "(2,1)"), ("1,2", "12"), ("x+1", "x-1")])
def test_boxed_normalisation_keeps_different_answers_apart(a, b):
    assert not math_boxed.is_equiv(a, b)


def test_boxed_compute_score():
    assert math_boxed.compute_score(r"... so $\boxed{\dfrac{3}{4}}$.", r"\frac{3}{4}") == 1.0
    assert math_boxed.compute_score(r"\boxed{5}", "6") == 0.0
    assert math_boxed.compute_score(r"\boxed{5}", "6", format_score=0.1) == pytest.approx(0.1)
    assert math_boxed.compute_score("the answer is 6", "6", format_score=0.1) == 0.0
    assert math_boxed.compute_score(r"\boxed{6}", r"The answer is $\boxed{6}$") == 1.0  # boxed truth


# --------------------------------------------------------------------------- format


def test_format_presets_and_regex():
    assert format_reward("work... #### 12", "gsm8k") == 1.0
    assert format_reward("the answer is 12", "gsm8k") == 0.0
    assert format_reward(r"so \boxed{\frac{1}{2}}", "boxed") == 1.0
    assert format_reward(r"so \boxed{\frac{1}{2}", "boxed") == 0.0
    assert format_reward("<think>\n2+2\n</think>\n<answer>4</answer>", "think_answer") == 1.0
    assert format_reward("<answer>4</answer>", "think_answer") == 0.0
    assert format_reward("Final ANSWER: 42", r"answer:\s*\d+") == 0.0  # case matters
    assert format_reward("Final Answer: 42", r"Answer:\s*\d+") == 1.0
    assert format_reward("Final Answer: 42", r"Answer:\s*\d+", full_match=True) == 0.0
    assert format_reward("  Answer: 42\n", r"Answer:\s*\d+", full_match=True) == 1.0


def test_format_bad_regex_is_named():
    with pytest.raises(ValueError, match=r"'\(unclosed'"):
        format_reward("x", "(unclosed")


# --------------------------------------------------------------------------- registry


def test_default_compute_score_dispatch():
    assert default_compute_score("openai/gsm8k", "#### 5", "5") == 1.0
    assert default_compute_score("gsm8k", "5", "5") == 0.0  # strict: marker required
    assert default_compute_score("tiny_arith", "#### 125", "125") == 1.0
    assert default_compute_score("tiny_arith", "#### 115", "125") == 0.0
    assert default_compute_score("lighteval/MATH", r"\boxed{\frac12}", r"\frac{1}{2}") == 1.0
    assert default_compute_score("math", "#### 5", "5") == 0.0  # MATH sources read \boxed, not ####


def test_default_compute_score_unknown_source_is_named():
    with pytest.raises(NotImplementedError, match="data_source='my/dataset'"):
        default_compute_score("my/dataset", "x", "y")


USER_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "length": len(solution_str), "tag": "x"}

NOT_A_FUNCTION = 3
"""


def test_load_reward_fn_from_file_path(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(USER_FILE)
    fn = load_reward_fn(f"{tmp_path / 'my_reward.py'}:compute_score")
    assert fn(data_source="d", solution_str="ab", ground_truth="ab", extra_info=None)["length"] == 2
    monkeypatch.chdir(tmp_path)  # a relative path works too
    fn2 = load_reward_fn("./my_reward.py:compute_score")
    assert fn2(data_source="d", solution_str="ab", ground_truth="x")["score"] == 0.0


def test_load_reward_fn_from_module(tmp_path, monkeypatch):
    (tmp_path / "rlcore_test_reward_mod.py").write_text(USER_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_fn("rlcore_test_reward_mod:compute_score")
    assert fn(data_source="d", solution_str="1", ground_truth="1")["score"] == 1.0
    assert load_reward_fn("rlcore.rewards.registry:default_compute_score") is default_compute_score
    assert load_reward_fn(None) is default_compute_score


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon_here", "missing ':function'"),
        (":fn", "missing ':function'"),
        ("rlcore_no_such_module_xyz:fn", "cannot import module 'rlcore_no_such_module_xyz'"),
        ("rlcore.rewards.registry:nope", "has no attribute 'nope'"),
        ("rlcore.rewards.registry:not-a-name", "not a valid function name"),
        ("rlcore.rewards.gsm8k:CLIP_CHARS", "not a function"),
        ("/nonexistent/dir/reward.py:fn", "does not exist"),
        ("", "expected 'module:function'"),
    ],
)
def test_load_reward_fn_bad_specs_are_named(spec, message):
    with pytest.raises(ValueError) as err:
        load_reward_fn(spec)
    assert repr(spec) in str(err.value) and message in str(err.value)


def test_load_reward_fn_file_that_fails_to_import(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("x = 1 / 0\n")
    with pytest.raises(ValueError, match="ZeroDivisionError") as err:
        load_reward_fn(f"{bad}:fn")
    assert str(bad) in str(err.value)


def test_normalize_result():
    assert normalize_result(1) == (1.0, {})
    assert normalize_result(True) == (1.0, {})
    assert normalize_result(np.float32(0.5)) == (0.5, {})
    assert normalize_result(torch.tensor(0.25)) == (0.25, {})
    score, extras = normalize_result({"score": 1, "acc": True, "len": np.int64(3), "pred": "42", "nested": [1]})
    assert score == 1.0 and extras == {"acc": 1.0, "len": 3.0}  # non-numeric extras dropped
    with pytest.raises(ValueError, match="no 'score' key"):
        normalize_result({"acc": 1.0})
    with pytest.raises(TypeError, match="str"):
        normalize_result("1.0")
    with pytest.raises(ValueError, match="nan"):
        normalize_result(math.nan)


# --------------------------------------------------------------------------- token rewards


def test_scores_to_token_rewards_places_score_at_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    out = scores_to_token_rewards(np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32), mask)
    expected = torch.tensor([[0, 0, 1, 0], [2, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 4]], dtype=torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    assert torch.equal(scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask.bool()), expected)


def test_scores_to_token_rewards_shape_errors():
    with pytest.raises(ValueError, match="3 entries but response_mask has 2 rows"):
        scores_to_token_rewards([1.0, 2.0, 3.0], torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"\[N, R\]"):
        scores_to_token_rewards([1.0], torch.ones(4))
