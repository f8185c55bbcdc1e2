"""The built-in tiny example: task, tokenizer round trip, atomic cached deterministic builds."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlcore.example import build as build_mod
from rlcore.example.build import COMPLETE, Recipe, build_tiny_example, default_example_dir
from rlcore.example.evaluate import extract_answer
from rlcore.example.model import TinyModelSpec
from rlcore.example.task import Problem, sft_rows, split_problems
from rlcore.example.tokenizer import build_tokenizer

# A build that takes a few seconds: same code path, far fewer steps and problems.
QUICK = Recipe(n_train=64, n_val=16, sft_steps=6, sft_batch_size=8, eval_n=2,
               model=TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))


def test_problem_carry_and_flawed_answer():
    assert Problem(57, 68).carries and Problem(57, 68).answer == 125 and Problem(57, 68).carry_dropped == 115
    assert Problem(45, 55).carry_dropped == 90
    assert not Problem(12, 35).carries and Problem(12, 35).question == "12+35="


def test_splits_are_disjoint_and_seeded():
    train, val, rest = split_problems(3, 1000, 200)
    assert len(set(train) | set(val) | set(rest)) == len(train) + len(val) + len(rest)
    assert not set(train) & set(val)
    assert split_problems(3, 1000, 200) == (train, val, rest) and split_problems(4, 1000, 200)[1] != val


def test_carry_heavy_split_has_the_asked_share_and_covers_everything():
    train, val, rest = split_problems(0, 4000, 400, carry_fraction=0.7)
    assert (sum(p.carries for p in train), sum(p.carries for p in val)) == (2800, 280)
    assert len(set(train) | set(val) | set(rest)) == len(train) + len(val) + len(rest) == 8100
    assert split_problems(0, 4000, 400, carry_fraction=0.7)[1] == val
    with pytest.raises(ValueError, match="not enough carry problems"):
        split_problems(0, 6000, 400, carry_fraction=0.7)


def test_flawed_teacher_drops_the_carry_at_the_set_rate():
    problems = [Problem(a, b) for a in range(10, 100) for b in range(10, 100)]
    rows = sft_rows(problems, 6000, seed=0, drop_carry_prob=0.65)
    wrong = {True: [0, 0], False: [0, 0]}
    for r in rows:
        a, b = map(int, r["prompt"][0]["content"].rstrip("=").split("+"))
        p = Problem(a, b)
        got = int(r["response"].removeprefix("#### "))
        assert got in (p.answer, p.carry_dropped)
        wrong[p.carries][0] += got != p.answer
        wrong[p.carries][1] += 1
    assert wrong[False][0] == 0
    assert 0.62 < wrong[True][0] / wrong[True][1] < 0.68  # ~2,700 carry rows: 3 sigma ~ 0.027


@pytest.mark.parametrize("text,want", [("#### 47", "47"), ("x #### -3 y #### 5", "-3"), ("#### 1,234", "1234"),
                                        ("47", None), ("####47", None)])
def test_extract_answer_gsm8k_strict(text, want):
    assert extract_answer(text) == want


def test_tokenizer_round_trips_through_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    LlamaConfig(vocab_size=112).save_pretrained(tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    fast = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    texts = ["12+35=", "#### 125", "Hello, World!\n  x  ", "<s><|user|>7+8=<|end|><|assistant|>#### 15</s>", "~`|{}"]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert auto(text, add_special_tokens=False)["input_ids"] == ids
        assert fast(text, add_special_tokens=False)["input_ids"] == ids
        assert auto.decode(ids) == text
    assert auto.convert_ids_to_tokens(tok("#### 125")["input_ids"]) == ["####", " ", "1", "2", "5"]
    assert auto.decode(tok("#### 12</s>")["input_ids"], skip_special_tokens=True) == "#### 12"
    assert auto.padding_side == "left"
    assert (auto.pad_token_id, auto.bos_token_id, auto.eos_token_id) == (0, 1, 2)
    msgs = [{"role": "user", "content": "1+2="}]
    for t in (auto, fast):
        assert t.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == "<s><|user|>1+2=<|end|><|assistant|>"
        assert t.padding_side == "left" and t.pad_token_id == 0
    assert auto.convert_ids_to_tokens(tok("é")["input_ids"]) == ["<unk>"]


def test_quick_build_is_deterministic_cached_and_loadable(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = build_tiny_example(tmp_path / "a", seed=1, recipe=QUICK)
    b = build_tiny_example(tmp_path / "b", seed=1, recipe=QUICK)
    wa, wb = load_file(a.model_dir / "model.safetensors"), load_file(b.model_dir / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (a.train_file.read_bytes(), a.sft_file.read_bytes()) == (b.train_file.read_bytes(), b.sft_file.read_bytes())
    assert (a.sft_greedy_accuracy, a.sft_pass_at_n) == (b.sft_greedy_accuracy, b.sft_pass_at_n)
    c = build_tiny_example(tmp_path / "c", seed=2, recipe=QUICK)
    assert not torch.equal(load_file(c.model_dir / "model.safetensors")["model.embed_tokens.weight"], wa["model.embed_tokens.weight"])

    # Cached: a second call never builds.
    monkeypatch.setattr(build_mod, "_build_into", lambda *a, **k: pytest.fail("rebuilt a complete example"))
    again = build_tiny_example(tmp_path / "a", seed=1, recipe=QUICK)
    assert again.model_dir == a.model_dir and again.sft_greedy_accuracy == a.sft_greedy_accuracy
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]  # no temp folders left

    model = AutoModelForCausalLM.from_pretrained(a.model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(a.model_dir, local_files_only=True)
    assert model.config.model_type == "llama" and model.config.vocab_size == a.vocab_size >= len(tok)
    torch.testing.assert_close(model.state_dict()["model.embed_tokens.weight"], wa["model.embed_tokens.weight"])


def test_failed_or_partial_builds_are_never_used(tmp_path, monkeypatch):
    out = tmp_path / "ex"
    out.mkdir()
    (out / "junk").write_text("from an interrupted build")  # no .complete marker

    def boom(*args, **kwargs):
        raise RuntimeError("SFT crashed")

    monkeypatch.setattr(build_mod, "run_sft", boom)
    with pytest.raises(RuntimeError, match="SFT crashed"):
        build_tiny_example(out, seed=0, recipe=QUICK)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ex"]  # the temp folder was cleaned up
    monkeypatch.undo()
    ex = build_tiny_example(out, seed=0, recipe=QUICK)  # the stale folder is replaced
    assert (out / COMPLETE).exists() and not (out / "junk").exists() and ex.root == out.resolve()


def test_default_dir_follows_rlcore_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RLCORE_CACHE", str(tmp_path))
    assert default_example_dir(3) == tmp_path / "examples" / f"tiny-v{build_mod.BUILDER_VERSION}-seed3"
