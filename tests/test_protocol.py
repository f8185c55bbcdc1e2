"""Batch: shape invariants, reshaping round trips, union conflicts, pickling."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

from rlcore.protocol import Batch


def make_batch(n: int = 7, width: int = 5) -> Batch:
    g = torch.Generator().manual_seed(0)
    return Batch(
        tensors={
            "input_ids": torch.arange(n * width).reshape(n, width),
            "attention_mask": (torch.rand(n, width, generator=g) > 0.3).long(),
            "scores": torch.randn(n, generator=g),
        },
        meta={
            "uid": [f"u{i}" for i in range(n)],
            "extra_info": [{"i": i, "tags": [i, i + 1]} for i in range(n)],
            "level": np.arange(n) * 10,
        },
        info={"temperature": 0.7},
    )


# ----- construction and validation -------------------------------------------------------------


def test_lists_become_object_arrays_one_element_per_sample():
    b = Batch(meta={"uid": ["a", "b"], "pairs": [[1, 2], [3, 4]], "d": [{"k": 1}, {"k": 2}]})
    assert len(b) == 2
    assert b["uid"].dtype == object and b["uid"].tolist() == ["a", "b"]
    assert b["pairs"].shape == (2,) and b["pairs"][1] == [3, 4]
    assert b["d"][0] == {"k": 1}


def test_size_mismatch_names_key_and_both_sizes():
    with pytest.raises(ValueError, match=r"'attention_mask' has leading size 3, but 'input_ids' has 4"):
        Batch(tensors={"input_ids": torch.zeros(4, 2), "attention_mask": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match=r"'uid' has leading size 2, but 'input_ids' has 4"):
        Batch(tensors={"input_ids": torch.zeros(4, 2)}, meta={"uid": ["a", "b"]})
    b = make_batch(4)
    with pytest.raises(ValueError, match=r"'advantages' has leading size 5"):
        b["advantages"] = torch.zeros(5, 3)


def test_bad_values_are_rejected_by_key():
    with pytest.raises(TypeError, match="'x'"):
        Batch(tensors={"x": [1, 2]})
    with pytest.raises(ValueError, match="'x' is 0-d"):
        Batch(tensors={"x": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="'m'.*torch.Tensor"):
        Batch(meta={"m": torch.zeros(2)})
    with pytest.raises(ValueError, match="'k' is in both"):
        Batch(tensors={"k": torch.zeros(2)}, meta={"k": ["a", "b"]})


def test_getitem_contains_keys_setitem_pop():
    b = make_batch(3)
    assert b.keys() == ["input_ids", "attention_mask", "scores", "uid", "extra_info", "level"]
    assert "uid" in b and "input_ids" in b and "nope" not in b
    assert torch.equal(b["input_ids"][1], torch.arange(5, 10))
    assert b["uid"][2] == "u2"
    with pytest.raises(KeyError, match="'nope'"):
        b["nope"]
    b["adv"] = torch.ones(3, 5)
    b["source"] = ["x", "y", "z"]
    assert "adv" in b.tensors and b["source"].dtype == object
    assert b.pop("adv").shape == (3, 5) and "adv" not in b
    assert b[1:3]["uid"].tolist() == ["u1", "u2"]


# ----- reshaping --------------------------------------------------------------------------------


@pytest.mark.parametrize("n,parts", [(7, 3), (9, 3), (3, 3), (10, 4), (1, 1)])
def test_chunk_sizes_and_concat_round_trip(n, parts):
    b = make_batch(n)
    chunks = b.chunk(parts)
    sizes = [len(c) for c in chunks]
    assert len(chunks) == parts and sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert Batch.concat(chunks).equal(b)


def test_chunk_with_fewer_rows_than_parts_gives_one_row_each():
    assert [len(c) for c in make_batch(2).chunk(5)] == [1, 1]


def test_split_sizes_and_round_trip():
    b = make_batch(7)
    parts = b.split(3)
    assert [len(p) for p in parts] == [3, 3, 1]
    assert Batch.concat(parts).equal(b)


def test_take_reorders_tensors_and_meta_together():
    b = make_batch(5)
    for idx in ([4, 0, 2], np.array([4, 0, 2]), torch.tensor([4, 0, 2])):
        t = b.take(idx)
        assert t["uid"].tolist() == ["u4", "u0", "u2"]
        assert t["input_ids"][:, 0].tolist() == [20, 0, 10]
        assert t["level"].tolist() == [40, 0, 20]
        assert t.info == {"temperature": 0.7}
    perm = np.array([3, 1, 4, 0, 2])
    assert b.take(perm).take(np.argsort(perm)).equal(b)
    assert b.take([-1])["uid"].tolist() == ["u4"]
    assert b.take(np.array([True, False, True, False, False]))["uid"].tolist() == ["u0", "u2"]
    with pytest.raises(IndexError, match="index 5 is out of range for a batch of 5"):
        b.take([0, 5])


def test_select_keeps_info_and_names_missing_key():
    b = make_batch(3)
    s = b.select("input_ids", "uid")
    assert s.keys() == ["input_ids", "uid"] and s.info == {"temperature": 0.7}
    with pytest.raises(KeyError, match="'missing'"):
        b.select("input_ids", "missing")


def test_repeat_interleave_groups_consecutive_samples():
    b = make_batch(3)
    r = b.repeat_interleave(4)
    assert len(r) == 12
    assert r["uid"].tolist() == ["u0"] * 4 + ["u1"] * 4 + ["u2"] * 4
    assert r["input_ids"][:, 0].tolist() == [0] * 4 + [5] * 4 + [10] * 4
    assert r["extra_info"][5] == {"i": 1, "tags": [1, 2]}
    assert r["level"].tolist() == [0] * 4 + [10] * 4 + [20] * 4


def test_concat_takes_first_info_and_rejects_width_mismatch_by_key():
    a, b = make_batch(2), make_batch(3)
    b.info["temperature"] = 1.0
    assert Batch.concat([a, b]).info == {"temperature": 0.7}
    wide = make_batch(3, width=6)
    with pytest.raises(ValueError, match=r"tensor 'input_ids' has shape \(2, 5\) in batch 0 but \(3, 6\) in batch 1"):
        Batch.concat([a, wide])
    with pytest.raises(ValueError, match="'scores' is only in batch 0"):
        Batch.concat([a, make_batch(2).select("input_ids", "attention_mask", "uid", "extra_info", "level")])


def test_union_merges_and_rejects_conflicts_by_key():
    b = make_batch(4)
    extra = Batch(tensors={"input_ids": b["input_ids"].clone(), "adv": torch.ones(4, 5)},
                  meta={"uid": list(b["uid"])}, info={"kl": 0.1})
    u = b.union(extra)
    assert set(u.keys()) == set(b.keys()) | {"adv"} and u.info == {"temperature": 0.7, "kl": 0.1}
    assert "adv" not in b  # not in place
    bad = Batch(tensors={"input_ids": b["input_ids"] + 1})
    with pytest.raises(ValueError, match="tensor 'input_ids' differs"):
        b.union(bad)
    with pytest.raises(ValueError, match="meta 'uid' differs"):
        b.union(Batch(meta={"uid": ["a", "b", "c", "d"]}))
    with pytest.raises(ValueError, match="info 'temperature' differs"):
        b.union(Batch(tensors={"x": torch.zeros(4)}, info={"temperature": 1.0}))
    with pytest.raises(ValueError, match=r"lengths differ \(4 vs 3\)"):
        b.union(Batch(tensors={"x": torch.zeros(3)}))


def test_pad_to_multiple_repeats_first_rows_and_unpad_reverses():
    b = make_batch(7)
    p, n_pad = b.pad_to_multiple(3)
    assert (len(p), n_pad) == (9, 2)
    assert p["uid"].tolist()[7:] == ["u0", "u1"]
    assert torch.equal(p["input_ids"][7:], b["input_ids"][:2])
    assert p.unpad(n_pad).equal(b)
    # more padding than rows: cycles through the rows
    small, n_pad = make_batch(2).pad_to_multiple(5)
    assert n_pad == 3 and small["uid"].tolist() == ["u0", "u1", "u0", "u1", "u0"]
    same, n_pad = b.pad_to_multiple(7)
    assert n_pad == 0 and same.equal(b)


def test_to_moves_tensors_only():
    b = make_batch(2).to("meta")
    assert b["input_ids"].device.type == "meta" and b["uid"].tolist() == ["u0", "u1"]


# ----- pickling -----------------------------------------------------------------------------


def test_pickle_round_trip_with_bf16_and_object_meta():
    b = make_batch(4)
    b["logp"] = torch.randn(4, 5).to(torch.bfloat16)
    b["mask"] = torch.rand(4, 5) > 0.5
    b["f8"] = torch.randn(4, 2).to(torch.float8_e4m3fn)
    b["grad"] = torch.randn(4, 2, requires_grad=True) * 2
    back = pickle.loads(pickle.dumps(b))
    assert back["logp"].dtype == torch.bfloat16 and torch.equal(back["logp"], b["logp"])
    assert back["f8"].dtype == torch.float8_e4m3fn
    assert torch.equal(back["f8"].view(torch.uint8), b["f8"].view(torch.uint8))
    assert back["mask"].dtype == torch.bool
    assert back.select(*[k for k in b.keys() if k != "grad"]).equal(
        b.select(*[k for k in b.keys() if k != "grad"]))
    assert torch.equal(back["grad"], b["grad"].detach())
    assert back["extra_info"][3] == {"i": 3, "tags": [3, 4]}
    assert copy.deepcopy(b)["logp"].dtype == torch.bfloat16


def test_numpy_state_holds_numpy_only_and_views_pickle_only_their_rows():
    b = make_batch(6)
    b["logp"] = torch.randn(6, 5).to(torch.bfloat16)
    state = b.numpy_state()
    assert state["tensors"]["logp"][0] == "bfloat16"
    assert all(isinstance(arr, np.ndarray) for _, arr in state["tensors"].values())
    big = Batch(tensors={"x": torch.zeros(10_000, 100)})
    assert len(pickle.dumps(big.chunk(100)[0])) < len(pickle.dumps(big)) / 50


def test_from_numpy_state_copies_read_only_buffers():
    b = make_batch(3)
    state = b.numpy_state()
    for _, arr in state["tensors"].values():
        arr.flags.writeable = False
    back = Batch.from_numpy_state(state)
    back["input_ids"][0, 0] = 99  # must not touch the read-only buffer
    assert state["tensors"]["input_ids"][1][0, 0] == 0
