"""Hand-computed golden values for rlcore.algos (torch path). The arithmetic is in the comments."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rlcore.algos import (
    apply_kl_penalty,
    compute_advantage,
    compute_value_loss,
    discounted_returns,
    entropy_from_logits,
    gae_raw,
    get_policy_loss,
    group_outcome_advantage,
    kl_loss,
    kl_penalty,
)

T = torch.tensor


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               atol=tol, rtol=tol)


def whiten_ref(values: list[float]) -> list[float]:
    """Independent whitening reference: statistics.variance is the unbiased (n-1) variance."""
    mu, var = statistics.mean(values), statistics.variance(values)
    return [(v - mu) / math.sqrt(var + 1e-8) for v in values]


# ----------------------------------------------------------------------------- GAE

# gamma=0.9, lam=0.8 (gamma*lam = 0.72)
# row 0: r=[0, 1, 0], v=[0.5, 0.2, 9.0], m=[1, 1, 0]
#   t=2 (masked): delta = 0 + 0.9*0 - 9 = -9, g = -9; nextvalue, lastgae stay 0
#   t=1: delta = 1 + 0 - 0.2 = 0.8, g = 0.8;          nextvalue=0.2, lastgae=0.8
#   t=0: delta = 0 + 0.9*0.2 - 0.5 = -0.32, g = -0.32 + 0.72*0.8 = 0.256
#   returns = adv + v = [0.756, 1.0, 0.0]
# row 1 (interior masked token is skipped): r=[0, 0, 1], v=[0.5, 7.0, 0.25], m=[1, 0, 1]
#   t=2: delta = 1 - 0.25 = 0.75, g = 0.75;           nextvalue=0.25, lastgae=0.75
#   t=1 (masked): delta = 0.9*0.25 - 7 = -6.775, g = -6.775 + 0.72*0.75 = -6.235; carry unchanged
#   t=0: delta = 0.9*0.25 - 0.5 = -0.275, g = -0.275 + 0.72*0.75 = 0.265
#   returns = [0.765, 0.765, 1.0]
GAE_R = T([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
GAE_V = T([[0.5, 0.2, 9.0], [0.5, 7.0, 0.25]])
GAE_M = T([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
GAE_ADV = [[0.256, 0.8, -9.0], [0.265, -6.235, 0.75]]
GAE_RET = [[0.756, 1.0, 0.0], [0.765, 0.765, 1.0]]


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_gae_raw(backend):
    adv, ret = gae_raw(GAE_R, GAE_V, GAE_M, gamma=0.9, lam=0.8, backend=backend)
    close(adv * GAE_M, T(GAE_ADV) * GAE_M)  # masked positions are unspecified (never read)
    close(ret * GAE_M, T(GAE_RET) * GAE_M)
    if backend == "torch":  # the reference also pins the masked positions: adv[t] = g
        close(adv, GAE_ADV)
        close(ret, GAE_RET)


def test_gae_estimator_whitens_valid_tokens_and_keeps_raw_returns():
    adv, ret = compute_advantage("gae", token_level_rewards=GAE_R, response_mask=GAE_M, values=GAE_V,
                                 gamma=0.9, lam=0.8, backend="torch")
    # valid raw advantages, row-major: 0.256, 0.8, 0.265, 0.75
    w = whiten_ref([0.256, 0.8, 0.265, 0.75])
    close(adv, [[w[0], w[1], 0.0], [w[2], 0.0, w[3]]])
    close(ret * GAE_M, T(GAE_RET) * GAE_M)


# ----------------------------------------------------------------------------- group outcome

# uids  a  b  a  c  a  b     scores 1 2 0 5 0 4
# group a: {1, 0, 0}, n=3, mean 1/3, unbiased var = ((2/3)^2 + 2*(1/3)^2)/2 = 1/3, std = 0.5773503
# group b: {2, 4},    n=2, mean 3,   var = (1 + 1)/1 = 2, std = 1.4142136
# group c: {5} singleton -> raw score 5 in every mode
SCORES = T([1.0, 2.0, 0.0, 5.0, 0.0, 4.0])
GIDS = T([0, 1, 0, 2, 0, 1])
S3, S2 = math.sqrt(1 / 3) + 1e-6, math.sqrt(2) + 1e-6
GROUP_GOLDEN = {
    # (s - mean) / (std + eps)
    "grpo": [(2 / 3) / S3, -1 / S2, (-1 / 3) / S3, 5.0, (-1 / 3) / S3, 1 / S2],
    # s - mean
    "drgrpo": [2 / 3, -1.0, -1 / 3, 5.0, -1 / 3, 1.0],
    "reinforce_plus_plus_baseline": [2 / 3, -1.0, -1 / 3, 5.0, -1 / 3, 1.0],
    # s*n/(n-1) - mean*n/(n-1) = s - mean(others): a: 1-0=1, 0-0.5=-0.5; b: 2-4=-2, 4-2=2
    "rloo": [1.0, -2.0, -0.5, 5.0, -0.5, 2.0],
}


@pytest.mark.parametrize("mode", sorted(GROUP_GOLDEN))
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_group_outcome_advantage(mode, backend):
    close(group_outcome_advantage(SCORES, GIDS, mode, eps=1e-6, backend=backend), GROUP_GOLDEN[mode], tol=1e-5)


def test_group_ids_need_not_be_compact_or_sorted():
    out = group_outcome_advantage(SCORES, T([70, -3, 70, 12, 70, -3]), "rloo", backend="torch")
    close(out, GROUP_GOLDEN["rloo"])


# Outcome estimators: the score is token_level_rewards.sum(-1), placed on the last valid token,
# and the advantage is broadcast over the response mask (zero on padding).
OUT_M = T([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.float32)
OUT_R = torch.zeros(6, 3)
for i, (s, n) in enumerate(zip(SCORES.tolist(), OUT_M.sum(-1).int().tolist())):
    OUT_R[i, n - 1] = s
UIDS = ["a", "b", "a", "c", "a", "b"]


@pytest.mark.parametrize("name,mode,kwargs", [
    ("grpo", "grpo", {}),
    ("grpo", "drgrpo", {"norm_adv_by_std": False}),
    ("drgrpo", "drgrpo", {}),
    ("rloo", "rloo", {}),
])
def test_outcome_estimators_broadcast_over_mask(name, mode, kwargs):
    adv, ret = compute_advantage(name, token_level_rewards=OUT_R, response_mask=OUT_M, group_ids=UIDS,
                                 backend="torch", **kwargs)
    close(adv, T(GROUP_GOLDEN[mode]).unsqueeze(-1) * OUT_M, tol=1e-5)
    close(ret, adv)


def test_reinforce_plus_plus_baseline_whitens_over_tokens():
    adv, ret = compute_advantage("reinforce_plus_plus_baseline", token_level_rewards=OUT_R, response_mask=OUT_M,
                                 group_ids=GIDS.numpy(), backend="torch")
    # centred scores s - mean, repeated once per valid token (lengths 3,2,1,3,2,1), then whitened
    centred = GROUP_GOLDEN["drgrpo"]
    lengths = [3, 2, 1, 3, 2, 1]
    flat = [c for c, n in zip(centred, lengths) for _ in range(n)]
    w = iter(whiten_ref(flat))
    expected = [[next(w) if t < n else 0.0 for t in range(3)] for n in lengths]
    close(adv, expected, tol=1e-5)
    close(ret, adv)


# ----------------------------------------------------------------------------- REINFORCE++ / ReMax

def test_discounted_returns_cut_at_mask():
    # r=[1, 0, 2, 3], m=[1, 1, 0, 1], gamma=0.5, backwards from running=0:
    # t=3: running = 3,            out 3,   running *= 1 -> 3
    # t=2: running = 2 + 0.5*3 = 3.5, out 3.5, running *= 0 -> 0   (cut)
    # t=1: running = 0,            out 0
    # t=0: running = 1 + 0 = 1,    out 1
    for backend in ("torch", "auto"):
        out = discounted_returns(T([[1.0, 0.0, 2.0, 3.0]]), T([[1.0, 1.0, 0.0, 1.0]]), 0.5, backend=backend)
        close(out, [[1.0, 0.0, 3.5, 3.0]])


def test_reinforce_plus_plus_estimator():
    # gamma=1: row0 r=[0,0,1] m=[1,1,1] -> returns [1,1,1]; row1 r=[0,2,0] m=[1,1,0] -> [2,2,0]
    # valid returns 1,1,1,2,2: mean 1.4, unbiased var (3*0.16 + 2*0.36)/4 = 0.3
    # adv: 1 -> -0.4/sqrt(0.3) = -0.7302967, 2 -> 0.6/sqrt(0.3) = 1.0954451, padding 0
    r = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    m = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = compute_advantage("reinforce_plus_plus", token_level_rewards=r, response_mask=m, gamma=1.0,
                                 backend="torch")
    a, b = -0.4 / math.sqrt(0.3 + 1e-8), 0.6 / math.sqrt(0.3 + 1e-8)
    close(adv, [[a, a, a], [b, b, 0.0]])
    close(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])


def test_remax():
    # returns = reverse cumsum of r*m: row0 [1,1,1], row1 [0.5,0.5,0]
    # adv = returns - baseline*m: row0 1-0.25 = 0.75; row1 0.5-1 = -0.5, padding 0-0 = 0
    r = T([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    m = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = compute_advantage("remax", token_level_rewards=r, response_mask=m, reward_baselines=T([0.25, 1.0]))
    close(adv, [[0.75, 0.75, 0.75], [-0.5, -0.5, 0.0]])
    close(ret, [[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]])


# ----------------------------------------------------------------------------- KL estimators

# d = logp - ref = [0.5, -1.0]
LOGP, REF = T([-1.0, -2.0]), T([-1.5, -1.0])
KL_GOLDEN = {
    "k1": [0.5, -1.0], "kl": [0.5, -1.0],
    "abs": [0.5, 1.0],
    "k2": [0.125, 0.5], "mse": [0.125, 0.5],  # 0.5 * d^2
    # k3 = exp(ref - logp) - (ref - logp) - 1: exp(-0.5) + 0.5 - 1 = 0.1065307; exp(1) - 1 - 1 = 0.7182818
    "k3": [math.exp(-0.5) - 0.5, math.e - 2], "low_var_kl": [math.exp(-0.5) - 0.5, math.e - 2],
}


@pytest.mark.parametrize("kind", sorted(KL_GOLDEN))
def test_kl_estimators(kind):
    close(kl_penalty(LOGP, REF, kind), KL_GOLDEN[kind])


def test_k3_clamps_like_verl():
    # d = -30: ref-logp = 30 -> clamped to 20 -> exp(20) - 21 -> clamped to 10
    # d = +30: ref-logp = -30 -> clamped to -20 -> exp(-20) + 19 = 19.000000002 -> clamped to 10
    close(kl_penalty(T([0.0, 0.0]), T([30.0, -30.0]), "k3"), [10.0, 10.0])


@pytest.mark.parametrize("kind", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+", "k2+", "mse+"])
def test_straight_through_value_of_base_gradient_of_k2(kind):
    logp = LOGP.clone().requires_grad_(True)
    value = kl_penalty(logp, REF, kind)
    close(value.detach(), KL_GOLDEN[kind[:-1]])
    value.sum().backward()
    close(logp.grad, [0.5, -1.0])  # d/dlogp (0.5 d^2) = d


def test_plain_k3_gradient_differs_from_k2():
    logp = LOGP.clone().requires_grad_(True)
    kl_penalty(logp, REF, "k3").sum().backward()
    # d/dlogp [exp(-d) + d - 1] = 1 - exp(-d): 1 - exp(-0.5) = 0.3934693, 1 - e = -1.7182818
    close(logp.grad, [1 - math.exp(-0.5), 1 - math.e])


def test_apply_kl_penalty():
    # k1 = old - ref: row0 [0.5, 0, -0.5]; row1 [1, 0, (masked)]
    # rewards = scores - 0.1 * kl * m: row0 [-0.05, 0, 1.05]; row1 [-0.1, 2, 0]
    # per-sequence mean KL: row0 0/3 = 0, row1 1/2 = 0.5 -> batch mean 0.25
    scores = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    m = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.full((2, 3), -1.0)
    ref = T([[-1.5, -1.0, -0.5], [-2.0, -1.0, -3.0]])
    rewards, metrics = apply_kl_penalty(scores, old, ref, m, kl_coef=0.1, kind="k1")
    close(rewards, [[-0.05, 0.0, 1.05], [-0.1, 2.0, 0.0]])
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.25)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)


def test_kl_loss_aggregates_like_policy_loss():
    # k2 over d=[0.5, -1.0 (masked)] -> token losses [0.125, -]; token-mean with a mini-batch of 5 tokens
    m = T([[1.0, 0.0]])
    close(kl_loss(LOGP[None], REF[None], m, kind="k2", agg_mode="token-mean", global_token_count=5), 0.125 / 5)
    close(kl_loss(LOGP[None], REF[None], m, kind="k2"), 0.125)


# ----------------------------------------------------------------------------- policy losses

# clip_ratio_low=0.2, clip_ratio_high=0.28 (clip-higher), clip_ratio_c=3
# row0: t1 A=+1, log r=0.1 -> r=1.1051709 in [0.8, 1.28]: loss -1.1051709 (unclipped)
#       t2 A=+1, log r=0.4 -> r=1.4918247 > 1.28: loss max(-1.4918, -1.28) = -1.28 (clipped)
#       t3 A=-1, log r=-0.5 -> r=0.6065307 < 0.8: loss max(0.6065, 0.8) = 0.8 (clipped)
# row1: t4 A=-1, log r=1.5 -> r=4.4816891: ppo max(4.4817, 1.28) = 4.4817, dual min(4.4817, 3) = 3
#       t5, t6 masked (garbage values)
OLD = torch.zeros(2, 3)
NEW = T([[0.1, 0.4, -0.5], [1.5, 7.0, -9.0]])
ADV = T([[1.0, 1.0, -1.0], [-1.0, 5.0, 5.0]])
PM = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
VANILLA_TOKENS = [-math.exp(0.1), -1.28, 0.8, 3.0]


def test_vanilla_clip_higher_and_dual_clip():
    logp = NEW.clone().requires_grad_(True)
    loss, metrics = get_policy_loss("vanilla")(OLD, logp, ADV, PM, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                               clip_ratio_c=3.0)
    close(loss, sum(VANILLA_TOKENS) / 4)  # (-1.1051709 - 1.28 + 0.8 + 3) / 4 = 0.3537073
    assert float(metrics["pg_clipfrac"]) == pytest.approx(2 / 4)  # t2, t3
    assert float(metrics["pg_clipfrac_lower"]) == pytest.approx(1 / 4)  # t4
    assert float(metrics["ppo_kl"]) == pytest.approx(-(0.1 + 0.4 - 0.5 + 1.5) / 4)  # mean(old - new) = -0.375
    loss.backward()
    # only the unclipped t1 has a gradient: d/dlogp (-A r)/4 = -r/4; clipped and dual-clipped ones are flat
    close(logp.grad, [[-math.exp(0.1) / 4, 0, 0], [0, 0, 0]])


def test_vanilla_symmetric_clip_and_seq_mean():
    # symmetric 0.2: t2 is clipped at 1.2 instead of 1.28
    loss, _ = get_policy_loss("vanilla")(OLD, NEW, ADV, PM, clip_ratio_low=0.2, clip_ratio_high=0.2)
    close(loss, (-math.exp(0.1) - 1.2 + 0.8 + 3.0) / 4)
    # seq-mean-token-mean with clip-higher: row0 mean (-1.1051709 - 1.28 + 0.8)/3 = -0.5283903, row1 3 -> /2
    loss, _ = get_policy_loss("vanilla")(OLD, NEW, ADV, PM, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                         loss_agg_mode="seq-mean-token-mean")
    close(loss, ((-math.exp(0.1) - 1.28 + 0.8) / 3 + 3.0) / 2)


def test_vanilla_rollout_is_weights_scale_token_losses():
    # weights [2, 1, 1 | 0.5, (9, 9 masked)]: (-2*1.1051709 - 1.28 + 0.8 + 0.5*3) / 4 = -0.2975855
    w = T([[2.0, 1.0, 1.0], [0.5, 9.0, 9.0]])
    loss, _ = get_policy_loss("vanilla")(OLD, NEW, ADV, PM, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                         rollout_is_weights=w)
    close(loss, (-2 * math.exp(0.1) - 1.28 + 0.8 + 1.5) / 4)


def test_vanilla_rejects_bad_dual_clip():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss("vanilla")(OLD, NEW, ADV, PM, clip_ratio_c=1.0)


def test_gspo_sequence_ratio():
    # row0: logp-old = [0.1, 0.3, (5.0 masked)] -> seq log ratio 0.2, s = exp(0.2) = 1.2214028, A = +1
    # row1: [-0.2, -0.2, -0.2] -> s = exp(-0.2) = 0.8187308, A = -0.5
    # clip 0.2/0.2: row0 s > 1.2 -> token loss max(-1.2214, -1.2) = -1.2 (clipped, no gradient)
    #               row1 s in [0.8, 1.2] -> token loss 0.5 * 0.8187308 = 0.4093654
    # seq-mean-token-mean: (-1.2 + 0.4093654) / 2 = -0.3953173
    old = torch.zeros(2, 3)
    new = T([[0.1, 0.3, 5.0], [-0.2, -0.2, -0.2]])
    adv = T([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
    m = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    logp = new.clone().requires_grad_(True)
    loss, metrics = get_policy_loss("gspo")(old, logp, adv, m, clip_ratio_low=0.2, clip_ratio_high=0.2)
    close(loss, (-1.2 + 0.5 * math.exp(-0.2)) / 2)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(2 / 5)
    assert float(metrics["pg_clipfrac_lower"]) == 0.0
    assert float(metrics["ppo_kl"]) == pytest.approx(-(0.1 + 0.3 - 0.6) / 5)
    loss.backward()
    # token gradient = -A * s (straight-through: the value is s, d/dlogp_t = s), averaged over the
    # 3 tokens of row1 and the 2 sequences: 0.5 * 0.8187308 / 6 = 0.0682276
    g = 0.5 * math.exp(-0.2) / 6
    close(logp.grad, [[0.0, 0.0, 0.0], [g, g, g]])

    # with clip_ratio_high=0.25 row0 is not clipped: gradient -1 * 1.2214028 / (2 tokens * 2 seqs)
    logp = new.clone().requires_grad_(True)
    loss, _ = get_policy_loss("gspo")(old, logp, adv, m, clip_ratio_low=0.2, clip_ratio_high=0.25)
    close(loss, (-math.exp(0.2) + 0.5 * math.exp(-0.2)) / 2)
    loss.backward()
    close(logp.grad[0], [-math.exp(0.2) / 4, -math.exp(0.2) / 4, 0.0])


# ----------------------------------------------------------------------------- value loss, entropy

def test_value_loss_clipped():
    # cliprange 0.2
    # t1: V=1.0, V_old=0.5, R=2.0: (1-2)^2 = 1; clip V to 0.7: (0.7-2)^2 = 1.69 -> 1.69 (clipped wins)
    # t2: V=2.0, V_old=2.5, R=1.5: (0.5)^2 = 0.25; clip to 2.3: (0.8)^2 = 0.64 -> 0.64 (clipped wins)
    # t3: V=1.0, V_old=0.5, R=0.6: (0.4)^2 = 0.16; clip to 0.7: (0.1)^2 = 0.01 -> 0.16
    # t4 masked. loss = 0.5 * (1.69 + 0.64 + 0.16)/3 = 0.415; clipfrac 2/3
    vpreds = T([[1.0, 2.0, 1.0, 50.0]])
    values = T([[0.5, 2.5, 0.5, 0.0]])
    returns = T([[2.0, 1.5, 0.6, 0.0]])
    m = T([[1.0, 1.0, 1.0, 0.0]])
    loss, clipfrac = compute_value_loss(vpreds, returns, values, m, cliprange_value=0.2)
    close(loss, 0.415)
    close(clipfrac, 2 / 3)
    loss, clipfrac = compute_value_loss(vpreds, returns, values, m, cliprange_value=None)
    close(loss, 0.5 * (1 + 0.25 + 0.16) / 3)
    close(clipfrac, 0.0)


def test_entropy_from_logits():
    # uniform over 4: ln 4 = 1.3862944
    # p = [0.25, 0.75]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.3465736 + 0.2157616 = 0.5623351
    # [1000, 1000, -inf]: uniform over 2 -> ln 2, finite despite the huge and -inf logits
    close(entropy_from_logits(torch.zeros(4)), math.log(4))
    close(entropy_from_logits(T([0.0, math.log(3.0)])), 0.5623351, tol=1e-6)
    logits = T([[1000.0, 1000.0, float("-inf")]], requires_grad=True)
    h = entropy_from_logits(logits)
    close(h.detach(), [math.log(2)])
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_gradient_matches_autograd_of_naive_formula():
    torch.manual_seed(0)
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    entropy_from_logits(x).sum().backward()
    y = x.detach().clone().requires_grad_(True)
    p = torch.softmax(y, -1)
    (-(p * torch.log_softmax(y, -1)).sum(-1)).sum().backward()
    close(x.grad, y.grad, tol=1e-10)
