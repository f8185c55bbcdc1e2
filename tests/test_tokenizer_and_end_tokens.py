"""One tokenizer everywhere, and every end token honoured, on a user's own Qwen2 folder
(tests/own_model.py: byte-level BPE with ChatML, generation_config listing two end tokens).

- rlcore loads tokenizers as AutoTokenizer does (what vLLM and users' code do), and the ids of a
  prompt agree between rlcore, AutoTokenizer, the folder's tokenizer.json and vLLM;
- a folder whose tokenizer.json loads differently through AutoTokenizer (Qwen2Tokenizer swaps
  its pre-tokenizer) is refused at start-up, naming the file, the row and both id lists;
- rollouts, the reward's text, evaluation and the served pyfunc model stop at the first of the
  model's end tokens, the generation config's as well as the tokenizer's (the vLLM rollout and
  vLLM serving do too: tests/test_own_model_e2e.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from own_model import IM_END, build_mismatched_tokenizer_folder  # tests/ is on sys.path (pytest rootdir conftest)

from rlcore.config import config_from_dict, role_spec
from rlcore.data import RLDataset, collate_prompts, read_rows
from rlcore.protocol import Batch
from rlcore.rollout import HFRolloutEngine, SamplingParams
from rlcore.workers.tokenizer import cut_at_end, end_token_ids, load_tokenizer

MAX_NEW = 12
GREEDY = SamplingParams(n=1, do_sample=False, max_new_tokens=MAX_NEW)


def run_config(model_dir: Path, train_file: Path, out: Path, **sections) -> dict:
    tree = {"model": {"path": str(model_dir)}, "data": {"train_files": [str(train_file)], "max_prompt_length": 64},
            "trainer": {"output_dir": str(out), "device": "cpu"}, "reward": {"num_workers": 0}}
    for key, value in sections.items():
        tree.setdefault(key, {}).update(value)
    return tree


def test_rlcore_tokenizes_prompts_as_auto_tokenizer_and_the_file_do(own_model):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = str(own_model.model_dir)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(str(own_model.model_dir / "tokenizer.json"))
    assert type(ours) is type(auto) and type(auto).__name__ == "Qwen2Tokenizer"
    dataset = RLDataset([own_model.val_file], ours, max_prompt_length=64)
    rows = read_rows(own_model.val_file)
    assert len(dataset) == len(rows) == 48
    merged = 0
    for item, row in zip(dataset.items, rows):
        theirs = auto.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        assert item.input_ids == list(theirs) == raw.encode(item.raw_prompt, add_special_tokens=False).ids
        assert auto.decode(item.input_ids) == item.raw_prompt  # ids round-trip to the rendered text
        merged += sum(len(t) > 2 for t in auto.convert_ids_to_tokens(item.input_ids))
    assert merged > 5 * len(rows)  # a real BPE: most words are one merged token ("Ġcolor", "Ġbanana")


def test_end_tokens_are_the_tokenizers_and_the_generation_configs(own_model, tmp_path):
    tok = load_tokenizer(str(own_model.model_dir))
    assert tok.eos_token == IM_END
    assert end_token_ids(str(own_model.model_dir)) == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    # no generation_config.json: config.json's eos (what transformers' generate falls back to)
    folder = tmp_path / "m"
    shutil.copytree(own_model.model_dir, folder)
    (folder / "generation_config.json").unlink()
    assert end_token_ids(str(folder)) == [tok.eos_token_id]
    assert cut_at_end([5, 6, 0, 7, 2], [2, 0]) == [5, 6] and cut_at_end([5, 6], [2]) == [5, 6]


def test_a_folder_whose_tokenizer_json_loads_differently_is_refused_at_start_up(own_model, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from rlcore.trainer.run import make_trainer
    from rlcore.trainer.tokenizer_check import TokenizerMismatchError

    folder = build_mismatched_tokenizer_folder(tmp_path / "mismatched")
    tree = run_config(folder, own_model.train_file, tmp_path / "run", rollout={"backend": "hf"},
                      reward={"function": own_model.reward_spec})
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: pytest.fail("a model was loaded before the tokenizer check"))
    with pytest.raises(TokenizerMismatchError) as err:
        make_trainer(config_from_dict(tree))
    message = str(err.value)
    assert "tokenizer.json loaded as the file and through AutoTokenizer (Qwen2Tokenizer" in message
    assert "tokenize 32 of 32 sampled prompts differently, e.g. data.train_files[0] row 0" in message
    assert "data.tokenizer_check_rows=0" in message and not (tmp_path / "run").exists()
    # the advice works: re-saved through AutoTokenizer, the file says what AutoTokenizer builds
    AutoTokenizer.from_pretrained(folder).save_pretrained(folder)
    load_tokenizer.cache_clear()
    from rlcore.trainer.tokenizer_check import check_run_tokenization

    check_run_tokenization(config_from_dict(tree))


def test_start_up_check_sees_rlcore_loading_another_tokenizer_than_the_serving_side(own_model, tmp_path, monkeypatch):
    """What rlcore did before: tokenizer.json as PreTrainedTokenizerFast, while AutoTokenizer (and
    vLLM) build Qwen2Tokenizer: on the mismatched folder every prompt gets other ids."""
    from transformers import PreTrainedTokenizerFast

    from rlcore.trainer.tokenizer_check import TokenizerMismatchError, check_run_tokenization

    folder = build_mismatched_tokenizer_folder(tmp_path / "mismatched", with_weights=False)
    monkeypatch.setattr("rlcore.trainer.tokenizer_check.load_tokenizer",
                        lambda path: PreTrainedTokenizerFast.from_pretrained(path))
    tree = run_config(folder, own_model.train_file, tmp_path / "run", rollout={"backend": "hf"},
                      data={"val_files": [str(own_model.val_file)], "tokenizer_check_rows": 4})
    with pytest.raises(TokenizerMismatchError, match=r"rlcore and AutoTokenizer tokenize 8 of 8 sampled prompts"):
        check_run_tokenization(config_from_dict(tree))
    check_run_tokenization(config_from_dict({**tree, "data": {**tree["data"], "tokenizer_check_rows": 0}}))


# ----------------------------------------------------------------------------- end tokens
@pytest.fixture(scope="module")
def two_end_model(own_model, tmp_path_factory):
    """A random fixture-shaped model (weights spread wide, so its greedy answers vary) whose
    generation_config also declares as an end token a token it emits early on its own, so that
    token must end responses: (folder, prompts batch, the greedy tokens without any end token, the
    end ids, where the first response must stop)."""
    from own_model import save_qwen2_model

    folder = tmp_path_factory.mktemp("two_end") / "model"
    save_qwen2_model(load_tokenizer(str(own_model.model_dir)), folder, seed=1, initializer_range=0.5)
    tok = load_tokenizer(str(folder))
    dataset = RLDataset([own_model.val_file], tok, max_prompt_length=64)
    items = dataset.items[:6]
    batch = collate_prompts(items, tok.pad_token_id, [f"u{i}" for i in range(len(items))])
    free = HFRolloutEngine.from_pretrained(str(folder), eos_token_ids=[]).generate(
        batch, SamplingParams(do_sample=False, max_new_tokens=MAX_NEW))["responses"]
    first = free[0].tolist()
    stop = next(p for p in range(1, MAX_NEW) if first[p] not in first[:p] and first[p] != tok.eos_token_id)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [tok.eos_token_id, first[stop]]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    ends = end_token_ids(str(folder))
    assert ends == [tok.eos_token_id, first[stop]]
    return folder, batch, free, ends, stop + 1


def expected_lengths(free: torch.Tensor, ends: list[int]) -> list[int]:
    return [next((i + 1 for i, t in enumerate(row.tolist()) if t in ends), len(row)) for row in free]


def rollout(config_tree: dict, batch: Batch) -> Batch:
    from rlcore.workers.rollout import RolloutWorker

    worker = RolloutWorker(role_spec(config_from_dict(config_tree), "rollout"))
    worker.setup()
    try:
        return worker.generate_sequences(batch, GREEDY)
    finally:
        worker.shutdown()


def check_stops(out: Batch, free: torch.Tensor, ends: list[int], first_stop: int) -> None:
    lengths = out["response_mask"].sum(-1).long().tolist()
    want = expected_lengths(free, ends)
    assert lengths == want and want[0] == first_stop < MAX_NEW
    for row, n, ref in zip(out["responses"], lengths, free):
        assert row[:n].tolist() == ref[:n].tolist()


def test_hf_rollout_stops_on_the_generation_configs_end_token(two_end_model, own_model, tmp_path):
    folder, batch, free, ends, first_stop = two_end_model
    out = rollout(run_config(folder, own_model.train_file, tmp_path, rollout={"backend": "hf"}), batch)
    check_stops(out, free, ends, first_stop)


def test_two_rollout_ranks_whose_longest_responses_differ_return_what_one_rank_does(two_end_model, own_model, tmp_path):
    """rollout.world_size=2: each rank's responses are as wide as its own longest; the group's
    result is right-padded to the widest, equal to one rank generating the whole batch."""
    from rlcore.controller.inprocess import InProcessWorkerGroup
    from rlcore.workers.rollout import RolloutWorker

    folder, batch, free, ends, first_stop = two_end_model
    lengths = expected_lengths(free, ends)
    longest = max(range(1, len(lengths)), key=lambda i: lengths[i])
    assert lengths[longest] > lengths[0] == first_stop  # the two ranks' widths will differ
    pair = batch.take([0, longest])
    config = config_from_dict(run_config(folder, own_model.train_file, tmp_path, rollout={"backend": "hf"}))
    groups = [InProcessWorkerGroup(lambda rank, ws: RolloutWorker(role_spec(config, "rollout"), rank, ws), ws, "rollout") for ws in (2, 1)]
    try:
        two, one = (g.call("generate_sequences", pair, GREEDY) for g in groups)
    finally:
        for g in groups:
            g.shutdown()
    assert two["responses"].shape[1] == lengths[longest]
    exact = [k for k in one.tensors if k != "rollout_log_probs"]  # log-probs: batch-size float noise
    assert two.keys() == one.keys() and all(torch.equal(two[k], one[k]) for k in exact), \
        [k for k in exact if not torch.equal(two[k], one[k])]
    torch.testing.assert_close(two["rollout_log_probs"], one["rollout_log_probs"], atol=1e-5, rtol=0)


def test_reward_sees_the_response_cut_at_the_first_end_token(two_end_model, own_model, tmp_path):
    """A response that ran on past an end token (as one generated elsewhere may) is scored on
    what comes before it."""
    from rlcore.workers.reward import RewardWorker

    folder, batch, free, ends, first_stop = two_end_model
    tok = load_tokenizer(str(folder))
    worker = RewardWorker(role_spec(config_from_dict(run_config(folder, own_model.train_file, tmp_path)), "reward"))
    worker.setup()
    try:
        gen = Batch(tensors={"responses": free, "response_mask": torch.ones_like(free)}, meta={})
        texts = worker.decode_responses(gen)
    finally:
        worker.shutdown()
    for text, row, n in zip(texts, free, expected_lengths(free, ends)):
        assert text == tok.decode(row[: n - 1].tolist() if row[n - 1] in ends else row[:n].tolist(), skip_special_tokens=True)
    assert texts[0] == tok.decode(free[0, : first_stop - 1].tolist(), skip_special_tokens=True)


def test_evaluation_and_the_served_pyfunc_model_stop_on_every_end_token(two_end_model, own_model, tmp_path):
    from rlcore.lifecycle.evaluation import evaluate_model
    from rlcore.lifecycle.hf_pyfunc import TextGenerator

    folder, batch, free, ends, _ = two_end_model
    val = tmp_path / "val.parquet"
    from rlcore.data import write_rows

    write_rows(read_rows(own_model.val_file)[:6], val)
    result = evaluate_model(folder, val, max_prompt_length=64, max_new_tokens=MAX_NEW, reward_function=own_model.reward_spec)
    assert result.response_length == pytest.approx(np.mean(expected_lengths(free, ends)))
    tok = load_tokenizer(str(folder))
    served = TextGenerator(str(folder))
    assert served.end_token_ids == ends
    prompts = [r["prompt"][0]["content"] for r in read_rows(val)]
    texts = served.generate(prompts, max_new_tokens=MAX_NEW)
    for text, row, n in zip(texts, free, expected_lengths(free, ends)):
        kept = row[: n - 1] if int(row[n - 1]) in ends else row[:n]
        assert text == tok.decode(kept.tolist(), skip_special_tokens=True)
