"""agg_loss modes, and gradient accumulation that does not depend on the micro-batch split."""

from __future__ import annotations

import pytest
import torch

from rlcore.algos import AGG_MODES, agg_loss, get_policy_loss, loss_counts, masked_mean

T = torch.tensor

# loss [[1, 2, 3], [4, 5, 6]], mask [[1, 1, 0], [1, 0, 0]]: valid tokens 1, 2 | 4
LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode,expected,expected_global", [
    # (1 + 2 + 4) / 3 tokens;                 global: 7 / 7 tokens
    ("token-mean", 7 / 3, 7 / 7),
    # (3 + 4) / 2 sequences;                  global: 7 / 4 sequences
    ("seq-mean-token-sum", 7 / 2, 7 / 4),
    # (3/2 + 4/1) / 2 = 2.75;                 global: 5.5 / 4
    ("seq-mean-token-mean", 2.75, 5.5 / 4),
    # (3/3 + 4/3) / 2 = 7/6 (norm_length = T = 3); global: (7/3) / 4
    ("seq-mean-token-sum-norm", 7 / 6, 7 / 12),
])
def test_agg_modes(mode, expected, expected_global):
    assert float(agg_loss(LOSS, MASK, mode)) == pytest.approx(expected)
    got = agg_loss(LOSS, MASK, mode, global_token_count=7, global_seq_count=4)
    assert float(got) == pytest.approx(expected_global)


def test_seq_mean_token_sum_norm_uses_constant_length():
    # norm_length=2: (3/2 + 4/2) / 2 sequences = 1.75
    assert float(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=2)) == pytest.approx(1.75)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_empty_rows_and_garbage_padding_do_not_leak(mode):
    # add an all-padding row full of NaN/inf: no NaN, and the result is unchanged (the row is not a
    # sequence for the seq-mean count either)
    loss = torch.cat([LOSS, T([[float("nan"), float("inf"), -float("inf")]])])
    mask = torch.cat([MASK, torch.zeros(1, 3)])
    assert float(agg_loss(loss, mask, mode)) == pytest.approx(float(agg_loss(LOSS, MASK, mode)))
    # an entirely empty micro-batch contributes 0
    assert float(agg_loss(loss[2:], mask[2:], mode)) == 0.0


def test_loss_counts():
    assert loss_counts(torch.cat([MASK, torch.zeros(1, 3)])) == {"global_token_count": 3, "global_seq_count": 2}


# ----------------------------------------------------------------------------- split invariance

N, L, D, V = 8, 5, 4, 6
SPLITS = {1: [8], 2: [3, 5], 4: [1, 3, 2, 2]}  # deliberately unequal micro-batches


def _problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, L, D, generator=g, dtype=torch.float64)
    actions = torch.randint(0, V, (N, L), generator=g)
    lengths = T([5, 1, 3, 5, 2, 4, 1, 5])
    mask = (torch.arange(L)[None, :] < lengths[:, None]).double()
    adv = torch.randn(N, L, generator=g, dtype=torch.float64)
    w0 = torch.randn(D, V, generator=g, dtype=torch.float64) * 0.3
    with torch.no_grad():
        old = torch.log_softmax(x @ w0, -1).gather(-1, actions[..., None]).squeeze(-1)
        old = old + 0.05 * torch.randn(N, L, generator=g, dtype=torch.float64)
    return x, actions, mask, adv, old, w0


def _logp(w, x, actions):
    """A tiny linear "policy": logits = x @ w, log-prob of the taken action."""
    return torch.log_softmax(x @ w, -1).gather(-1, actions[..., None]).squeeze(-1)


def _grad(mode, sizes, use_global_counts, policy="vanilla"):
    x, actions, mask, adv, old, w0 = _problem()
    w = w0.clone().requires_grad_(True)
    counts = loss_counts(mask) if use_global_counts else {}
    loss_fn = get_policy_loss(policy)
    total = 0.0
    for idx in torch.arange(N).split(sizes):
        loss, _ = loss_fn(old[idx], _logp(w, x[idx], actions[idx]), adv[idx], mask[idx],
                          clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode, **counts)
        if not use_global_counts:
            loss = loss / len(sizes)  # verl's legacy gradient accumulation: mean per micro-batch / n
        loss.backward()
        total += float(loss.detach())
    return w.grad.clone(), total


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("policy", ["vanilla", "gspo"])
def test_gradients_do_not_depend_on_micro_batch_split(mode, policy):
    ref_grad, ref_loss = _grad(mode, SPLITS[1], True, policy)
    assert ref_grad.abs().sum() > 0
    for k in (2, 4):
        grad, loss = _grad(mode, SPLITS[k], True, policy)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
        assert loss == pytest.approx(ref_loss, rel=1e-10)


def test_full_batch_share_is_the_plain_mean():
    # with one micro-batch and its own counts, token-mean is the masked mean over all valid tokens
    x, actions, mask, adv, old, w0 = _problem()
    loss, _ = get_policy_loss("vanilla")(old, old, adv, mask)  # ratio 1 -> token loss -A
    assert float(loss) == pytest.approx(float(masked_mean(-adv, mask)))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_legacy_per_micro_batch_mean_depends_on_split(mode):
    # verl's legacy path (mean inside each micro-batch, then / n_micro) weights tokens of small
    # micro-batches more: its gradient for an unequal split differs from the full-batch gradient
    ref_grad, _ = _grad(mode, SPLITS[1], False)
    grad, _ = _grad(mode, SPLITS[4], False)
    assert not torch.allclose(grad, ref_grad, rtol=1e-3, atol=1e-6)
    # ... while the global-count path matches the full batch (same check as above, for contrast)
    torch.testing.assert_close(_grad(mode, SPLITS[4], True)[0], ref_grad, rtol=1e-10, atol=1e-12)


def test_bad_counts_and_modes_raise():
    with pytest.raises(ValueError, match="global_token_count"):
        agg_loss(LOSS, MASK, "token-mean", global_token_count=0)
    with pytest.raises(ValueError, match="global_seq_count"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum", global_seq_count=-1)
    with pytest.raises(ValueError, match="norm_length"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=0)
    with pytest.raises(ValueError, match=r"token-mean.*seq-mean-token-sum-norm"):
        agg_loss(LOSS, MASK, "token-sum")
    with pytest.raises(ValueError, match="shape"):
        agg_loss(LOSS, MASK[:, :2], "token-mean")
