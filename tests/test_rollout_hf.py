"""HF rollout backend: log-probs against a full forward pass, greedy against `generate`, EOS,
n samples and seeds, top-k, weight updates (tied embeddings), the backend factory."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlcore.protocol import Batch
from rlcore.rollout import HFRolloutEngine, RolloutEngine, SamplingParams, make_rollout_engine
from rlcore.rollout import hf as hf_mod
from rlcore.rollout.output import TOKEN_VERSIONS
from rlcore.rollout.sampling import filter_logits, sample_categorical

PAD = 0
VOCAB = 64


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
        # With the default 0.02 init a tied random model just repeats its last input token;
        # a wider init gives varied greedy continuations with clear-cut argmaxes.
        initializer_range=0.4,
    )
    model = LlamaForCausalLM(cfg).eval()
    return model


def prompt_batch(lengths: list[int], seed: int = 1) -> Batch:
    """Left-padded prompts of the given lengths, ids in [3, VOCAB)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, width - n:] = 1
    uids = np.array([f"p{i}" for i in range(len(lengths))], dtype=object)
    return Batch(
        tensors={"input_ids": ids, "attention_mask": mask},
        meta={"uid": uids, "ground_truth": [str(i) for i in range(len(lengths))]},
        info={"step": 3},
    )


