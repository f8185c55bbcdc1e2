"""The built-in tiny example: task, tokenizer round trip, atomic cached deterministic builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlcore.example import build as build_mod
from rlcore.example.build import (
    COMPLETE,
    Recipe,
    TinyExample,
    build_tiny_example,
    default_example_dir,
    load_tiny_example,
    weights_sha256,
)
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


@pytest.mark.slow  # four quick builds, two of them in fresh processes (~16 CPU-s measured)
def test_quick_build_is_deterministic_cached_and_loadable(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = build_tiny_example(tmp_path / "a", seed=1, recipe=QUICK)
    b = build_tiny_example(tmp_path / "b", seed=1, recipe=QUICK)
    wa, wb = load_file(a.model_dir / "model.safetensors"), load_file(b.model_dir / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a.weights_sha256 == b.weights_sha256 == weights_sha256(a.model_dir)  # the manifest names the file
    assert a.pinned and a.float_env["aten_cpu_capability"] == "DEFAULT" and a.float_env["threads"] == "1"
    assert (a.train_file.read_bytes(), a.sft_file.read_bytes()) == (b.train_file.read_bytes(), b.sft_file.read_bytes())
    assert (a.sft_greedy_accuracy, a.sft_pass_at_n) == (b.sft_greedy_accuracy, b.sft_pass_at_n)
    # Another seed, other weights (built in this process, to save a process start).
    c1 = build_tiny_example(tmp_path / "c1", seed=1, recipe=QUICK, pinned=False)
    c2 = build_tiny_example(tmp_path / "c2", seed=2, recipe=QUICK, pinned=False)
    assert not c1.pinned and c1.float_env["aten_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert c2.weights_sha256 != c1.weights_sha256
    assert c2.train_file.read_bytes() != c1.train_file.read_bytes()

    # Cached: a second call never builds (a build starts its pinned process).
    monkeypatch.setattr(build_mod.subprocess, "Popen", lambda *a, **k: pytest.fail("rebuilt a complete example"))
    again = build_tiny_example(tmp_path / "a", seed=1, recipe=QUICK)
    assert again.model_dir == a.model_dir and again.sft_greedy_accuracy == a.sft_greedy_accuracy
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c1", "c2"]  # no temp folders left
    monkeypatch.undo()

    model = AutoModelForCausalLM.from_pretrained(a.model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(a.model_dir, local_files_only=True)
    assert model.config.model_type == "llama" and model.config.vocab_size == a.vocab_size >= len(tok)
    torch.testing.assert_close(model.state_dict()["model.embed_tokens.weight"], wa["model.embed_tokens.weight"])


@pytest.mark.slow  # a build process that fails, then a build (~8 CPU-s measured)
def test_failed_or_partial_builds_are_never_used(tmp_path):
    out = tmp_path / "ex"
    out.mkdir()
    (out / "junk").write_text("from an interrupted build")  # no .complete marker
    # No SFT rows: SFT fails inside the build process, and its error reaches the caller.
    with pytest.raises(RuntimeError, match="run_warm_start got no rows"):
        build_tiny_example(out, seed=0, recipe=replace(QUICK, sft_steps=0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ex"]  # the temp folder was cleaned up
    assert load_tiny_example(out) is None
    ex = build_tiny_example(out, seed=0, recipe=QUICK, pinned=False)  # the stale folder is replaced
    assert (out / COMPLETE).exists() and not (out / "junk").exists() and ex.root == out.resolve()


def _other_machine_env() -> dict[str, str]:
    """This process's environment made to look like another x86-64 machine to torch, MKL and glibc:
    other ATen kernels than this CPU's own, MKL limited to AVX2, two threads, libm without its
    AVX2/FMA variants."""
    native = torch.backends.cpu.get_cpu_capability()
    other = {"AVX512": "avx2", "AVX2": "default"}.get(native)
    if other is None:
        pytest.skip(f"no other ATen kernel set to emulate on a CPU running {native}")
    return dict(os.environ, ATEN_CPU_CAPABILITY=other, MKL_ENABLE_INSTRUCTIONS="AVX2", MKL_CBWR="AUTO",
                OMP_NUM_THREADS="2", MKL_NUM_THREADS="2", GLIBC_TUNABLES="glibc.cpu.hwcaps=-AVX2,-AVX2_Usable",
                PYTHONPATH=str(Path(build_mod.__file__).resolve().parents[2]))


def _build_elsewhere(out: Path, env: dict[str, str], pinned: bool) -> TinyExample:
    """The QUICK example built by a separate Python process with environment `env`."""
    code = ("import json, sys; from rlcore.example.build import Recipe, build_tiny_example; "
            "build_tiny_example(sys.argv[1], seed=1, recipe=Recipe.from_json(json.loads(sys.argv[2])), "
            f"pinned={pinned})")
    done = subprocess.run([sys.executable, "-c", code, str(out), json.dumps(QUICK.to_json())], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return load_tiny_example(out)


@pytest.mark.slow  # four quick builds, three of them in fresh processes (~30 s)
def test_pinned_build_reproduces_its_weights_under_another_machines_settings(tmp_path):
    other = _other_machine_env()
    # Without the pin, the other machine's settings give other weights: the check below can fail.
    here = build_tiny_example(tmp_path / "here", seed=1, recipe=QUICK, pinned=False)
    there = _build_elsewhere(tmp_path / "there", other, pinned=False)
    assert there.float_env["aten_cpu_capability"] != here.float_env["aten_cpu_capability"]
    assert there.weights_sha256 != here.weights_sha256
    # With it (the default), the weights are bit-identical, and so is the hash in the manifest.
    pinned_here = build_tiny_example(tmp_path / "pinned-here", seed=1, recipe=QUICK)
    pinned_there = _build_elsewhere(tmp_path / "pinned-there", other, pinned=True)
    assert pinned_there.float_env == pinned_here.float_env
    assert pinned_there.weights_sha256 == pinned_here.weights_sha256 == weights_sha256(pinned_there.model_dir)


def test_default_dir_follows_rlcore_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RLCORE_CACHE", str(tmp_path))
    assert default_example_dir(3) == tmp_path / "examples" / f"tiny-v{build_mod.BUILDER_VERSION}-seed3"
