"""`rlcore sft` on a user's own data (verl's SFT schema): labels on the response (or every assistant
turn) only, rendered as RL prompts are; bad rows named; token-budget packing that keeps the
gradient; a run that resumes exactly; an output folder an RL config starts from; the pipeline's
warm-start stage that reuses a finished SFT.

On the user's own Qwen2 with a byte-level BPE and ChatML (tests/own_model.py)."""

from __future__ import annotations

import json

import pytest
import torch
from own_model import ENDOFTEXT, IM_END  # tests/ is on sys.path (pytest rootdir conftest)

from rlcore.cli import CONFIG_DIR, main
from rlcore.config import ConfigError, load_sft_config, sft_config_from_dict
from rlcore.data import RLDataset, write_rows
from rlcore.data.schema import DataValidationError
from rlcore.data.sft import IGNORE_INDEX, SFTDataset, collate_sft, tokenize_messages, tokenize_prompt_response
from rlcore.workers.loading import load_causal_lm
from rlcore.workers.loops import GlobalCounts, MicroBatching
from rlcore.workers.policy import PolicyLogProbs
from rlcore.workers.sft import SFTObjective
from rlcore.workers.tokenizer import end_token_ids, load_tokenizer

SFT_CONFIG = CONFIG_DIR / "tiny_sft.yaml"


@pytest.fixture(scope="module")
def tok(own_model):
    return load_tokenizer(str(own_model.model_dir))


def test_prompt_response_labels_cover_the_response_and_its_end_token(own_model, tok):
    prompt = [{"role": "user", "content": "What color is the sky?"}]
    ids, labels = tokenize_prompt_response(prompt, "blue", tok)
    rl_ids = RLDataset([own_model.val_file], tok, max_prompt_length=64)[0].input_ids  # same rendering as RL prompts
    n = len(ids) - 2
    assert tok.convert_ids_to_tokens(ids[n:]) == ["blue", IM_END]  # the tokenizer's EOS appended
    assert labels == [IGNORE_INDEX] * n + ids[n:]
    assert tok.decode(ids[:n]).endswith("<|im_start|>assistant\n") and tok.convert_ids_to_tokens(rl_ids[-3:]) == \
        tok.convert_ids_to_tokens(ids[n - 3:n])
    # a response that already ends with one of the model's end tokens gets no second one
    ids, labels = tokenize_prompt_response(prompt, "blue" + ENDOFTEXT, tok, end_ids=end_token_ids(str(own_model.model_dir)))
    assert tok.convert_ids_to_tokens(ids[-2:]) == ["blue", ENDOFTEXT] and labels[-2:] == ids[-2:]