def reference_log_probs(model, out: Batch, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of a fresh full forward pass, at the response tokens."""
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"],
            position_ids=out["position_ids"],
        ).logits.float()
    p, r = out["prompts"].shape[1], out["responses"].shape[1]
    resp_logits = logits[:, p - 1: p + r - 1] / temperature
    return resp_logits.log_softmax(-1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def engine_for(model, eos=(2,)) -> HFRolloutEngine:
    return HFRolloutEngine(model, pad_token_id=PAD, eos_token_ids=list(eos))


def test_engine_satisfies_protocol(model):
    assert isinstance(engine_for(model), RolloutEngine)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 10, 0.9)])
def test_rollout_log_probs_match_full_forward(model, temperature, top_k, top_p):
    batch = prompt_batch([5, 9, 2, 7])
    params = SamplingParams(n=2, temperature=temperature, top_k=top_k, top_p=top_p,
                            max_new_tokens=12, seed=0)
    out = engine_for(model, eos=()).generate(batch, params)
    ref = reference_log_probs(model, out, temperature)
    mask = out["response_mask"].bool()
    assert mask.all()  # no EOS: every step is real
    torch.testing.assert_close(out["rollout_log_probs"], ref, atol=1e-5, rtol=0)
    assert out["rollout_log_probs"].dtype == torch.float32
    assert out.info == {"step": 3}  # the input's: data about the batch


def test_rollout_log_probs_with_early_stops(model):
    """Rows finishing at different steps (and dropped from the cache) keep exact log-probs."""
    batch = prompt_batch([5, 9, 2, 7, 4, 6])
    out = engine_for(model, eos=(2, 5, 9)).generate(
        batch, SamplingParams(n=3, temperature=0.8, max_new_tokens=16, seed=11)
    )
    mask = out["response_mask"]
    lengths = mask.sum(1)
    assert lengths.min() < lengths.max()  # some rows stopped early, at different steps
    ref = reference_log_probs(model, out, 0.8)
    # Cached decode vs one full forward in float32: rounding apart (1.25e-5 on an AVX2-only CPU).
    torch.testing.assert_close(out["rollout_log_probs"] * mask, ref * mask, atol=3e-5, rtol=0)
    # a row ends with its EOS exactly at its last real token
    ended = lengths < out["responses"].shape[1]
    last = out["responses"].gather(1, (lengths.long() - 1).unsqueeze(1)).squeeze(1)
    assert torch.isin(last[ended], torch.tensor([2, 5, 9])).all()


def test_output_layout(model):
    batch = prompt_batch([3, 6])
    out = engine_for(model, eos=()).generate(batch, SamplingParams(n=1, max_new_tokens=5, seed=0))
    p = batch["input_ids"].shape[1]
    assert out["input_ids"].shape == (2, p + 5)
    torch.testing.assert_close(out["input_ids"][:, :p], batch["input_ids"])
    torch.testing.assert_close(out["input_ids"][:, p:], out["responses"])
    # position ids count real tokens from the first one: prompt of 3 left-padded to 6.
    assert out["position_ids"][0].tolist() == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert out["position_ids"][1].tolist() == list(range(11))
    assert out["attention_mask"][0].tolist() == [0, 0, 0] + [1] * 8


def test_greedy_matches_hf_generate(model):
    batch = prompt_batch([4, 8, 1, 6], seed=5)
    out = engine_for(model, eos=()).generate(
        batch, SamplingParams(do_sample=False, max_new_tokens=10)
    )
    ref = model.generate(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False,
        max_new_tokens=10, min_new_tokens=10, pad_token_id=PAD, eos_token_id=None,
    )
    assert torch.equal(out["responses"], ref[:, batch["input_ids"].shape[1]:])
    # greedy reports log-probs at temperature 1
    torch.testing.assert_close(out["rollout_log_probs"], reference_log_probs(model, out, 1.0),
                               atol=1e-5, rtol=0)


def test_top_k_one_equals_greedy(model):
    batch = prompt_batch([4, 8, 1, 6], seed=5)
    greedy = engine_for(model, eos=()).generate(batch, SamplingParams(do_sample=False, max_new_tokens=10))
    topk = engine_for(model, eos=()).generate(
        batch, SamplingParams(n=3, top_k=1, max_new_tokens=10, seed=123)
    )
    assert torch.equal(topk["responses"], greedy["responses"].repeat_interleave(3, dim=0))


@pytest.mark.parametrize("compact_fraction", [0.25, 2.0])  # 2.0: finished rows never dropped
def test_eos_stops_row_and_pads_after(model, monkeypatch, compact_fraction):
    monkeypatch.setattr(hf_mod, "_COMPACT_FRACTION", compact_fraction)
    batch = prompt_batch([4, 8, 1, 6], seed=5)
    free = engine_for(model, eos=()).generate(batch, SamplingParams(do_sample=False, max_new_tokens=10))
    # Pick as EOS a token row 0 first produces at step >= 2, so that row stops mid-response.
    row0 = free["responses"][0].tolist()
    step = next(i for i in range(2, 10) if row0[i] not in row0[:i])
    eos = row0[step]
    out = engine_for(model, eos=(eos,)).generate(batch, SamplingParams(do_sample=False, max_new_tokens=10))
    resp, mask = out["responses"], out["response_mask"]
    for i in range(4):
        toks = free["responses"][i].tolist()
        stop = toks.index(eos) + 1 if eos in toks else 10
        # tokens up to and including EOS unchanged, mask 1 there (EOS included), then pad / 0
        assert resp[i, :stop].tolist() == toks[:stop]
        assert mask[i, :stop].tolist() == [1.0] * stop
        assert resp[i, stop:].eq(PAD).all() and mask[i, stop:].eq(0).all()
        assert out["rollout_log_probs"][i, stop:].eq(0).all()
    assert mask.dtype == torch.float32
    assert out["attention_mask"][0, batch["input_ids"].shape[1]:].tolist() == mask[0].long().tolist()
    # log-probs of real tokens still match the full forward pass
    ref = reference_log_probs(model, out, 1.0)
    torch.testing.assert_close(out["rollout_log_probs"] * mask, ref * mask, atol=1e-5, rtol=0)


def test_responses_trimmed_to_longest(model):
    """When every row stops early, responses are as long as the longest one, not max_new_tokens."""
    batch = prompt_batch([4, 8, 1, 6], seed=5)
    free = engine_for(model, eos=()).generate(batch, SamplingParams(do_sample=False, max_new_tokens=10))
    first = free["responses"][:, 0].tolist()
    # every row stops after one token when all first tokens are EOS
    out = engine_for(model, eos=first).generate(batch, SamplingParams(do_sample=False, max_new_tokens=10))
    assert out["responses"].shape == (4, 1)
    assert out["response_mask"].eq(1).all()


def test_n_samples_layout_and_seeds(model):
    batch = prompt_batch([3, 7, 5])
    eng = engine_for(model)
    params = SamplingParams(n=4, max_new_tokens=16, seed=7)
    out = eng.generate(batch, params)
    assert len(out) == 12
    assert out["uid"].tolist() == [f"p{i}" for i in range(3) for _ in range(4)]
    assert out["ground_truth"].tolist() == [str(i) for i in range(3) for _ in range(4)]
    assert torch.equal(out["prompts"], batch["input_ids"].repeat_interleave(4, dim=0))
    r = out["responses"].shape[1]
    assert 1 <= r <= 16
    for k in ("responses", "response_mask", "rollout_log_probs"):
        assert out[k].shape == (12, r)
    # samples of one prompt differ (sharpened model still samples diverse sequences)
    assert not torch.equal(out["responses"][0], out["responses"][1])
    again = eng.generate(batch, params)
    assert again.equal(out)
    other = eng.generate(batch, SamplingParams(n=4, max_new_tokens=16, seed=8))
    assert not torch.equal(other["responses"], out["responses"])


def test_right_padded_prompts_rejected(model):
    batch = prompt_batch([3, 5])
    batch.tensors["attention_mask"] = batch["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="LEFT-padded.*rows \\[0\\]"):
        engine_for(model).generate(batch, SamplingParams())


def test_update_weights_matches_fresh_model(model):
    batch = prompt_batch([4, 8, 2])
    params = SamplingParams(n=2, max_new_tokens=8, seed=3)
    target = tiny_model(seed=42)
    eng = engine_for(tiny_model(seed=0))
    before = eng.generate(batch, params)
    # Buckets of a few tensors each, the tied head sent under the lm_head name only.
    items = [(k, v.clone()) for k, v in target.state_dict().items() if k != "model.embed_tokens.weight"]
    assert any(k == "lm_head.weight" for k, _ in items)
    for i in range(0, len(items), 3):
        eng.update_weights(iter(items[i:i + 3]))
    after = eng.generate(batch, params)
    ref = engine_for(target).generate(batch, params)
    assert after.equal(ref)
    assert not torch.equal(before["rollout_log_probs"], after["rollout_log_probs"])


@pytest.mark.parametrize("name", ["lm_head.weight", "model.embed_tokens.weight"])
def test_update_weights_tied_embedding_either_name(name):
    m = tiny_model()
    eng = engine_for(m)
    new = torch.randn(VOCAB, 32)
    eng.update_weights([(name, new)])
    assert torch.equal(m.lm_head.weight, new) and torch.equal(m.model.embed_tokens.weight, new)


def test_update_weights_errors_name_the_key(model):
    eng = engine_for(tiny_model())
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
        eng.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(64, 32))])
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(31,\).*\(32,\)"):
        eng.update_weights([("model.norm.weight", torch.zeros(31))])


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    inf = float("-inf")
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True, True]]
    # nucleus 0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is still needed; 0.85 >= 0.8 stops there
    kept = filter_logits(logits, top_p=0.8) != inf
    assert kept.tolist() == [[True, True, True, False, False]]
    # the top token always survives
    assert (filter_logits(logits, top_p=0.1) != inf).tolist() == [[True, False, False, False, False]]


def test_sample_categorical_frequencies():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]]).expand(40_000, 6)
    draws = sample_categorical(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=6).double() / 40_000
    # filtered (zero) tokens never drawn, incl. the last; others within ~4 sigma (0.01)
    assert freq[[0, 2, 5]].eq(0).all()
    torch.testing.assert_close(freq[[1, 3, 4]], torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64),
                               atol=0.01, rtol=0)
    again = sample_categorical(probs, torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)
    assert SamplingParams(do_sample=False, temperature=0.0).logprob_temperature == 1.0


def test_factory(model, tmp_path):
    with pytest.raises(ValueError, match="'sglang'.*hf"):
        make_rollout_engine("sglang")
    eng = make_rollout_engine("hf", model=model, pad_token_id=PAD, eos_token_ids=[2])
    assert isinstance(eng, HFRolloutEngine)
    model.save_pretrained(tmp_path)
    loaded = make_rollout_engine("hf", path=str(tmp_path), dtype="float32")
    assert loaded.eos_token_ids == [2] and loaded.pad_token_id == PAD
    batch = prompt_batch([3, 5])
    params = SamplingParams(max_new_tokens=6, seed=0)
    got, want = loaded.generate(batch, params), eng.generate(batch, params)
    assert loaded.model.config._attn_implementation == "rlcore_decode"  # its own model: no KV heads repeated per token
    assert torch.equal(got["responses"], want["responses"])
    # Another attention implementation, the same math: float32 rounding apart (1.7e-6 at -2.3 on AVX2).
    torch.testing.assert_close(got["rollout_log_probs"], want["rollout_log_probs"], atol=1e-6, rtol=2e-6)


def test_sleep_wake_noop_on_cpu(model):
    eng = engine_for(model)
    batch = prompt_batch([3, 5])
    params = SamplingParams(max_new_tokens=6, seed=0)
    before = eng.generate(batch, params)
    eng.sleep()
    eng.wake()
    assert next(model.parameters()).device.type == "cpu"
    assert eng.generate(batch, params).equal(before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generate_sleep_wake():
    m = tiny_model()
    batch = prompt_batch([4, 8, 1, 6], seed=5)
    greedy = SamplingParams(do_sample=False, max_new_tokens=10)
    cpu_out = engine_for(tiny_model()).generate(batch, greedy)
    eng = HFRolloutEngine(m, pad_token_id=PAD, eos_token_ids=[2], device="cuda")
    out = eng.generate(batch, greedy)
    assert out["responses"].device.type == "cpu"  # results come back where the prompts were
    assert torch.equal(out["responses"], cpu_out["responses"])
    eng.sleep()
    assert next(m.parameters()).device.type == "cpu"
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate(batch, greedy)
    eng.update_weights([("lm_head.weight", torch.randn(VOCAB, 32))])  # allowed while asleep
    eng.wake()
    assert next(m.parameters()).device.type == "cuda"
    sampled = SamplingParams(n=4, max_new_tokens=8, seed=1)
    a, b = eng.generate(batch, sampled), eng.generate(batch, sampled)
    assert a.equal(b)
    ref = reference_log_probs(m, a.to("cuda"), 1.0).cpu()
    mask = a["response_mask"]
    torch.testing.assert_close(a["rollout_log_probs"] * mask, ref * mask, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_decode_attention_without_repeated_kv_heads_equals_sdpa(kv_heads):
    """`rlcore_decode` (what `from_pretrained` engines run: one decoding step of a grouped-query
    model attends with a KV head's query heads as its queries) gives transformers' SDPA tokens and
    log-probs, through early stops, cache compaction and left padding."""
    from rlcore.rollout.decode_attention import DECODE, use_decode_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, max_position_embeddings=128, tie_word_embeddings=True,
                      pad_token_id=PAD, bos_token_id=1, eos_token_id=2, initializer_range=0.4)
    plain = LlamaForCausalLM(cfg).eval()
    grouped = LlamaForCausalLM(cfg).eval()
    grouped.load_state_dict(plain.state_dict())
    assert use_decode_attention(grouped).config._attn_implementation == DECODE
    batch = prompt_batch([5, 9, 2, 7, 4, 6])
    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=16, seed=11)
    want = engine_for(plain, eos=(2, 5, 9)).generate(batch, params)
    got = engine_for(grouped, eos=(2, 5, 9)).generate(batch, params)
    assert got["response_mask"].sum(1).min() < got["response_mask"].sum(1).max()  # rows stopped at different steps
    assert torch.equal(got["responses"], want["responses"])
    torch.testing.assert_close(got["rollout_log_probs"], want["rollout_log_probs"], atol=1e-5, rtol=0)
    mask = got["response_mask"]
    # cached decode vs one full forward: two float32 computation orders. rtol 2e-6 (a few ulps of the
    # value): 1.0014e-5 at a log-prob of -1.08 was seen on an AVX-512 AMD EPYC; a stale cache row or a
    # wrong mask moves log-probs by 1e-3 or more
    torch.testing.assert_close(got["rollout_log_probs"] * mask, reference_log_probs(plain, got, 0.8) * mask, atol=1e-5, rtol=2e-6)


class _SwitchAt:
    """A `WeightSwitch` that loads `new` weights at the `at`-th step boundary (counting from 0)."""

    def __init__(self, engine: HFRolloutEngine, new: torch.nn.Module, at: int) -> None:
        self.engine, self.new, self.at = engine, new, at
        self.calls, self.v = 0, 7

    def version(self) -> int:
        return self.v

    def between_steps(self) -> bool:
        self.calls += 1
        if self.calls - 1 != self.at:
            return False
        self.engine.update_weights(self.new.state_dict().items())
        self.v = 8
        return True


def test_weights_taken_between_decode_steps_continue_as_the_new_weights_would_from_that_prefix():
    """Weights changed at a step boundary: the tokens before it are the old weights', the rest
    (and their log-probs) exactly what the new weights decode from that prefix (KV cache
    recomputed), and each token carries the version it was drawn under."""
    greedy = SamplingParams(n=1, do_sample=False, max_new_tokens=10)
    prompts = prompt_batch([5, 3])
    old = HFRolloutEngine(tiny_model(0), pad_token_id=PAD, eos_token_ids=[])
    before = old.generate(prompts, greedy)
    assert TOKEN_VERSIONS not in before.tensors  # no switch: the output as ever

    engine = HFRolloutEngine(tiny_model(0), pad_token_id=PAD, eos_token_ids=[])
    engine.weight_switch = switch = _SwitchAt(engine, tiny_model(1), at=3)
    out = engine.generate(prompts, greedy)
    assert switch.calls == 9  # asked at every boundary, not only at the end
    versions = out[TOKEN_VERSIONS]
    assert (versions[:, :4] == 7).all() and (versions[:, 4:] == 8).all()
    assert torch.equal(out["responses"][:, :4], before["responses"][:, :4])
    assert not torch.equal(out["responses"][:, 4:], before["responses"][:, 4:])  # the new weights decide

    new = HFRolloutEngine(tiny_model(1), pad_token_id=PAD, eos_token_ids=[])
    prefix = Batch(tensors={"input_ids": torch.cat([prompts["input_ids"], out["responses"][:, :4]], dim=1),
                   "attention_mask": torch.cat([prompts["attention_mask"], torch.ones(2, 4, dtype=torch.long)], dim=1)},
                   meta=dict(prompts.meta))
    after = new.generate(prefix, replace(greedy, max_new_tokens=6))
    assert torch.equal(out["responses"][:, 4:], after["responses"])
    torch.testing.assert_close(out["rollout_log_probs"][:, 4:], after["rollout_log_probs"], atol=1e-5, rtol=1e-5)
