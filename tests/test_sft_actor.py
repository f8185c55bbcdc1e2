"""`rlcore sft` trains on the actor worker through the shared update loop, so the actor's layout
applies to it as to RL: two FSDP2 ranks on Ray take the one-process steps, LoRA trains an adapter
and exports the merged model, the bad-step limit is the actor's setting. On the user's own Qwen2
(tests/own_model.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import train_on_ray  # tests/ is on sys.path (pytest rootdir conftest)
from safetensors.torch import load_file

from rlcore.checkpoint import CheckpointManager
from rlcore.cli import CONFIG_DIR, main

SFT_CONFIG = CONFIG_DIR / "tiny_sft.yaml"


def _args(own_model, out, *extra: str, model_dir=None) -> list[str]:
    return ["sft", str(SFT_CONFIG), f"model.path={model_dir or own_model.model_dir}", f"data.train_files=[{own_model.sft_file}]",
            "actor.optim.lr=3e-3", "actor.optim.warmup_steps=1", "trainer.batch_size=16",
            "actor.max_tokens_per_micro_batch=128", "trainer.loggers=[jsonl]", "trainer.device=cpu",
            f"trainer.output_dir={out}", *extra]


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _padded_vocabulary(own_model, folder):
    """The user's model with its vocabulary rows padded to a multiple of 8, as released models pad
    theirs (Qwen2's 151,936 rows for 151,665 tokens): 437 rows do not split over 2 ranks, 440 do."""
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(own_model.model_dir, folder)
    model = AutoModelForCausalLM.from_pretrained(own_model.model_dir)
    model.resize_token_embeddings(pad_to_multiple_of=8)
    assert model.config.vocab_size % 8 == 0 and model.config.tie_word_embeddings
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.distributed
def test_sft_on_two_fsdp_or_two_tensor_parallel_ranks_takes_the_one_process_steps(own_model, tmp_path):
    """On Ray, actor.world_size=2 (FSDP2 over gloo, each rank half of every batch) and
    actor.layout={tensor_parallel: 2} (each rank half of every layer's heads and MLP columns, the
    vocabulary split; tied embeddings): the loss and gradient norm of every step and the final
    weights are the one-process run's (float tolerance)."""
    pytest.importorskip("ray")
    steps = ["trainer.total_steps=3", "trainer.save_every=2"]
    model_dir = _padded_vocabulary(own_model, tmp_path / "model")
    assert main(_args(own_model, tmp_path / "one", *steps, model_dir=model_dir)) == 0
    one = _metrics(tmp_path / "one")
    assert one[-1]["train/loss"] < 0.9 * one[0]["train/loss"]  # it learns (6.13 -> 5.07 measured)
    w1 = load_file(tmp_path / "one" / "model" / "model.safetensors")
    for name, layout in (("fsdp2", "actor.world_size=2"), ("tp2", "actor.layout={tensor_parallel: 2}")):
        out = tmp_path / name
        train_on_ray(SFT_CONFIG, _args(own_model, out, *steps, "trainer.backend=ray", layout, "ray.num_cpus=2",
                                       model_dir=model_dir)[2:], command="sft")
        both = _metrics(out)
        assert [r["step"] for r in both] == [1, 2, 3], name
        for a, b in zip(one, both):
            assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5), name
            assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-4), name
            assert b["train/target_tokens"] == a["train/target_tokens"], name
        assert (CheckpointManager(out / "checkpoints").latest() / "actor_dcp").is_dir(), name  # sharded on two ranks
        w2 = load_file(out / "model" / "model.safetensors")  # the export: whole tensors, whatever the layout
        assert set(w1) == set(w2), name
        # 1e-4: a thirtieth of one Adam step (lr 3e-3). Adam divides by the root of the squared
        # gradient, so an element whose gradient is near 0 turns float-summation noise into a
        # visible move (2.6e-5 seen in 1 of 32,768 down_proj elements at tp2); a wrong shard is off by far more
        for key in w1:
            torch.testing.assert_close(w2[key], w1[key], atol=1e-4, rtol=0, msg=lambda m, key=key, name=name: f"{name}: {key}: {m}")