def test_messages_rows_train_on_every_assistant_turn_only(tok):
    messages = [{"role": "system", "content": "Answer with one word."}, {"role": "user", "content": "What color is the sky?"},
                {"role": "assistant", "content": "blue"}, {"role": "user", "content": "And the grass?"},
                {"role": "assistant", "content": "green"}]
    ids, labels = tokenize_messages(messages, tok)
    # the whole conversation as rendered, up to the last turn's end token: where a rollout of it stops
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False)[:-1]
    trained = [tok.convert_ids_to_tokens(t) for t, y in zip(ids, labels) if y != IGNORE_INDEX]
    assert trained == ["blue", IM_END, "green", IM_END]  # each turn's answer and its end token (the newline after is the template's)
    first_answer = labels.index(tok.convert_tokens_to_ids("blue"))
    generation_prompt = tok.apply_chat_template(messages[:2], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[:first_answer] == generation_prompt  # the context is the prompt RL samples with


def test_bad_rows_are_named_and_long_rows_follow_truncation(own_model, tok, tmp_path):
    rows = [{"prompt": "What color is the sky?", "response": "blue"}, {"prompt": 3, "response": "x"},
            {"prompt": "Hi", "response": ""}, {"prompt": "What color is the banana? " * 30, "response": "yellow"}]
    path = write_rows(rows, tmp_path / "sft.jsonl")
    with pytest.raises(DataValidationError) as err:
        SFTDataset(path, tok, max_length=64)
    text = str(err.value)
    assert "row 1: field 'prompt'" in text and "row 2: field 'response': expected a non-empty string" in text
    kept = SFTDataset(path, tok, max_length=64, on_bad_row="skip", truncation="drop")
    assert len(kept) == 1 and kept.stats["bad_rows"] == 2 and kept.stats["too_long"] == 1
    with pytest.raises(DataValidationError, match=r"row 3: field 'prompt\+response': \d+ tokens, longer than max_length=64"):
        SFTDataset(path, tok, max_length=64, on_bad_row="skip")
    cut = SFTDataset(path, tok, max_length=64, on_bad_row="skip", truncation="right")
    assert len(cut) == 1 and cut.stats["truncated"] == 0  # the long prompt leaves no response token: a bad row
    assert cut.stats["bad_rows"] == 3
    with pytest.raises(Exception, match="needs a 'messages' column, or 'question' and 'answer'"):
        SFTDataset(path, tok, max_length=64, prompt_key="question", response_key="answer")


def test_packed_micro_batches_fit_the_budget_and_give_the_whole_batchs_gradient(own_model, tok):
    """The actor's SFT step as `update_sft` runs it: micro-batches packed to the token budget
    (`MicroBatching`), each one's summed loss over the batch's labelled tokens (`SFTObjective`)."""
    cpu = torch.device("cpu")
    data = SFTDataset(own_model.sft_file, tok, max_length=64, end_ids=end_token_ids(str(own_model.model_dir)))
    examples = data.examples[:24]
    batch = collate_sft(examples, tok.pad_token_id)
    tokens = batch["attention_mask"].sum(-1)
    model = load_causal_lm(own_model.model_dir, "float32", cpu)
    micro = MicroBatching(len(examples), dynamic=True, max_tokens=128).split(tokens, model, cpu)
    assert len(micro) > 3 and all(int(tokens[mb].sum()) <= 128 for mb in micro)
    assert sorted(int(tokens[mb].sum()) for mb in micro)[-1] > 100  # packed, not one sequence each
    whole = [list(range(len(examples)))]
    grads, losses = [], []
    for split in (whole, micro):
        model = load_causal_lm(own_model.model_dir, "float32", cpu)
        targets = float(batch["response_mask"].sum())
        loss_of = SFTObjective(PolicyLogProbs(1.0, 1024, "torch"), model)(batch, GlobalCounts(targets, float(len(batch))))
        loss = 0.0
        for mb in split:
            share = loss_of(batch.take(mb)).loss
            share.backward()
            loss += float(share.detach())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        losses.append(loss)
    assert targets == sum(e.num_targets for e in examples) == 2 * len(examples)  # color + <|endoftext|>
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-6, rtol=1e-4)
    # the mean token loss transformers' own forward gives on the padded batch
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["responses"], reduction="none")
    assert losses[0] == pytest.approx(float((nll * batch["response_mask"]).sum() / targets), rel=1e-5)


