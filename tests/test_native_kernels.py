"""rlcore._native numeric kernels (GAE, discounted returns, group advantages).

Each kernel is checked three ways: hand-computed golden values, a scalar loop written here in
numpy float32 (independent of rlcore.algos), and the torch reference in
rlcore.algos.advantages (backend="torch") on random shapes and masks via hypothesis.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import _native
from rlcore.algos.advantages import discounted_returns, gae_raw, group_outcome_advantage

MODES = ["grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"]

# ----------------------------------------------------------------------------- scalar references


def gae_loop(r: np.ndarray, v: np.ndarray, m: np.ndarray, gamma: float, lam: float):
    """verl's masked GAE, one element at a time in float32."""
    f = np.float32
    adv = np.zeros(r.shape, np.float32)
    g32, gl32 = f(gamma), f(gamma * lam)
    for b in range(r.shape[0]):
        nextvalue, lastgae = f(0), f(0)
        for t in reversed(range(r.shape[1])):
            mt = f(m[b, t])
            g = (r[b, t] + g32 * nextvalue - v[b, t]) + gl32 * lastgae
            nextvalue = v[b, t] * mt + (f(1) - mt) * nextvalue
            lastgae = g * mt + (f(1) - mt) * lastgae
            adv[b, t] = g
    return adv, adv + v


def returns_loop(r: np.ndarray, m: np.ndarray, gamma: float) -> np.ndarray:
    f = np.float32
    out = np.zeros(r.shape, np.float32)
    for b in range(r.shape[0]):
        running = f(0)
        for t in reversed(range(r.shape[1])):
            running = r[b, t] + f(gamma) * running
            out[b, t] = running
            running = running * f(m[b, t])
    return out


def group_loop(scores: np.ndarray, ids: np.ndarray, mode: str, eps: float) -> np.ndarray:
    """A dict of lists per id, statistics with Python's float64 like verl's per-uid loop."""
    groups: dict[int, list[float]] = {}
    for s, i in zip(scores.tolist(), ids.tolist()):
        groups.setdefault(i, []).append(s)
    out = np.zeros(len(scores), np.float32)
    for j, (s, i) in enumerate(zip(scores.tolist(), ids.tolist())):
        g = groups[i]
        n = len(g)
        if n == 1:
            out[j] = s
            continue
        mean = sum(g) / n
        std = (sum((x - mean) ** 2 for x in g) / (n - 1)) ** 0.5
        if mode == "grpo":
            out[j] = 0.0 if std == 0 else (s - mean) / (std + eps)
        elif mode == "rloo":
            out[j] = (s - mean) * n / (n - 1)
        else:
            out[j] = s - mean
    return out


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- strategies

FLOATS = st.floats(-10, 10, allow_nan=False, allow_subnormal=False, width=32)


@st.composite
def token_batches(draw):
    """rewards, values, mask [B, T] with row patterns seen in RL: right padding, holes, all masked."""
    b = draw(st.integers(1, 5))
    t = draw(st.integers(1, 10))
    r = np.array(draw(st.lists(FLOATS, min_size=b * t, max_size=b * t)), np.float32).reshape(b, t)
    v = np.array(draw(st.lists(FLOATS, min_size=b * t, max_size=b * t)), np.float32).reshape(b, t)
    rows = []
    for _ in range(b):
        kind = draw(st.sampled_from(["padded", "random", "none", "all"]))
        if kind == "padded":
            n = draw(st.integers(0, t))
            rows.append([1.0] * n + [0.0] * (t - n))
        elif kind == "random":
            rows.append(draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=t, max_size=t)))
        else:
            rows.append([0.0 if kind == "none" else 1.0] * t)
    m = np.array(rows, np.float32)
    gamma = draw(st.sampled_from([0.0, 0.5, 0.99, 1.0]))
    lam = draw(st.sampled_from([0.0, 0.95, 1.0]))
    return r, v, m, gamma, lam


@st.composite
def grouped_scores(draw):
    """Scores on a coarse grid (RL rewards are mostly 0/1, partial credit) in groups of mixed size."""
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=8))
    ids = np.concatenate([np.full(n, draw(st.integers(-(2**40), 2**40)), np.int64) for n in sizes])
    n = len(ids)
    scores = np.array(draw(st.lists(st.integers(-8, 8), min_size=n, max_size=n)), np.float32) * 0.25
    # Shuffled: the kernel must not rely on group members being adjacent. (Two groups that drew
    # the same id are simply one group, for the kernel and the references alike.)
    perm = np.array(draw(st.permutations(range(n))))
    return scores[perm], ids[perm]


