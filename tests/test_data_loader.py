"""PromptLoader: deterministic order per (seed, epoch), exact resume, left padding."""

from __future__ import annotations

import pytest
import torch

from rlcore.data import PromptLoader, RLDataset, write_rows
from rlcore.example.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tok):
    # Prompts of different lengths ("1+1=" ... "10+10=" ...) so padding is exercised.
    rows = [{"data_source": "t", "prompt": [{"role": "user", "content": f"{i}+{i}="}],
             "reward_model": {"ground_truth": str(2 * i), "style": "rule"}, "extra_info": {"i": i}}
            for i in range(1, 24)]
    path = write_rows(rows, tmp_path_factory.mktemp("d") / "train.parquet")
    return RLDataset([path], tok, max_prompt_length=32)


def uids(batches):
    return [list(b.meta["uid"]) for b in batches]


def test_order_is_deterministic_and_differs_between_epochs(dataset):
    a, b = PromptLoader(dataset, 5, seed=3), PromptLoader(dataset, 5, seed=3)
    first = uids(a.next_batch() for _ in range(9))
    assert first == uids(b.next_batch() for _ in range(9))
    assert len(a) == 4  # 23 // 5 with drop_last
    e0 = [u.split("-")[1] for batch in first[:4] for u in batch]
    e1 = [u.split("-")[1] for batch in first[4:8] for u in batch]
    assert first[4][0].startswith("1-") and len(set(e0)) == 20 and e0 != e1
    other_seed = PromptLoader(dataset, 5, seed=4)
    assert uids(other_seed.next_batch() for _ in range(4)) != first[:4]


def test_exact_resume_from_state_dict(dataset):
    ref = PromptLoader(dataset, 4, seed=0)
    expected = [ref.next_batch() for _ in range(13)]
    run = PromptLoader(dataset, 4, seed=0)
    for _ in range(7):  # crosses the epoch boundary at 5 batches per epoch
        run.next_batch()
    state = run.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    resumed = PromptLoader(dataset, 4, seed=0)
    resumed.load_state_dict(state)
    rest = [resumed.next_batch() for _ in range(6)]
    for got, want in zip(rest, expected[7:]):
        assert list(got.meta["uid"]) == list(want.meta["uid"])
        assert torch.equal(got["input_ids"], want["input_ids"])
    with pytest.raises(ValueError, match="seed=0 but this loader has seed=1"):
        PromptLoader(dataset, 4, seed=1).load_state_dict(state)


def test_left_padding_masks_and_positions(dataset, tok):
    loader = PromptLoader(dataset, 23, seed=0, shuffle=False)
    batch = loader.next_batch()
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    # "1+1=" is 4 chars, "10+10=" is 6: template adds 4 tokens.
    assert ids.shape == (23, 10)
    assert mask[0].tolist() == [0, 0] + [1] * 8 and ids[0, :2].tolist() == [tok.pad_token_id] * 2
    assert pos[0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert mask[22].all() and pos[22].tolist() == list(range(10))
    for i in range(23):
        real = ids[i][mask[i].bool()].tolist()
        assert real == dataset[i].input_ids  # the real tokens sit flush right, unchanged
        assert tok.decode(real) == batch.meta["raw_prompt"][i]
    assert list(batch.meta["ground_truth"][:3]) == ["2", "4", "6"]
    assert batch.meta["extra_info"][4] == {"i": 5} and batch.meta["data_source"][0] == "t"
    assert list(batch.meta["uid"][:2]) == ["0-0", "0-1"]


def test_no_drop_last_and_epoch_batches_leave_state(dataset):
    loader = PromptLoader(dataset, 10, seed=0, shuffle=False, drop_last=False)
    sizes = [len(b) for b in loader.epoch_batches()]
    assert sizes == [10, 10, 3] and loader.state_dict()["position"] == 0
    assert [len(b) for b in loader] == [10, 10, 3]
    assert loader.next_batch().info["epoch"] == 1
    with pytest.raises(ValueError, match="fewer than one batch"):
        PromptLoader(dataset, 24, seed=0)