def test_a_tensor_parallel_size_the_model_cannot_take_is_refused_before_anything_loads(own_model, tmp_path, capsys):
    """The user's model has 437 vocabulary rows: tensor parallel 2 is refused at preflight, naming
    the key and the folder (exit 2), before Ray or a worker starts."""
    assert main(_args(own_model, tmp_path / "run", "trainer.backend=ray", "actor.layout={tensor_parallel: 2}")) == 2
    assert (f"actor.layout.tensor_parallel=2: the model's vocabulary (437) is not divisible by tensor_parallel=2 "
            f"({own_model.model_dir})") in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_lora_sft_trains_the_adapter_and_exports_the_merged_model(own_model, tmp_path):
    """actor.lora: the checkpoints hold the adapter (not the frozen base), and the output folder is
    the base with the adapter merged in, a plain Hugging Face model that scores the validation rows
    as the adapted actor did at the last step; its embeddings are the base's."""
    from transformers import AutoModelForCausalLM

    from rlcore.data import read_rows, write_rows
    from rlcore.data.sft import SFTDataset, collate_sft
    from rlcore.workers.tokenizer import end_token_ids, load_tokenizer

    val = write_rows(read_rows(own_model.sft_file)[:32], tmp_path / "val.parquet")
    out = tmp_path / "lora"
    assert main(_args(own_model, out, "trainer.total_steps=4", "trainer.val_every=4", f"data.val_files=[{val}]",
                      "actor.lora.rank=8", "actor.lora.alpha=16", "actor.optim.lr=3e-2")) == 0
    records = _metrics(out)
    assert records[-1]["val/loss"] < records[0]["val/loss"] and records[-1]["train/loss"] < records[1]["train/loss"]
    assert records[1]["actor/trainable_params"] < 0.2 * records[1]["actor/total_params"]
    checkpoint = CheckpointManager(out / "checkpoints").latest()
    assert (checkpoint / "actor_adapter" / "adapter_model.safetensors").is_file() and not (checkpoint / "actor").exists()
    assert not (out / "model" / "adapter_config.json").exists()
    base, tuned = load_file(own_model.model_dir / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert set(tuned) == set(base)
    assert torch.equal(tuned["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert not torch.equal(tuned["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    tok = load_tokenizer(str(out / "model"))
    batch = collate_sft(SFTDataset(val, tok, max_length=64, end_ids=end_token_ids(str(out / "model"))).examples,
                        tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["responses"], reduction="none")
    merged_loss = float((nll * batch["response_mask"]).sum() / batch["response_mask"].sum())
    assert merged_loss == pytest.approx(records[-1]["val/loss"], rel=1e-4)


@pytest.mark.slow
def test_the_bad_step_limit_is_the_actors_setting(own_model, tmp_path, capsys):
    """A learning rate that blows the weights up in the first step (the health guard's growth
    limit lifted, else it stops the run there): every later loss is non-finite, each step skipped
    with the weights left as they were, and the run stops at `actor.max_consecutive_bad_steps`."""
    out = tmp_path / "run"
    assert main(_args(own_model, out, "trainer.total_steps=6", "trainer.save_every=1", "actor.optim.lr=1e15",
                      "health.max_param_norm_growth=null", "actor.max_consecutive_bad_steps=2",
                      "trainer.val_before_train=false")) == 3  # stopped
    assert "2 steps in a row had a non-finite loss or gradient (limit actor.max_consecutive_bad_steps=2)" in capsys.readouterr().err
    records = _metrics(out)  # the stopping step is not logged (the guard runs before the log)
    assert [r["actor/bad_updates"] for r in records] == [0.0, 1.0] and records[-1]["train/bad_steps_total"] == 1
    checkpoints = CheckpointManager(out / "checkpoints")
    assert checkpoints.latest().name == "step_00000002"
    first, second = (load_file(checkpoints.root / f"step_0000000{s}" / "actor" / "model.safetensors") for s in (1, 2))
    assert all(torch.equal(first[k], second[k]) for k in first)  # the skipped step changed nothing


@pytest.mark.parametrize(("overrides", "message"), [
    (["actor.ppo_epochs=2"], "actor.ppo_epochs is an RL setting"),
    (["health.max_kl=0.5"], "health.max_kl reads a metric of RL runs"),
    (["actor.world_size=2"], "actor.world_size=2 needs trainer.backend=ray"),
    (["trainer.backend=ray", "actor.world_size=2", "trainer.batch_size=5"],
     "trainer.batch_size=5 is not a multiple of the actor's 2 data-parallel ranks"),
    (["trainer.backend=ray", "actor.world_size=2", "actor.ulysses_sequence_parallel_size=4"],
     "actor.ulysses_sequence_parallel_size=4 does not divide actor.world_size=2"),
    (["trainer.backend=ray", "actor.layout={tensor_parallel: 2}", "actor.lora.rank=4"],
     "actor.layout.tensor_parallel=2 with actor.lora: peft's adapter layers"),
    (["actor.cpu_offload=true", "trainer.device=cpu"], "actor.cpu_offload=true needs a CUDA device"),
    (["trainer.backend=ray", "ray.roles={rollout: default}"], "ray.roles.rollout: rlcore sft runs the actor alone"),
    (["model.share_prompt_prefix=true"], "model.share_prompt_prefix=true: SFT rows are whole sequences"),
])
def test_sft_settings_it_would_ignore_or_cannot_run_are_refused_at_load(tmp_path, overrides, message):
    from rlcore.config import ConfigError, load_sft_config

    with pytest.raises(ConfigError, match=message):
        load_sft_config(SFT_CONFIG, ["model.path=m", "data.train_files=[t.parquet]", *overrides])


def test_an_older_spelling_in_a_file_and_its_new_one_are_refused_together(tmp_path):
    from rlcore.config import ConfigError, load_sft_config

    both = tmp_path / "sft.yaml"
    both.write_text("model: {path: m}\ndata: {train_files: [t.parquet]}\noptim: {lr: 1.0e-4}\nactor: {optim: {lr: 2.0e-4}}\n")
    with pytest.raises(ConfigError, match="optim and actor.optim are the same setting"):
        load_sft_config(both)
