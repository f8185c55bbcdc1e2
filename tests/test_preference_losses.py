"""Hand-computed golden values for the DPO family and KTO losses. The arithmetic is in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.algos import DPO_LOSS_TYPES, dpo_loss, kto_loss, kto_reference_point, kto_reference_point_from_sums

T = torch.tensor
LN2, LN3, LN4, LN43 = math.log(2), math.log(3), math.log(4), math.log(4 / 3)


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=tol)


# Two pairs. A: chosen log-ratio ln3 (pc=-2+ln3, rc=-2), rejected log-ratio 0 (pr=rr=-4): h = ln3.
#            B: both log-ratios 0: h = 0.
PC, RC = T([-2.0 + LN3, -1.0]), T([-2.0, -1.0])
PR, RR = T([-4.0, -3.0]), T([-4.0, -3.0])


def test_dpo_sigmoid():
    # beta=1. A: -log s(ln3) = -log(3/4) = ln(4/3) = 0.287682; B: -log s(0) = ln2.
    out = dpo_loss(PC, PR, RC, RR, beta=1.0)
    close(out.losses, [LN43, LN2])
    close(out.chosen_rewards, [LN3, 0.0])
    close(out.rejected_rewards, [0.0, 0.0])


def test_dpo_label_smoothed_is_conservative_dpo():
    # eps=0.1. A: 0.9*ln(4/3) + 0.1*(-log s(-ln3) = -log(1/4) = ln4) = 0.258914 + 0.138629 = 0.397543
    #          B: 0.9*ln2 + 0.1*ln2 = ln2
    out = dpo_loss(PC, PR, RC, RR, beta=1.0, loss_type="sigmoid", label_smoothing=0.1)
    close(out.losses, [0.9 * LN43 + 0.1 * LN4, LN2])
    close(out.losses[0], 0.3975433, tol=1e-6)


def test_dpo_robust():
    # eps=0.1. A: (0.9*ln(4/3) - 0.1*ln4) / 0.8 = (0.258914 - 0.138629) / 0.8 = 0.150356
    #          B: (0.9*ln2 - 0.1*ln2) / 0.8 = ln2
    out = dpo_loss(PC, PR, RC, RR, beta=1.0, loss_type="robust", label_smoothing=0.1)
    close(out.losses, [0.1503555, LN2], tol=1e-6)
    # without noise, robust DPO is plain DPO
    close(dpo_loss(PC, PR, RC, RR, beta=1.0, loss_type="robust").losses, [LN43, LN2])


def test_dpo_ipo():
    # beta=0.5: target margin 1/(2*0.5) = 1. A: (ln3 - 1)^2 = 0.0986123^2 = 0.00972438; B: (0 - 1)^2 = 1
    out = dpo_loss(PC, PR, RC, RR, beta=0.5, loss_type="ipo")
    close(out.losses, [0.00972438, 1.0], tol=1e-7)
    close(out.chosen_rewards, [0.5 * LN3, 0.0])


def test_dpo_gradient_at_the_reference():
    # At h=0: d/d(pc) -log s(beta h) = -beta (1 - s(0)) = -beta/2; d/d(pr) = +beta/2.
    pc, pr = T([-1.0], requires_grad=True), T([-3.0], requires_grad=True)
    dpo_loss(pc, pr, T([-1.0]), T([-3.0]), beta=0.4).losses.sum().backward()
    close(pc.grad, [-0.2])
    close(pr.grad, [0.2])


def test_dpo_rejects_bad_settings():
    with pytest.raises(ValueError, match="unknown DPO loss_type 'hinge'"):
        dpo_loss(PC, PR, RC, RR, loss_type="hinge")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(PC, PR, RC, RR, loss_type="robust", label_smoothing=0.5)
    assert set(DPO_LOSS_TYPES) == {"sigmoid", "ipo", "robust"}


def test_kto_reference_point_and_weights():
    # Mismatched pairs: log-ratios (-1) - (-1-2ln3) = 2ln3 and (-3) - (-3) = 0 -> z0 = mean = ln3.
    z0 = kto_reference_point(T([-1.0, -3.0]), T([-1.0 - 2 * LN3, -3.0]))
    close(z0, LN3)
    # rows: desirable r=2ln3 -> 1 - s(2ln3 - ln3) = 1 - 3/4 = 0.25 (w_d = 1)
    #       undesirable r=0 -> 1 - s(ln3 - 0) = 0.25, times w_u = 2 -> 0.5
    #       desirable r=0 -> 1 - s(0 - ln3) = 1 - 1/4 = 0.75
    policy, ref = T([-5.0 + 2 * LN3, -6.0, -7.0]), T([-5.0, -6.0, -7.0])
    out = kto_loss(policy, ref, T([True, False, True]), z0, beta=1.0, desirable_weight=1.0, undesirable_weight=2.0)
    close(out.losses, [0.25, 0.5, 0.75])
    close(out.chosen_rewards, [2 * LN3, 0.0, 0.0])
    assert out.rejected_rewards is None


def test_kto_reference_point_is_clamped_and_detached():
    # log-ratios -1 and -3: mean -2 < 0 -> z0 = 0; a desirable row at r=0 then costs 1 - s(0) = 0.5
    policy_kl = T([-2.0, -4.0], requires_grad=True)
    z0 = kto_reference_point(policy_kl, T([-1.0, -1.0]))
    close(z0, 0.0)
    close(kto_reference_point_from_sums(-4.0, 2), 0.0)
    close(kto_reference_point_from_sums(2 * LN3, 2), LN3)
    policy = T([-1.0], requires_grad=True)
    z = kto_reference_point(policy_kl, T([-3.0, -5.0]))  # mean log-ratio 1 -> z0 = 1
    close(z, 1.0)
    loss = kto_loss(policy, T([-1.0]), T([True]), z, beta=1.0).losses.sum()
    close(loss, 1 - 1 / (1 + math.exp(1.0)))  # 1 - s(0 - 1)
    loss.backward()
    assert policy.grad is not None and policy_kl.grad is None  # no gradient through z0