def test_config_keys_and_paths_are_checked_before_anything_loads(own_model, tmp_path, capsys):
    base = [f"model.path={own_model.model_dir}", f"data.train_files=[{own_model.sft_file}]"]
    with pytest.raises(ConfigError, match="trainer.batch_sizee: unknown key"):
        load_sft_config(SFT_CONFIG, [*base, "trainer.batch_sizee=3"])
    assert main(["sft", str(SFT_CONFIG), *base, f"data.train_files=[{own_model.train_file}]",
                 f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "data.train_files[0]:" in err and "rows here need (messages) or (prompt, response)" in err
    assert not (tmp_path / "run").exists()
    # a loaded config survives a dump and reload (the pipeline passes configs as dicts): its
    # default RL-only keys are not mistaken for settings, one that was set still is
    loaded = load_sft_config(SFT_CONFIG, base)
    assert sft_config_from_dict(loaded.model_dump(mode="json")) == loaded
    with pytest.raises(ConfigError, match="actor.ppo_epochs is an RL setting"):
        sft_config_from_dict({**loaded.model_dump(mode="json"), "actor": {"ppo_epochs": 2}})


@pytest.mark.slow
def test_rlcore_sft_learns_resumes_exactly_and_writes_a_folder_rl_starts_from(own_model, tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    val = write_rows([{"prompt": r["prompt"], "response": r["response"]} for r in _rows(own_model)[:64]], tmp_path / "val.parquet")
    args = [f"model.path={own_model.model_dir}", f"data.train_files=[{own_model.sft_file}]", f"data.val_files=[{val}]",
            "optim.lr=3e-3", "optim.warmup_steps=1", "trainer.batch_size=16", "trainer.max_tokens_per_micro_batch=256", "trainer.save_every=3",
            "trainer.val_every=6", "trainer.loggers=[jsonl]", "trainer.device=cpu"]
    assert main(["sft", str(SFT_CONFIG), *args, "trainer.total_steps=6", f"trainer.output_dir={tmp_path / 'once'}"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["model"] == str((tmp_path / "once" / "model").resolve()) and summary["steps"] == 6
    records = [json.loads(line) for line in (tmp_path / "once" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(7))
    assert records[-1]["val/loss"] < 0.75 * records[0]["val/loss"]  # it learns (6.1 -> 3.9 measured)
    assert all(r["train/micro_batches"] >= 2 for r in records[1:])  # 16 rows of ~24 tokens in 256-token packs

    # a run killed after its step-3 checkpoint resumes from it to the same weights and log
    import shutil

    once = load_file(tmp_path / "once" / "model" / "model.safetensors")
    shutil.rmtree(tmp_path / "once" / "checkpoints" / "step_00000006")
    shutil.rmtree(tmp_path / "once" / "model")
    assert main(["sft", str(SFT_CONFIG), *args, "trainer.total_steps=6", f"trainer.output_dir={tmp_path / 'once'}"]) == 0
    again = load_file(tmp_path / "once" / "model" / "model.safetensors")
    assert all(torch.equal(once[k], again[k]) for k in once)
    resumed = [json.loads(line) for line in (tmp_path / "once" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == list(range(7)) and resumed[-1]["train/loss"] == records[-1]["train/loss"]

    out = tmp_path / "once" / "model"
    assert (out / "tokenizer.json").read_bytes() == (own_model.model_dir / "tokenizer.json").read_bytes()
    assert end_token_ids(str(out)) == end_token_ids(str(own_model.model_dir))  # generation_config kept
    AutoModelForCausalLM.from_pretrained(out)
    from rlcore.config import load_config
    from rlcore.trainer.preflight import preflight

    preflight(load_config(CONFIG_DIR / "tiny_grpo.yaml", [f"model.path={out}", f"data.train_files=[{own_model.train_file}]",
                                                         "data.val_files=[]", f"reward.function={own_model.reward_spec}",
                                                         f"trainer.output_dir={tmp_path / 'rl'}"]))


@pytest.mark.slow
@pytest.mark.pipeline  # the lifecycle's SFT warm-start stage
def test_pipeline_warm_start_stage_trains_once_per_inputs(own_model, tmp_path):
    from rlcore.config import load_config
    from rlcore.lifecycle.stages import sft_stage

    config = load_config(CONFIG_DIR / "tiny_grpo.yaml", [f"model.path={own_model.model_dir}",
                                                         f"data.train_files=[{own_model.train_file}]"])
    sft = {"data_path": str(own_model.sft_file), "config_path": str(SFT_CONFIG),
           "overrides": ["trainer.total_steps=2", "trainer.batch_size=8", "trainer.loggers=[jsonl]", "trainer.device=cpu"]}
    first = sft_stage(config, sft, tmp_path)
    assert not first["cached"] and first["steps"] == 2 and first["model_dir"].startswith(str(tmp_path / "sft"))
    again = sft_stage(config, sft, tmp_path)
    assert again["cached"] and again["model_dir"] == first["model_dir"]
    other = sft_stage(config, {**sft, "overrides": [*sft["overrides"], "optim.lr=1e-3"]}, tmp_path)
    assert not other["cached"] and other["model_dir"] != first["model_dir"]  # other settings: another warm start


def _rows(own_model) -> list[dict]:
    from rlcore.data import read_rows

    return read_rows(own_model.sft_file)


def test_pipeline_refuses_a_bad_warm_start_config_before_prefect_starts(own_model, tmp_path, capsys):
    bad = tmp_path / "sft.yaml"
    bad.write_text("trainer: {batchsize: 3}\n")
    args = ["pipeline", "run", "--config", str(CONFIG_DIR / "tiny_grpo.yaml"), "--sft-data", str(own_model.sft_file),
            "--sft-config", str(bad), "--output-dir", str(tmp_path / "work"), f"model.path={own_model.model_dir}"]
    assert main(args) == 2
    assert "--sft-config/--sft-data: invalid config: trainer.batchsize: unknown key" in capsys.readouterr().err
    assert main([*args[:4], "--sft-data", str(tmp_path / "nope.parquet"), *args[8:]]) == 2
    assert "--sft-data: no such file" in capsys.readouterr().err
