"""Chunked torch path of fused_token_logprobs against the naive full log-softmax, with the LM
head's own semantics (bias, logit scale, final soft-cap).

Tolerances: fp32 inputs 1e-5 (abs) on log-prob/entropy and 1e-5 relative to the largest
gradient entry; bf16 inputs: values 1e-5 (both sides upcast the same bf16 numbers to fp32),
gradients 1e-2 relative (they are returned in bf16, whose rounding step is 2^-8).
"""

from __future__ import annotations

import pytest
import torch

from rlcore.triton_kernels import fused_token_logprobs, naive_token_logprobs, resolve_backend


def _inputs(n=37, h=24, v=101, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (0.5 * torch.randn(v, h, generator=g)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    bias = (2.0 * torch.randn(v, generator=g)).to(dtype)
    return hidden, weight, targets, bias


def _grads(out, params, seed=1):
    """d/d(params) of a random linear combination of both outputs."""
    g = torch.Generator().manual_seed(seed)
    n = out.logprobs.shape
    loss = (out.logprobs * torch.randn(n, generator=g)).sum()
    loss = loss + (out.entropy * torch.randn(n, generator=g)).sum()
    return torch.autograd.grad(loss, params)


# (bias, logit_scale, softcap): a plain head; Phi/GPT-J (bias); Cohere (scale); Gemma 2 (soft-cap,
# here tight enough that many logits saturate); and all three at once.
HEADS = {
    "plain": (False, 1.0, None),
    "bias": (True, 1.0, None),
    "scale": (False, 0.0625, None),
    "softcap": (False, 1.0, 3.0),
    "all": (True, 2.5, 4.0),
}


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
@pytest.mark.parametrize("head", list(HEADS))
def test_fp32_values_and_grads_match_naive(chunk_tokens, chunk_vocab, temperature, head):
    hidden, weight, targets, bias = _inputs()
    with_bias, scale, cap = HEADS[head]
    params = [hidden.requires_grad_(True), weight.requires_grad_(True)]
    if with_bias:
        params.append(bias.requires_grad_(True))
    kw = dict(temperature=temperature, bias=bias if with_bias else None, logit_scale=scale, softcap=cap)
    got = fused_token_logprobs(
        hidden, weight, targets, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab, backend="torch", **kw
    )
    want = naive_token_logprobs(hidden, weight, targets, **kw)
    for name in ("logprobs", "entropy"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == torch.float32 and a.shape == (37,)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    for a, b in zip(_grads(got, params), _grads(want, params)):
        _assert_rel(a, b, 1e-5)


@pytest.mark.parametrize("head", ["bias", "scale", "softcap"])
def test_head_semantics_change_the_result(head):
    """Each head feature matters on these inputs: dropping it (the old `hidden @ W.T`) would fail."""
    hidden, weight, targets, bias = _inputs()
    with_bias, scale, cap = HEADS[head]
    full = naive_token_logprobs(hidden, weight, targets, bias=bias if with_bias else None, logit_scale=scale,
                                softcap=cap).logprobs
    plain = fused_token_logprobs(hidden, weight, targets, backend="torch").logprobs
    assert (full - plain).abs().max().item() > 0.1


def test_softcap_logits_equal_gemma2_formula():
    """The naive reference itself: logits / cap, tanh, * cap (transformers' Gemma2ForCausalLM)."""
    hidden, weight, targets, _ = _inputs(n=6)
    logits = hidden @ weight.T
    capped = torch.tanh(logits / 3.0) * 3.0
    want = torch.log_softmax(capped / 0.8, -1).gather(-1, targets[:, None]).squeeze(-1)
    got = naive_token_logprobs(hidden, weight, targets, softcap=3.0, temperature=0.8).logprobs
    torch.testing.assert_close(got, want)


def test_bf16_inputs_accumulate_in_fp32():
    hidden, weight, targets, bias = _inputs(dtype=torch.bfloat16)
    params = [hidden.requires_grad_(True), weight.requires_grad_(True), bias.requires_grad_(True)]
    kw = dict(bias=bias, softcap=5.0, temperature=0.9)
    got = fused_token_logprobs(hidden, weight, targets, chunk_tokens=8, chunk_vocab=32, backend="torch", **kw)
    want = naive_token_logprobs(hidden, weight, targets, **kw)
    assert got.logprobs.dtype == torch.float32
    for name in ("logprobs", "entropy"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-5, rtol=1e-5, msg=name)
    grads = _grads(got, params)
    assert all(g.dtype == torch.bfloat16 for g in grads)
    for a, b in zip(grads, _grads(want, params)):
        _assert_rel(a, b, 1e-2)


def test_single_token_and_leading_dims():
    hidden, weight, targets, _ = _inputs(n=1)
    got = fused_token_logprobs(hidden, weight, targets, backend="torch")
    want = naive_token_logprobs(hidden, weight, targets)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)

    hidden, weight, targets, _ = _inputs(n=12)
    got = fused_token_logprobs(hidden.view(3, 4, -1), weight, targets.view(3, 4), chunk_tokens=5, backend="torch")
    assert got.logprobs.shape == (3, 4) and got.entropy.shape == (3, 4)
    want = naive_token_logprobs(hidden, weight, targets)
    torch.testing.assert_close(got.logprobs.reshape(-1), want.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.entropy.reshape(-1), want.entropy, atol=1e-5, rtol=1e-5)


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
    assert out.entropy is None and not out.logprobs.requires_grad
    assert len(out) == 2  # (logprobs, entropy): no KL output (rlcore.algos.kl computes it from log-probs)


def test_frozen_head_weight_with_trainable_bias():
    hidden, weight, targets, bias = _inputs()
    bias.requires_grad_(True)
    out = fused_token_logprobs(hidden, weight, targets, bias=bias, chunk_tokens=7, chunk_vocab=30, backend="torch")
    (gb,) = torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), [bias])
    want = naive_token_logprobs(hidden, weight, targets, bias=bias)
    (gb_ref,) = torch.autograd.grad(want.logprobs.sum() + want.entropy.sum(), [bias])
    _assert_rel(gb, gb_ref, 1e-5)


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
        (dict(backend="cuda"), "backend='cuda'"),
        (dict(temperature=0.0), "temperature"),
        (dict(chunk_tokens=0), "chunk_tokens"),
        (dict(chunk_vocab=0), "chunk_vocab"),
        (dict(bias=torch.zeros(3)), "bias must be"),
        (dict(softcap=0.0), "softcap"),
        (dict(logit_scale=float("inf")), "logit_scale"),
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