# ----------------------------------------------------------------------------- GAE


def test_gae_golden_unmasked():
    # gamma = lam = 1, V = 0.5 everywhere, reward 1 at the end:
    # t=2: delta = 1 - 0.5 = 0.5; t=1: delta = 0 + 0.5 - 0.5 = 0, g = 0.5; t=0 likewise 0.5.
    adv, ret = _native.gae(np.array([[0, 0, 1]], np.float32), np.full((1, 3), 0.5, np.float32),
                           np.ones((1, 3), np.float32), 1.0, 1.0)
    np.testing.assert_array_equal(adv, [[0.5, 0.5, 0.5]])
    np.testing.assert_array_equal(ret, [[1.0, 1.0, 1.0]])


def test_gae_golden_masked_hole():
    # gamma = 0.5, lam = 1; r = [1, 0, 2], v = [1, 5, 1], m = [1, 0, 1].
    # t=2: delta = 2 - 1 = 1, g = 1 -> nextvalue 1, lastgae 1.
    # t=1 (masked): delta = 0 + 0.5*1 - 5 = -4.5, g = -4.5 + 0.5*1 = -4; state unchanged.
    # t=0: delta = 1 + 0.5*1 - 1 = 0.5, g = 0.5 + 0.5*1 = 1.
    adv, ret = _native.gae(np.array([[1, 0, 2]], np.float32), np.array([[1, 5, 1]], np.float32),
                           np.array([[1, 0, 1]], np.float32), 0.5, 1.0)
    np.testing.assert_array_equal(adv, [[1.0, -4.0, 1.0]])
    np.testing.assert_array_equal(ret, [[2.0, 1.0, 2.0]])


@settings(max_examples=80, deadline=None)
@given(token_batches())
def test_gae_matches_loop_and_torch(batch):
    r, v, m, gamma, lam = batch
    adv, ret = _native.gae(r, v, m, gamma, lam)
    assert adv.dtype == np.float32 and adv.shape == r.shape and ret.shape == r.shape
    e_adv, e_ret = gae_loop(r, v, m, gamma, lam)
    close(adv, e_adv, 1e-6)
    close(ret, e_ret, 1e-6)
    t_adv, t_ret = gae_raw(torch.from_numpy(r), torch.from_numpy(v), torch.from_numpy(m), gamma, lam,
                           backend="torch")
    close(adv, t_adv.numpy())
    close(ret, t_ret.numpy())


def test_gae_blocked_path_matches_torch():
    """B and T large enough for the 8-row SIMD blocks, full 64-step tiles and leftovers."""
    rng = np.random.default_rng(0)
    b, t = 19, 200
    r = rng.standard_normal((b, t)).astype(np.float32)
    v = rng.standard_normal((b, t)).astype(np.float32)
    lengths = rng.integers(0, t + 1, size=b)
    m = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    m[3, 10:20] = 0  # a hole (observation tokens in a multi-turn response)
    adv, ret = _native.gae(r, v, m, 0.99, 0.95)
    e_adv, e_ret = gae_loop(r, v, m, 0.99, 0.95)
    np.testing.assert_array_equal(adv, e_adv)
    np.testing.assert_array_equal(ret, e_ret)
    t_adv, t_ret = gae_raw(*(torch.from_numpy(x) for x in (r, v, m)), 0.99, 0.95, backend="torch")
    close(adv, t_adv.numpy())
    close(ret, t_ret.numpy())


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.uint8, np.int32, np.int64, np.float64])
def test_gae_mask_dtypes_agree(dtype):
    rng = np.random.default_rng(1)
    r = rng.standard_normal((9, 70)).astype(np.float32)
    v = rng.standard_normal((9, 70)).astype(np.float32)
    m = rng.random((9, 70)) < 0.7
    ref = _native.gae(r, v, m.astype(np.float32), 0.9, 0.8)
    got = _native.gae(r, v, m.astype(dtype), 0.9, 0.8)
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref[1])


def test_gae_accepts_torch_tensors_and_strided_views():
    rng = np.random.default_rng(2)
    r = rng.standard_normal((6, 10)).astype(np.float32)
    v = rng.standard_normal((6, 10)).astype(np.float32)
    m = np.ones((6, 10), np.float32)
    ref = _native.gae(r, v, m, 0.99, 0.95)
    got = _native.gae(torch.from_numpy(r), torch.from_numpy(v), torch.from_numpy(m).bool(), 0.99, 0.95)
    np.testing.assert_array_equal(got[0], ref[0])
    # A transposed view is not contiguous: it is copied, and the result is the same.
    got_t = _native.gae(np.ascontiguousarray(r.T).T, v, m, 0.99, 0.95)
    np.testing.assert_array_equal(got_t[0], ref[0])


