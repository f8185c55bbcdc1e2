"""rlcore.algos: registries and errors, KL controllers, masked statistics, group ids, backends."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from rlcore.algos import (
    AdaptiveKLController,
    FixedKLController,
    advantage_estimator_names,
    compute_advantage,
    discounted_returns,
    gae_raw,
    get_advantage_estimator,
    get_policy_loss,
    group_ids_from_uids,
    group_outcome_advantage,
    kl_penalty,
    make_kl_controller,
    masked_mean,
    masked_var,
    masked_whiten,
    register_advantage_estimator,
)
from rlcore.algos.advantages import _native_fn

T = torch.tensor


# ----------------------------------------------------------------------------- names and errors

def test_estimator_registry_has_every_estimator():
    assert {"gae", "grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
            "remax"} <= set(advantage_estimator_names())


def test_unknown_names_raise_value_error_listing_choices():
    r, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*'grpo'.*'rloo'"):
        compute_advantage("ppo", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match=r"'k4'.*'k1'.*'low_var_kl'"):
        kl_penalty(r, r, "k4")
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'.*'gspo'.*'vanilla'"):
        get_policy_loss("ppo")
    with pytest.raises(ValueError, match=r"'pid'.*'fixed'.*'adaptive'"):
        make_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError, match=r"'mean'.*'grpo'.*'rloo'"):
        group_outcome_advantage(torch.zeros(2), T([0, 0]), "mean")
    with pytest.raises(ValueError, match="backend"):
        gae_raw(r, r, m, 1.0, 1.0, backend="cuda")


def test_missing_inputs_name_the_field():
    r, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="'gae' needs values"):
        compute_advantage("gae", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="'rloo' needs group_ids"):
        compute_advantage("rloo", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="'remax' needs reward_baselines"):
        compute_advantage("remax", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match=r"group_ids must have shape \(2,\)"):
        compute_advantage("grpo", token_level_rewards=r, response_mask=m, group_ids=[0, 0, 1])
    with pytest.raises(ValueError, match="response_mask has shape"):
        compute_advantage("grpo", token_level_rewards=r, response_mask=m[:, :2], group_ids=[0, 0])
    with pytest.raises(ValueError, match="adaptive KL controller needs horizon"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0)


def test_custom_estimator_registration():
    @register_advantage_estimator("test_constant_one", overwrite=True)
    def _one(*, token_level_rewards, response_mask, **_):
        return response_mask.clone(), response_mask.clone()

    assert get_advantage_estimator("test_constant_one") is _one
    adv, _ = compute_advantage("test_constant_one", token_level_rewards=torch.zeros(1, 2),
                               response_mask=T([[1.0, 0.0]]))
    assert adv.tolist() == [[1.0, 0.0]]
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("grpo")(_one)


# ----------------------------------------------------------------------------- KL controllers

def test_adaptive_kl_controller_updates():
    c = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.5, horizon=100)
    # kl 1.0: err = clip(1.0/0.5 - 1, +-0.2) = 0.2; value *= 1 + 0.2 * 10/100 = 1.02 -> 0.102
    c.update(current_kl=1.0, n_steps=10)
    assert c.value == pytest.approx(0.102)
    # kl 0.45: err = 0.9 - 1 = -0.1; value *= 1 - 0.1 * 20/100 = 0.98 -> 0.09996
    c.update(current_kl=0.45, n_steps=20)
    assert c.value == pytest.approx(0.09996)


def test_fixed_kl_controller_is_constant():
    c = make_kl_controller("fixed", kl_coef=0.05)
    c.update(current_kl=100.0, n_steps=1000)
    assert isinstance(c, FixedKLController) and c.value == 0.05


def test_kl_controller_state_round_trip():
    a = make_kl_controller("adaptive", kl_coef=0.2, target_kl=3.0, horizon=1000)
    a.update(current_kl=6.0, n_steps=64)
    state = a.state_dict()
    b = make_kl_controller("adaptive", kl_coef=1.0, target_kl=9.0, horizon=9.0)
    b.load_state_dict(state)
    assert b.state_dict() == state
    for kl in (1.0, 2.5, 4.0):  # the restored controller continues exactly like the original
        a.update(kl, 64)
        b.update(kl, 64)
        assert b.value == a.value
    f = make_kl_controller("fixed", kl_coef=0.3)
    g = make_kl_controller("fixed", kl_coef=0.0)
    g.load_state_dict(f.state_dict())
    assert g.value == 0.3
    with pytest.raises(ValueError, match="'adaptive' KL controller loaded into a 'fixed'"):
        g.load_state_dict(state)


# ----------------------------------------------------------------------------- masked statistics

def test_masked_statistics():
    x = T([[1.0, 2.0, 100.0], [3.0, float("nan"), 4.0]])
    m = T([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    # valid 1, 2, 3, 4: mean 2.5, unbiased var (2.25 + 0.25 + 0.25 + 2.25)/3 = 5/3, biased 1.25
    assert float(masked_mean(x, m)) == pytest.approx(2.5)
    assert masked_mean(x, m, dim=-1).tolist() == pytest.approx([1.5, 3.5])
    assert float(masked_var(x, m)) == pytest.approx(5 / 3)
    assert float(masked_var(x, m, unbiased=False)) == pytest.approx(1.25)
    w = masked_whiten(x, m)
    assert w[m.bool()].tolist() == pytest.approx([(v - 2.5) / (5 / 3) ** 0.5 for v in (1, 2, 3, 4)])
    w = masked_whiten(x, m, shift_mean=False)
    assert w[m.bool()].tolist() == pytest.approx([(v - 2.5) / (5 / 3) ** 0.5 + 2.5 for v in (1, 2, 3, 4)])
    assert masked_mean(x, torch.zeros_like(m), dim=-1).tolist() == [0.0, 0.0]  # empty -> 0, not NaN
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(x, T([[1.0, 0, 0], [0, 0, 0]]))


# ----------------------------------------------------------------------------- group ids

def test_group_ids_from_uids_first_appearance_order():
    assert group_ids_from_uids(["b", "a", "b", "c", "a"]).tolist() == [0, 1, 0, 2, 1]
    ids = group_ids_from_uids(np.array(["u9", "u1", "u9"], dtype=object))
    assert ids.dtype == np.int64 and ids.tolist() == [0, 1, 0]
    assert group_ids_from_uids([]).shape == (0,)


def _loop_reference(scores, gids, mode, eps):
    """verl-style per-group loop (singletons keep their score), as an independent reference."""
    groups = defaultdict(list)
    for s, g in zip(scores.tolist(), gids.tolist()):
        groups[g].append(s)
    out = []
    for s, g in zip(scores.tolist(), gids.tolist()):
        xs = torch.tensor(groups[g], dtype=torch.float64)
        n = len(xs)
        if n == 1:
            out.append(s)
        elif mode == "grpo":
            out.append((s - xs.mean().item()) / (xs.std().item() + eps))
        elif mode == "rloo":
            out.append(s * n / (n - 1) - xs.mean().item() * n / (n - 1))
        else:
            out.append(s - xs.mean().item())
    return out


@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"])
def test_vectorised_groups_match_loop_reference(mode):
    g = torch.Generator().manual_seed(1)
    gids = torch.randint(0, 30, (64,), generator=g)  # random group sizes
    assert (torch.bincount(gids) == 1).any()  # including singletons
    scores = torch.randint(0, 3, (64,), generator=g).float() + 0.1 * torch.randn(64, generator=g)
    out = group_outcome_advantage(scores, gids, mode, eps=1e-6, backend="torch")
    assert out.dtype == torch.float32
    expected = torch.tensor(_loop_reference(scores, gids, mode, 1e-6), dtype=torch.float64)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- backends

def _random_batch(seed=2, b=6, t=7):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, t, generator=g)
    values = torch.randn(b, t, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    mask[0, 2] = 0.0  # an interior masked token (multi-turn observation)
    return rewards, values, mask


@pytest.mark.parametrize("native_name", ["gae", "group_advantages", "discounted_returns"])
def test_auto_backend_matches_torch(native_name):
    if _native_fn(native_name) is None:
        pytest.skip(f"rlcore._native has no {native_name} yet")
    rewards, values, mask = _random_batch()
    if native_name == "gae":
        for a, b in zip(gae_raw(rewards, values, mask, 0.99, 0.95, backend="auto"),
                        gae_raw(rewards, values, mask, 0.99, 0.95, backend="torch")):
            torch.testing.assert_close(a * mask, b * mask, rtol=1e-5, atol=1e-5)
    elif native_name == "discounted_returns":
        torch.testing.assert_close(discounted_returns(rewards, mask, 0.9, backend="auto"),
                                   discounted_returns(rewards, mask, 0.9, backend="torch"), rtol=1e-5, atol=1e-5)
    else:
        gids = T([0, 0, 1, 1, 1, 2])
        for mode in ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"):
            torch.testing.assert_close(group_outcome_advantage(rewards[:, 0], gids, mode, backend="auto"),
                                       group_outcome_advantage(rewards[:, 0], gids, mode, backend="torch"),
                                       rtol=1e-5, atol=1e-5)


def test_native_backend_with_the_extension_switched_off_raises(monkeypatch):
    import rlcore.algos.advantages as adv_mod
    monkeypatch.setattr(adv_mod, "_native_fn", lambda name: None)  # what RLCORE_NATIVE=off gives
    rewards, values, mask = _random_batch()
    with pytest.raises(RuntimeError, match=r"backend='native' but the extension is switched off \(RLCORE_NATIVE=off\)"):
        gae_raw(rewards, values, mask, 1.0, 1.0, backend="native")
    adv, _ = gae_raw(rewards, values, mask, 1.0, 1.0)  # auto: the torch reference
    torch.testing.assert_close(adv, gae_raw(rewards, values, mask, 1.0, 1.0, backend="torch")[0])


def test_float64_and_grad_inputs_keep_dtype_and_take_torch_path():
    rewards, values, mask = _random_batch()
    adv64, _ = gae_raw(rewards.double(), values.double(), mask, 0.99, 0.95)  # auto
    adv32, _ = gae_raw(rewards, values, mask, 0.99, 0.95, backend="torch")
    assert adv64.dtype == torch.float64
    torch.testing.assert_close(adv64.float() * mask, adv32 * mask, rtol=1e-5, atol=1e-5)
    out = discounted_returns(rewards.requires_grad_(True), mask, 1.0)
    assert not out.requires_grad  # advantages are targets: computed without grad


def test_auto_dispatch_rules_with_a_fake_native(monkeypatch):
    """'auto' sends float32 CPU tensors without grad to native (numpy in, numpy out) and
    everything else to torch; results come back as tensors of the input's dtype."""
    calls = []

    def fake_discounted_returns(rewards, mask, gamma):
        assert isinstance(rewards, np.ndarray) and rewards.dtype == np.float32
        calls.append(gamma)
        return np.full(rewards.shape, 7.0, dtype=np.float32)

    import rlcore.algos.advantages as adv_mod
    monkeypatch.setattr(adv_mod, "_native_fn", lambda name: fake_discounted_returns)
    rewards, _, mask = _random_batch()
    out = discounted_returns(rewards, mask, 0.5)
    assert calls == [0.5] and torch.is_tensor(out) and out.dtype == torch.float32 and float(out[0, 0]) == 7.0
    discounted_returns(rewards.double(), mask, 0.5)  # float64 -> torch
    discounted_returns(rewards, mask, 0.5, backend="torch")
    assert calls == [0.5]
    out = discounted_returns(rewards.double(), mask, 0.25, backend="native")  # forced: cast back
    assert calls == [0.5, 0.25] and out.dtype == torch.float64
