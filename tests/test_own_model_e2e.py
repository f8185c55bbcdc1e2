"""A user's own model, tokenizer, data and reward, end to end (tests/own_model.py: a Qwen2 with
grouped-query attention and tied embeddings, a byte-level BPE with ChatML, two end tokens, a
data source only the user's reward file scores):

1. `rlcore pipeline run --sft-data ... --sft-config ...` (on the session's Prefect server): SFT warm
   start -> GRPO (hf rollout) -> evaluate -> promote; RL learns what the flawed SFT teacher got
   wrong, and is promoted;
2. GRPO with the vLLM rollout from the same SFT model learns too;
3. the GRPO checkpoint served by a plain `vllm.LLM` on CPU (its own tokenizer, chat template and
   end tokens; the KV cache sized with kv_cache_memory_bytes) answers as rlcore's evaluation said.

The prompt ids agree between rlcore, transformers (AutoTokenizer, and `generate` with the
generation config's end tokens) and vLLM at every stage."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import prefect_env  # tests/ is on sys.path (pytest rootdir conftest)
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.pipeline,  # every test reads the pipeline's run
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 4  # an answer is one color token and an end token


def sft_config(own_model) -> dict:
    return {"model": {"path": str(own_model.model_dir)},
            "data": {"train_files": [str(own_model.sft_file)], "max_length": 64},
            "optim": {"lr": 3e-3, "warmup_steps": 10, "schedule": "cosine", "min_lr_ratio": 0.1},
            "trainer": {"total_steps": 200, "batch_size": 32, "save_every": 200, "val_every": 200, "loggers": ["jsonl"],
                        "device": "cpu"}}


def grpo_config(own_model) -> dict:
    tree = yaml.safe_load((ROOT / "rlcore" / "configs" / "tiny_grpo.yaml").read_text())
    tree["model"]["path"] = str(own_model.model_dir)
    tree["data"].update(train_files=[str(own_model.train_file)], val_files=[str(own_model.val_file)], max_prompt_length=64,
                        train_batch_size=16, val_batch_size=64)
    tree["actor"].update(ppo_mini_batch_size=16, optim={"lr": 5e-4, "warmup_steps": 2, "grad_clip": 1.0})
    tree["rollout"].update(backend="hf", n=8, max_new_tokens=MAX_NEW)
    tree["reward"] = {"function": own_model.reward_spec, "num_workers": 0}
    tree["trainer"].update(total_steps=12, save_every=12, val_every=12, loggers=["jsonl"], device="cpu")
    tree["registry"] = {"model_name": "own-colors"}
    return tree


@pytest.fixture(scope="module")
def pipeline(own_model, tmp_path_factory, shared_prefect_server):
    """The pipeline run's summary, and its work folder."""
    root = tmp_path_factory.mktemp("own_pipeline")
    (root / "sft.yaml").write_text(yaml.safe_dump(sft_config(own_model)))
    (root / "grpo.yaml").write_text(yaml.safe_dump(grpo_config(own_model)))
    env = dict(shared_prefect_server.env, **prefect_env(root / "prefect"), OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MLFLOW_TRACKING_URI", None)
    args = [sys.executable, "-m", "rlcore.cli", "pipeline", "run", "--json", "--config", str(root / "grpo.yaml"),
            "--sft-data", str(own_model.sft_file), "--sft-config", str(root / "sft.yaml"), "--output-dir", str(root / "work")]
    done = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=scaled(600))
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout), root


def score(own_model, texts: list[str], rows: list[dict]) -> float:
    from rlcore.rewards.registry import load_reward_fn

    fn = load_reward_fn(own_model.reward_spec)
    return sum(fn(r["data_source"], t, r["reward_model"]["ground_truth"], r["extra_info"]) for t, r in zip(texts, rows)) / len(rows)