def test_gae_empty_shapes():
    for shape in [(0, 5), (3, 0)]:
        adv, ret = _native.gae(np.zeros(shape, np.float32), np.zeros(shape, np.float32),
                               np.zeros(shape, np.float32), 1.0, 1.0)
        assert adv.shape == shape and ret.shape == shape


# ----------------------------------------------------------------------------- discounted returns


def test_returns_golden():
    # gamma 0.9, m = [1, 1, 1, 0]: t=3 writes 7 then resets; t=2: 1; t=1: 0.9; t=0: 0.81.
    out = _native.discounted_returns(np.array([[0, 0, 1, 7]], np.float32), np.array([[1, 1, 1, 0]], np.float32), 0.9)
    np.testing.assert_allclose(out, [[0.81, 0.9, 1.0, 7.0]], rtol=1e-6)
    # gamma 0.5, m = [1, 1, 0]: [1 + 0.5 * 2, 2, 4] (the 4 does not flow back).
    out = _native.discounted_returns(np.array([[1, 2, 4]], np.float32), np.array([[1, 1, 0]], np.int64), 0.5)
    np.testing.assert_array_equal(out, [[2.0, 2.0, 4.0]])


@settings(max_examples=80, deadline=None)
@given(token_batches())
def test_returns_match_loop_and_torch(batch):
    r, _, m, gamma, _ = batch
    out = _native.discounted_returns(r, m, gamma)
    close(out, returns_loop(r, m, gamma), 1e-6)
    ref = discounted_returns(torch.from_numpy(r), torch.from_numpy(m), gamma, backend="torch")
    close(out, ref.numpy())


def test_returns_large_batch_matches_loop():
    rng = np.random.default_rng(3)
    r = rng.standard_normal((21, 90)).astype(np.float32)
    m = (rng.random((21, 90)) < 0.8).astype(np.float32)
    np.testing.assert_array_equal(_native.discounted_returns(r, m.astype(bool), 0.97), returns_loop(r, m, 0.97))


# ----------------------------------------------------------------------------- group advantages


def test_group_golden():
    # group 9: [1, 3, 5] -> mean 3, unbiased std sqrt((4 + 0 + 4) / 2) = 2; group 4: [10] alone.
    scores = np.array([1, 10, 3, 5], np.float32)
    ids = np.array([9, 4, 9, 9])
    eps = 1e-6
    close(_native.group_advantages(scores, ids, "grpo", eps), [-2 / (2 + eps), 10, 0, 2 / (2 + eps)], 1e-7)
    close(_native.group_advantages(scores, ids, "drgrpo", eps), [-2, 10, 0, 2], 0)
    # rloo: 1 - mean(3, 5) = -3; 3 - 3 = 0; 5 - mean(1, 3) = 3.
    close(_native.group_advantages(scores, ids, "rloo", eps), [-3, 10, 0, 3], 0)
    close(_native.group_advantages(scores, ids, "reinforce_plus_plus_baseline", eps), [-2, 10, 0, 2], 0)


def test_group_constant_scores_give_zero_in_grpo():
    out = _native.group_advantages(np.array([0.1, 0.1, 0.1, 1.0, 0.0], np.float32), np.array([0, 0, 0, 1, 1]),
                                   "grpo", 1e-6)
    assert out[:3].tolist() == [0.0, 0.0, 0.0]
    # [1, 0]: mean 0.5, unbiased std sqrt(0.5).
    close(out[3:], [0.5 / (np.sqrt(0.5) + 1e-6), -0.5 / (np.sqrt(0.5) + 1e-6)])


