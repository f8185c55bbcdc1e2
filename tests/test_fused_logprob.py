"""Chunked torch path of fused_token_logprobs against the naive full log-softmax.

Tolerances: fp32 inputs 1e-5 (abs) on log-prob/entropy/KL and 1e-5 relative to the largest
gradient entry; bf16 inputs: values 1e-5 (both sides upcast the same bf16 numbers to fp32),
gradients 1e-2 relative (they are returned in bf16, whose rounding step is 2^-8).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.triton_kernels import (
    fused_token_logprobs,
    naive_token_logprobs,
    resolve_backend,
    token_kl,
)


def _inputs(n=37, h=24, v=101, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (0.5 * torch.randn(v, h, generator=g)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    ref = -3.0 + torch.randn(n, generator=g)
    return hidden, weight, targets, ref


def _grads(out, hidden, weight, seed=1):
    """d/d(hidden, weight) of a random linear combination of all three outputs."""
    g = torch.Generator().manual_seed(seed)
    n = out.logprobs.shape
    loss = (out.logprobs * torch.randn(n, generator=g)).sum()
    loss = loss + (out.entropy * torch.randn(n, generator=g)).sum()
    loss = loss + (out.kl * torch.randn(n, generator=g)).sum()
    return torch.autograd.grad(loss, [hidden, weight])


def _assert_rel(actual, expected, rtol):
    scale = expected.float().abs().max().clamp_min(1.0)
    err = (actual.float() - expected.float()).abs().max()
    assert err <= rtol * scale, f"max abs err {err:.3g} > {rtol} * {scale:.3g}"


@pytest.mark.parametrize(
    "chunk_tokens,chunk_vocab",
    [(1024, None), (7, None), (8, 17), (5, 1), (37, 101)],
    ids=["one-chunk", "tokens-7", "tokens-8-vocab-17", "vocab-1", "exact"],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("kl_kind", ["k1", "k2", "k3"])
def test_fp32_values_and_grads_match_naive(chunk_tokens, chunk_vocab, temperature, kl_kind):
    hidden, weight, targets, ref = _inputs()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    kw = dict(temperature=temperature, ref_logprobs=ref, kl_kind=kl_kind)
    got = fused_token_logprobs(
        hidden, weight, targets, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab, backend="torch", **kw
    )
    want = naive_token_logprobs(hidden, weight, targets, **kw)
    for name in ("logprobs", "entropy", "kl"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == torch.float32 and a.shape == (37,)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    for a, b in zip(_grads(got, hidden, weight), _grads(want, hidden, weight)):
        _assert_rel(a, b, 1e-5)


def test_bf16_inputs_accumulate_in_fp32():
    hidden, weight, targets, ref = _inputs(dtype=torch.bfloat16)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    got = fused_token_logprobs(hidden, weight, targets, ref_logprobs=ref, chunk_tokens=8, chunk_vocab=32,
                               temperature=0.9, backend="torch")
    want = naive_token_logprobs(hidden, weight, targets, ref_logprobs=ref, temperature=0.9)
    assert got.logprobs.dtype == torch.float32
    for name in ("logprobs", "entropy", "kl"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-5, rtol=1e-5, msg=name)
    grads = _grads(got, hidden, weight)
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.bfloat16
    for a, b in zip(grads, _grads(want, hidden, weight)):
        _assert_rel(a, b, 1e-2)


def test_single_token_and_leading_dims():
    hidden, weight, targets, ref = _inputs(n=1)
    got = fused_token_logprobs(hidden, weight, targets, ref_logprobs=ref, backend="torch")
    want = naive_token_logprobs(hidden, weight, targets, ref_logprobs=ref)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)

    hidden, weight, targets, ref = _inputs(n=12)
    got = fused_token_logprobs(hidden.view(3, 4, -1), weight, targets.view(3, 4), chunk_tokens=5,
                               ref_logprobs=ref.view(3, 4), backend="torch")
    assert got.logprobs.shape == (3, 4) and got.entropy.shape == (3, 4) and got.kl.shape == (3, 4)
    want = naive_token_logprobs(hidden, weight, targets, ref_logprobs=ref)
    torch.testing.assert_close(got.logprobs.reshape(-1), want.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.kl.reshape(-1), want.kl, atol=1e-5, rtol=1e-5)


def test_entropy_gradient_formula_against_autograd():
    # The backward uses dH/dz = -p * (log p + H); check that derivation on raw logits.
    z = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(z, -1)
    ent = -(logp.exp() * logp).sum(-1)
    (auto,) = torch.autograd.grad(ent.sum(), z)
    p = logp.detach().exp()
    manual = -p * (logp.detach() + ent.detach()[:, None])
    torch.testing.assert_close(manual, auto)

    # ... and through the fused path: only the entropy carries gradient.
    hidden, weight, targets, _ = _inputs()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    got = fused_token_logprobs(hidden, weight, targets, chunk_tokens=6, chunk_vocab=40, backend="torch")
    want = naive_token_logprobs(hidden, weight, targets)
    ga = torch.autograd.grad(got.entropy.sum(), [hidden, weight])
    gb = torch.autograd.grad(want.entropy.sum(), [hidden, weight])
    for a, b in zip(ga, gb):
        _assert_rel(a, b, 1e-5)


def test_frozen_head_and_no_grad():
    hidden, weight, targets, _ = _inputs()
    hidden.requires_grad_(True)
    out = fused_token_logprobs(hidden, weight, targets, chunk_tokens=9, backend="torch")
    (gh,) = torch.autograd.grad(out.logprobs.sum(), [hidden])
    want = naive_token_logprobs(hidden, weight, targets)
    (gh_ref,) = torch.autograd.grad(want.logprobs.sum(), [hidden])
    _assert_rel(gh, gh_ref, 1e-5)
    with torch.no_grad():
        out = fused_token_logprobs(hidden, weight, targets, compute_entropy=False, backend="torch")
    assert out.entropy is None and out.kl is None and not out.logprobs.requires_grad


def test_kl_definitions_by_hand():
    logp = torch.tensor([-1.0, -1.0, -1.0, -30.0])
    ref = torch.tensor([-2.0, -1.0, -0.5, -0.1])
    torch.testing.assert_close(token_kl(logp, ref, "k1"), logp - ref)
    torch.testing.assert_close(token_kl(logp, ref, "k2"), torch.tensor([0.5, 0.0, 0.125, 0.5 * 29.9**2]))
    # k3: d = ref - logp; exp(d) - d - 1, with d clamped to 20 and the result to 10.
    k3 = token_kl(logp, ref, "k3")
    expected = torch.tensor([math.exp(-1) + 1 - 1, 0.0, math.exp(0.5) - 0.5 - 1, 10.0])
    torch.testing.assert_close(k3, expected)
    assert token_kl(logp, ref, "low_var_kl").equal(k3)


def test_kl_gradient_is_zero_where_clamped():
    hidden, weight, targets, _ = _inputs(n=4)
    hidden.requires_grad_(True)
    lp = naive_token_logprobs(hidden, weight, targets).logprobs.detach()
    ref = lp.clone()
    ref[0] = lp[0] + 25.0  # ref - logp = 25: clamped, so the KL is flat in logp
    out = fused_token_logprobs(hidden, weight, targets, ref_logprobs=ref, backend="torch")
    assert out.kl[0].item() == pytest.approx(10.0)
    (gh,) = torch.autograd.grad(out.kl[0], [hidden])
    assert gh.abs().max().item() == 0.0


def test_peak_temporary_is_one_chunk_not_full_logits():
    # The largest single allocation in forward+backward must be a [chunk, V] tile, far below [N, V].
    n, h, v, chunk = 256, 8, 2048, 16
    hidden, weight, targets, _ = _inputs(n=n, h=h, v=v)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fused_token_logprobs(hidden, weight, targets, chunk_tokens=chunk, backend="torch")
        torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), [hidden, weight])
    biggest = max(e.cpu_memory_usage for e in prof.events())
    full_logits = n * v * 4
    assert chunk * v * 4 <= biggest < full_logits / 4, (biggest, full_logits)


def test_auto_backend_is_torch_on_cpu_and_triton_needs_cuda_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        resolve_backend("triton", torch.device("cpu"))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kl_kind="k4"), "kl_kind='k4'"),
        (dict(backend="cuda"), "backend='cuda'"),
        (dict(temperature=0.0), "temperature"),
        (dict(chunk_tokens=0), "chunk_tokens"),
        (dict(chunk_vocab=0), "chunk_vocab"),
        (dict(ref_logprobs=torch.zeros(3)), "ref_logprobs shape"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, match):
    hidden, weight, targets, _ = _inputs(n=5)
    with pytest.raises(ValueError, match=match):
        fused_token_logprobs(hidden, weight, targets, **kwargs)


def test_bad_shapes_and_targets_name_the_field():
    hidden, weight, targets, _ = _inputs(n=5, h=24, v=101)
    with pytest.raises(ValueError, match="hidden size mismatch"):
        fused_token_logprobs(hidden[:, :10], weight, targets)
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 101\)"):
        fused_token_logprobs(hidden, weight, torch.tensor([0, 1, 2, 3, 101]))
    with pytest.raises(ValueError, match="targets shape"):
        fused_token_logprobs(hidden, weight, targets[:4])
    with pytest.raises(TypeError, match="targets must be an integer"):
        fused_token_logprobs(hidden, weight, targets.float())


def test_zero_tokens():
    hidden, weight, _, _ = _inputs(n=1)
    hidden = hidden[:0].requires_grad_(True)
    weight.requires_grad_(True)
    out = fused_token_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), backend="torch")
    assert out.logprobs.shape == (0,)
    gh, gw = torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), [hidden, weight])
    assert gh.shape == (0, 24) and gw.abs().sum().item() == 0.0