def test_sft_then_grpo_in_the_pipeline_learns_and_is_promoted(own_model, pipeline):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcore.data import RLDataset, read_rows
    from rlcore.tracking import read_jsonl

    summary, _ = pipeline
    sft_model = Path(summary["sft_model"])
    assert summary["baseline"] == "base" and summary["champion"] is True, summary["reason"]
    before, after = summary["accuracy_before"], summary["accuracy_after"]  # the SFT model, then GRPO's candidate
    print(f"own model pipeline: SFT greedy val acc {before:.3f} -> GRPO (hf, {summary['steps']} steps) {after:.3f}")
    steps = [r for r in read_jsonl(Path(summary["run_dir"]) / "metrics.jsonl") if "response_length/clip_frac" in r]
    assert len(steps) == 12 and max(r["response_length/clip_frac"] for r in steps) < 0.05  # stopped on <|endoftext|>
    assert 0.2 <= before <= 0.65 and after >= before + 0.15, (before, after)

    # transformers, as a user runs the SFT model: AutoTokenizer's chat template, generate() with the
    # generation config's end tokens; the same prompt ids as rlcore's and the same greedy accuracy
    tok = AutoTokenizer.from_pretrained(sft_model)
    model = AutoModelForCausalLM.from_pretrained(sft_model).eval()
    rows = read_rows(own_model.val_file)
    dataset = RLDataset([own_model.val_file], tok, max_prompt_length=64)
    texts = []
    for row, item in zip(rows, dataset.items):
        ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        assert list(ids) == item.input_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW)
        texts.append(tok.decode(out[0, len(ids):], skip_special_tokens=True))
    assert score(own_model, texts, rows) == pytest.approx(before, abs=1.5 / len(rows))


@pytest.mark.vllm
def test_grpo_with_the_vllm_rollout_learns_from_the_sft_model(own_model, pipeline, tmp_path, capsys):
    from rlcore.cli import main
    from rlcore.tracking import read_jsonl

    summary, root = pipeline
    config = grpo_config(own_model)
    config["model"]["path"] = summary["sft_model"]
    config["rollout"].update(backend="vllm", vllm={"kv_cache_gib": 0.0625, "max_model_len": 128, "max_num_seqs": 128})
    config["trainer"].update(output_dir=str(tmp_path / "run"), total_steps=8, val_every=8, save_every=8)
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "grpo.yaml")]) == 0, capsys.readouterr().err
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    first, last = records[0]["val/acc"], records[-1]["val/acc"]
    print(f"own model GRPO (vLLM rollout, {records[-1]['step']} steps): val acc {first:.3f} -> {last:.3f}")
    # the answers end on <|endoftext|>, the generation config's second end token, not the tokenizer's EOS:
    # sampled responses stop there (one that did not would run to max_new_tokens)
    assert max(r["response_length/clip_frac"] for r in records[1:]) < 0.05
    assert first == pytest.approx(summary["accuracy_before"], abs=1.5 / 48)  # vLLM's greedy = rlcore's hf evaluation
    assert last >= first + 0.1, (first, last)


@pytest.mark.vllm
def test_the_grpo_checkpoint_served_in_vllm_answers_as_rlcore_evaluated_it(own_model, pipeline):
    import vllm

    from rlcore.checkpoint import CheckpointManager
    from rlcore.data import RLDataset, read_rows
    from rlcore.workers.tokenizer import load_tokenizer

    summary, _ = pipeline
    served = CheckpointManager(Path(summary["run_dir"]) / "checkpoints").latest() / "actor"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the in-process engine (FIELD_NOTES)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    llm = vllm.LLM(model=str(served), dtype="float32", max_model_len=128, enforce_eager=True, seed=0,
                   kv_cache_memory_bytes=64 * 2**20)  # without it vLLM asks for most of the machine's memory
    try:
        rows = read_rows(own_model.val_file)
        outs = llm.chat([r["prompt"] for r in rows], vllm.SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    rlcore_ids = [item.input_ids for item in RLDataset([own_model.val_file], load_tokenizer(str(served)), max_prompt_length=64)]
    assert [list(o.prompt_token_ids) for o in outs] == rlcore_ids
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)  # stopped on an end token, never ran on
    accuracy = score(own_model, [o.outputs[0].text for o in outs], rows)
    print(f"own model GRPO checkpoint served by vllm.LLM: val acc {accuracy:.3f}")
    assert accuracy == pytest.approx(summary["accuracy_after"], abs=1.5 / len(rows))