@settings(max_examples=100, deadline=None)
@given(grouped_scores(), st.sampled_from(MODES))
def test_group_matches_loop_and_torch(data, mode):
    scores, ids = data
    out = _native.group_advantages(scores, ids, mode, 1e-6)
    assert out.dtype == np.float32 and out.shape == scores.shape
    close(out, group_loop(scores, ids, mode, 1e-6), 1e-6)
    ref = group_outcome_advantage(torch.from_numpy(scores), torch.from_numpy(ids), mode, 1e-6, backend="torch")
    close(out, ref.numpy())


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint16, np.uint64])
def test_group_ids_any_integer_dtype(dtype):
    scores = np.array([1, 2, 3, 4, 5, 6], np.float32)
    ids = np.array([0, 1, 0, 1, 2, 2])
    ref = _native.group_advantages(scores, ids, "grpo", 1e-6)
    np.testing.assert_array_equal(_native.group_advantages(scores, ids.astype(dtype), "grpo", 1e-6), ref)
    np.testing.assert_array_equal(_native.group_advantages(torch.from_numpy(scores), torch.from_numpy(ids)), ref)


# ----------------------------------------------------------------------------- bad input


def _raises(match, fn, *args):
    with pytest.raises(ValueError, match=match):
        fn(*args)


def test_gae_bad_input_names_the_argument():
    r = np.zeros((4, 7), np.float32)
    _raises(r"values: expected shape \(4, 7\) like rewards, got \(4, 6\)", _native.gae,
            r, np.zeros((4, 6), np.float32), r, 1.0, 1.0)
    _raises(r"mask: expected shape \(4, 7\)", _native.gae, r, r, np.zeros((7, 4), np.float32), 1.0, 1.0)
    _raises(r"rewards: expected a 2-D array", _native.gae, np.zeros(7, np.float32), r, r, 1.0, 1.0)
    _raises(r"rewards: expected dtype float32, got float64", _native.gae, r.astype(np.float64), r, r, 1.0, 1.0)
    _raises(r"values: expected dtype float32, got float16", _native.gae, r, r.astype(np.float16), r, 1.0, 1.0)
    _raises(r"mask: expected a float32, float64, bool or integer dtype", _native.gae,
            r, r, r.astype(np.complex64), 1.0, 1.0)
    _raises(r"gamma: must be a finite number", _native.gae, r, r, r, float("nan"), 1.0)
    _raises(r"lam: must be a finite number", _native.gae, r, r, r, 1.0, float("inf"))
    bad = r.copy()
    bad[2, 5] = np.nan
    _raises(r"values: contains NaN or inf \(first at \[2, 5\]\)", _native.gae, r, bad, r, 1.0, 1.0)
    bad_big = np.zeros((17, 130), np.float32)
    bad_big[9, 100] = np.inf
    ok_big = np.zeros((17, 130), np.float32)
    _raises(r"rewards: contains NaN or inf \(first at \[9, 100\]\)", _native.gae, bad_big, ok_big, ok_big, 1.0, 1.0)
    _raises(r"mask: contains NaN or inf \(first at \[9, 100\]\)", _native.gae, ok_big, ok_big, bad_big, 1.0, 1.0)
    _raises(r"rewards: expected a numpy array or a CPU tensor", _native.gae,
            torch.zeros(4, 7, requires_grad=True), r, r, 1.0, 1.0)
    _raises(r"rewards: expected dtype float32, got <U1", _native.gae, [["a"] * 7] * 4, r, r, 1.0, 1.0)


def test_returns_and_group_bad_input_names_the_argument():
    r = np.zeros((2, 3), np.float32)
    _raises(r"mask: expected shape \(2, 3\) like rewards, got \(2, 4\)", _native.discounted_returns,
            r, np.zeros((2, 4), np.float32), 1.0)
    bad = r.copy()
    bad[1, 0] = -np.inf
    _raises(r"rewards: contains NaN or inf \(first at \[1, 0\]\)", _native.discounted_returns, bad, r, 1.0)
    s = np.zeros(4, np.float32)
    ids = np.zeros(4, np.int64)
    _raises(r"mode: unknown 'bogus'; expected one of grpo, drgrpo, rloo", _native.group_advantages,
            s, ids, "bogus", 1e-6)
    _raises(r"group_ids: expected shape \(4,\) like scores, got \(3,\)", _native.group_advantages,
            s, ids[:3], "grpo", 1e-6)
    _raises(r"group_ids: expected an integer dtype, got float32", _native.group_advantages, s, s, "grpo", 1e-6)
    _raises(r"scores: expected a 1-D array", _native.group_advantages, s.reshape(2, 2), ids, "grpo", 1e-6)
    _raises(r"scores: contains NaN or inf \(first at index 2\)", _native.group_advantages,
            np.array([0, 1, np.nan, 1], np.float32), ids, "grpo", 1e-6)
    _raises(r"eps: must be >= 0", _native.group_advantages, s, ids, "grpo", -1.0)
