"""vLLM rollout backend (real in-process engine, CPU here): log-probs against an HF forward pass,
the output contract (n samples, EOS, shapes), seeds, and live weight updates that must equal a
fresh engine started on the new weights, as one vLLM reload per sync with no "Failed to load
weights" warnings. Skipped where vLLM is not installed."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from rlcore.protocol import Batch  # noqa: E402
from rlcore.rollout import RolloutEngine, SamplingParams, make_rollout_engine  # noqa: E402
from rlcore.rollout.vllm import VLLMRolloutEngine  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PAD, BOS, EOS = 0, 1, 2
VOCAB = 128
# Keep several engines alive in one process small: KV cache in GiB, few sequences.
ENGINE_KW = dict(kv_cache_gib=0.125, max_model_len=128, max_num_seqs=64, seed=0)


def tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
        initializer_range=0.4,  # varied continuations with clear-cut argmaxes
    )
    return LlamaForCausalLM(cfg).eval()


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
    return Batch(tensors={"input_ids": ids, "attention_mask": mask}, meta={"uid": uids}, info={"step": 7})


@contextlib.contextmanager
def vllm_warnings() -> Iterator[list[str]]:
    """Messages of WARNING and above that vLLM logs inside the block (its loggers hang below
    "vllm", which has its own handler, so pytest's caplog does not see them)."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logging.getLogger("vllm").addHandler(handler)
    try:
        yield seen
    finally:
        logging.getLogger("vllm").removeHandler(handler)


def reference_log_probs(model, out: Batch, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of a full HF forward pass at the response tokens."""
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits.float()
    p, r = out["prompts"].shape[1], out["responses"].shape[1]
    resp_logits = logits[:, p - 1: p + r - 1] / temperature
    return resp_logits.log_softmax(-1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two different tiny models saved as HF checkpoints: (model_a, dir_a, model_b, dir_b)."""
    root = tmp_path_factory.mktemp("vllm_models")
    a, b = tiny_model(0), tiny_model(1)
    a.save_pretrained(root / "a")
    b.save_pretrained(root / "b")
    return a, root / "a", b, root / "b"


@pytest.fixture(scope="class")
def engine_a(models):
    """One engine shared by a test class. vLLM keeps process-global state: only one engine may
    be alive at a time, and it must be closed before the next one starts."""
    engine = make_rollout_engine("vllm", path=str(models[1]), dtype="float32", device="cpu",
                                 eos_token_ids=[], **ENGINE_KW)
    yield engine
    engine.close()


class TestSharedEngine:
    """Tests on one engine started on model A."""

    def test_factory_builds_protocol_engine(self, engine_a):
        assert isinstance(engine_a, VLLMRolloutEngine)
        assert isinstance(engine_a, RolloutEngine)
        assert engine_a.pad_token_id == PAD  # read from the checkpoint's config

    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_log_probs_match_hf_forward(self, models, engine_a, temperature):
        model_a = models[0]
        batch = prompt_batch([5, 9, 2, 7])
        out = engine_a.generate(batch, SamplingParams(n=3, temperature=temperature, max_new_tokens=10))
        assert out["responses"].shape == (12, 10) and out["response_mask"].all()  # no EOS configured
        ref = reference_log_probs(model_a, out, temperature)
        torch.testing.assert_close(out["rollout_log_probs"], ref, atol=1e-4, rtol=0)
        assert out["rollout_log_probs"].dtype == torch.float32
        assert out.info == {"step": 7}  # the input's: data about the batch

    def test_cpu_blocks_of_32_and_log_probs_across_blocks(self, models, engine_a):
        """The CPU default KV block is 32 tokens; contexts spanning three blocks still give the
        HF forward pass's log-probs (paged attention reads every block of a sequence)."""
        assert engine_a.llm.llm_engine.vllm_config.cache_config.block_size == 32
        batch = prompt_batch([45, 33, 31])
        out = engine_a.generate(batch, SamplingParams(n=2, temperature=1.0, max_new_tokens=40))
        assert out["responses"].shape == (6, 40)
        torch.testing.assert_close(out["rollout_log_probs"], reference_log_probs(models[0], out, 1.0),
                                   atol=1e-4, rtol=0)

    def test_greedy_matches_hf_and_reports_temperature_one(self, models, engine_a):
        model_a = models[0]
        batch = prompt_batch([4, 6, 3])
        out = engine_a.generate(batch, SamplingParams(n=1, do_sample=False, temperature=0.3, max_new_tokens=8))
        # HF greedy continuation, one prompt at a time (no padding involved).
        for i in range(3):
            prompt = batch["input_ids"][i][batch["attention_mask"][i].bool()].unsqueeze(0)
            with torch.no_grad():
                ref = model_a.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                       pad_token_id=PAD)[0, prompt.shape[1]:]
            assert out["responses"][i].tolist() == ref.tolist()
        torch.testing.assert_close(out["rollout_log_probs"], reference_log_probs(model_a, out, 1.0), atol=1e-4, rtol=0)

    def test_output_layout_n_samples_and_meta(self, engine_a):
        batch = prompt_batch([3, 6])
        out = engine_a.generate(batch, SamplingParams(n=4, max_new_tokens=5))
        p = batch["input_ids"].shape[1]
        assert out["input_ids"].shape == (8, p + 5)
        torch.testing.assert_close(out["prompts"], batch["input_ids"].repeat_interleave(4, dim=0))
        torch.testing.assert_close(out["input_ids"][:, p:], out["responses"])
        assert out["position_ids"][0].tolist() == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7]
        assert out["attention_mask"][0].tolist() == [0, 0, 0] + [1] * 8
        assert out.meta["uid"].tolist() == ["p0"] * 4 + ["p1"] * 4
        # n samples of one prompt are not all the same sequence
        assert len({tuple(r) for r in out["responses"][:4].tolist()}) > 1

    def test_seed_reproduces_sampling_without_touching_caller_rng(self, engine_a):
        batch = prompt_batch([5, 3, 8])
        params = SamplingParams(n=2, max_new_tokens=8, seed=123)
        torch.manual_seed(0)
        before = torch.rand(3)
        torch.manual_seed(0)
        first = engine_a.generate(batch, params)
        after = torch.rand(3)
        second = engine_a.generate(batch, params)
        other = engine_a.generate(batch, SamplingParams(n=2, max_new_tokens=8, seed=124))
        assert first["responses"].tolist() == second["responses"].tolist()
        assert first["responses"].tolist() != other["responses"].tolist()
        torch.testing.assert_close(before, after)  # the caller's RNG stream is unchanged

    def test_update_weights_holds_incomplete_groups_and_rejects_unknown(self, engine_a, models):
        model_a = models[0]
        sd = dict(model_a.named_parameters())
        engine_a.update_weights([("model.layers.0.self_attn.q_proj.weight", sd["model.layers.0.self_attn.q_proj.weight"])])
        assert engine_a.pending_weights == ["model.layers.0.self_attn.q_proj.weight"]
        engine_a.update_weights((n, t) for n, t in sd.items() if n.startswith("model.layers.0.self_attn."))
        assert engine_a.pending_weights == []
        with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
            engine_a.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])

    def test_partial_sync_is_finished_before_the_engine_is_used(self, engine_a, models):
        """A caller that sends only some layers: they are loaded, the others keep their weights,
        and vLLM names the layers with weights that the sync did not update (its warning is
        meaningful there); the parameter-less rotary embedding is never among them."""
        batch = prompt_batch([5, 9, 2])
        greedy = SamplingParams(n=1, do_sample=False, max_new_tokens=6)
        before = engine_a.generate(batch, greedy)
        finished = engine_a.syncs_finished
        sd = dict(models[0].named_parameters())  # the engine's own weights: outputs must not change
        with vllm_warnings() as warnings:
            engine_a.update_weights((n, t) for n, t in sd.items() if n.startswith("model.layers.1.mlp."))
            assert engine_a.syncs_finished == finished  # still open: the sync is incomplete
            after = engine_a.generate(batch, greedy)
        assert engine_a.syncs_finished == finished + 1
        assert after["responses"].tolist() == before["responses"].tolist()
        torch.testing.assert_close(after["rollout_log_probs"], before["rollout_log_probs"], atol=1e-5, rtol=0)
        failed = {w.split(":")[0] for w in warnings if w.endswith("Failed to load weights")}
        assert "QKVParallelLinear" in failed and "RotaryEmbedding" not in failed

    def test_sleep_and_wake_are_noops_on_cpu(self, engine_a, caplog):
        with caplog.at_level(logging.WARNING, logger="rlcore.rollout.vllm"):
            engine_a.sleep()
            engine_a.wake()
            engine_a.sleep()
        assert sum("GPU-only" in r.message for r in caplog.records) == 1
        out = engine_a.generate(prompt_batch([3]), SamplingParams(n=1, max_new_tokens=2))
        assert out["responses"].shape == (1, 2)

    def test_right_padded_prompts_are_rejected(self, engine_a):
        batch = prompt_batch([3, 5])
        batch.tensors["attention_mask"] = batch["attention_mask"].flip(1)
        with pytest.raises(ValueError, match="LEFT-padded"):
            engine_a.generate(batch, SamplingParams(n=1, max_new_tokens=2))



def test_eos_stops_rows_and_is_kept(models):
    """With common tokens as EOS, rows stop at different steps; EOS is the last real token."""
    eos = list(range(3, 40))
    engine = VLLMRolloutEngine.from_pretrained(str(models[1]), eos_token_ids=eos, pad_token_id=PAD, **ENGINE_KW)
    try:
        out = engine.generate(prompt_batch([5, 9, 2, 7, 4, 6]), SamplingParams(n=2, max_new_tokens=12, seed=3))
    finally:
        engine.close()
    mask = out["response_mask"]
    lengths = mask.sum(1).long()
    assert lengths.min() < lengths.max()
    ended = lengths < 12
    assert ended.any()
    last = out["responses"].gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
    assert torch.isin(last[ended], torch.tensor(eos)).all()
    # nothing but EOS-free tokens before the end, pad after it, zero log-prob on padding
    for r in range(len(out)):
        real = out["responses"][r, : lengths[r] - 1]
        assert not torch.isin(real, torch.tensor(eos)).any()
    assert (out["responses"][mask == 0] == PAD).all()
    assert (out["rollout_log_probs"][mask == 0] == 0).all()
    ref = reference_log_probs(models[0], out, 1.0)
    torch.testing.assert_close(out["rollout_log_probs"] * mask, ref * mask, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_update_weights_equals_fresh_engine(models, dtype):
    """Live update (actor-style buckets that split layers, embedding name only) == fresh engine.
    In bfloat16 (rollout.dtype) the actor's float32 tensors are cast on load exactly as a fresh
    engine casts the checkpoint (on CPU vLLM also repacks bf16 weights for AMX)."""
    _, dir_a, model_b, dir_b = models
    batch = prompt_batch([5, 9, 2, 7])
    greedy = SamplingParams(n=1, do_sample=False, max_new_tokens=10)
    sampled = SamplingParams(n=2, max_new_tokens=10, seed=5)

    # weight_bucket_mb: a few layers per vLLM load call, so one sync takes several
    with vllm_warnings() as at_start:  # the float32 checkpoint is cast to the engine's dtype on purpose
        live = VLLMRolloutEngine.from_pretrained(str(dir_a), dtype=dtype, eos_token_ids=[], weight_bucket_mb=0.2,
                                                 **ENGINE_KW)
    assert not [w for w in at_start if w.startswith("Attempted to load weight")]
    try:
        before = live.generate(batch, greedy)  # fills the prefix cache with model A's KV blocks
        # named_parameters() lists the tied embedding once, without lm_head.weight; send it in
        # small buckets that cut through attention and MLP groups.
        params = list(model_b.named_parameters())
        assert "lm_head.weight" not in dict(params)
        with vllm_warnings() as warnings:
            for i in range(0, len(params), 3):
                live.update_weights(params[i: i + 3])
        assert live.pending_weights == []
        assert live.syncs_finished == 1  # one vLLM reload for the whole sync
        assert warnings == []  # was: "RotaryEmbedding: Failed to load weights" at every sync, and a
        # warning for every layer a bucket did not carry
        after_g, after_s = live.generate(batch, greedy), live.generate(batch, sampled)
    finally:
        live.close()

    fresh = VLLMRolloutEngine.from_pretrained(str(dir_b), dtype=dtype, eos_token_ids=[], **ENGINE_KW)
    try:
        fresh_g, fresh_s = fresh.generate(batch, greedy), fresh.generate(batch, sampled)
    finally:
        fresh.close()
    assert after_g["responses"].tolist() != before["responses"].tolist()  # the weights did change
    assert after_g["responses"].tolist() == fresh_g["responses"].tolist()
    torch.testing.assert_close(after_g["rollout_log_probs"], fresh_g["rollout_log_probs"], atol=1e-5, rtol=0)
    assert after_s["responses"].tolist() == fresh_s["responses"].tolist()
    torch.testing.assert_close(after_s["rollout_log_probs"], fresh_s["rollout_log_probs"], atol=1e-5, rtol=0)
    if dtype == "float32":  # bf16 rounding moves these large-logit test models' log-probs by up to ~1
        torch.testing.assert_close(after_g["rollout_log_probs"], reference_log_probs(model_b, after_g, 1.0), atol=1e-4, rtol=0)


def _greedy_from(model, ids: list[int], k: int) -> list[int]:
    """`k` greedy tokens of `model` after `ids` (full forward passes, no cache)."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(k):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-k:]


class _SyncAt:
    """A weight switch loading `model`'s weights at decode-step boundary `at` itself (no gate)."""

    def __init__(self, engine, model, state: dict, at: int) -> None:
        self.engine, self.model, self.state, self.at, self.calls = engine, model, state, at, 0

    def version(self) -> int:
        return self.state["version"]

    def between_steps(self) -> bool:
        self.calls += 1
        if self.calls != self.at:
            return False
        self.engine.update_weights(self.model.state_dict().items())
        self.state["version"] += 1
        return True


def test_a_sync_between_decode_steps_preempts_and_resumes_the_requests_on_the_new_weights(models):
    """`trainer.async_weight_sync=step` on vLLM: a sync handed over at decode step 3 runs there, on
    the generating thread; the tokens before it are model A's greedy, those after it model B's greedy
    from that prefix (every request resumed, its prefix recomputed on B), with B's log-probs; each
    token carries its version; so with n samples a prompt, sampled. A switch that never fires changes nothing."""
    import threading

    from test_async_rollout import WAIT, _in_thread, _PausingSwitch  # tests/ is on sys.path

    from rlcore.rollout.output import TOKEN_VERSIONS
    from rlcore.trainer.async_rollout import DecodeSwitch, EngineGate, interrupted

    model_a, dir_a, model_b, _ = models
    batch, greedy, at = prompt_batch([5, 3, 7, 4]), SamplingParams(n=1, do_sample=False, max_new_tokens=8), 3  # vLLM: greedy n=1
    gate, state = EngineGate(), {"version": 4}
    engine = VLLMRolloutEngine.from_pretrained(str(dir_a), dtype="float32", eos_token_ids=[], **ENGINE_KW)
    try:
        engine.weight_switch = switch = _PausingSwitch(gate, lambda: state["version"], at=at)
        seen: dict = {}

        def job() -> None:  # what `AsyncRollout.update_weights` hands over: the sync, then the version
            seen["thread"], seen["boundary"] = threading.get_ident(), switch.calls
            engine.update_weights(model_b.state_dict().items())
            state["version"] = 5

        def generate() -> None:
            seen["generator"] = threading.get_ident()
            with gate.generation() as go:
                assert go
                seen["out"] = engine.generate(batch, greedy)

        thread, errors = _in_thread(generate)
        assert switch.reached.wait(WAIT)
        gate.at_step_boundary(job)  # returns once the generation ran the sync
        thread.join(WAIT)
        assert not errors.get("error")
        cost, syncs = engine.switch_cost, engine.syncs_finished
        engine.weight_switch = _SyncAt(engine, model_a, state, at)  # sampled, n=2: each sample its own request
        sampled = engine.generate(batch, SamplingParams(n=2, max_new_tokens=8, seed=3))
        engine.weight_switch = DecodeSwitch(gate, lambda: state["version"])  # nothing handed over: never fires
        quiet = engine.generate(batch, greedy)
        engine.weight_switch = None
        plain = engine.generate(batch, greedy)
    finally:
        engine.close()

    out = seen["out"]
    assert seen["thread"] == seen["generator"] and seen["boundary"] == at  # not after the generation
    assert syncs == 1 and cost.syncs == 1 and cost.sync_s > 0 and cost.resume_s > 0
    versions = out[TOKEN_VERSIONS]
    assert (versions[:, :at] == 4).all() and (versions[:, at:] == 5).all() and interrupted(out) == 4
    mask = out["attention_mask"][:, : out["prompts"].shape[1]].bool()
    for row in range(4):
        prompt = out["prompts"][row][mask[row]].tolist()
        before = _greedy_from(model_a, prompt, at)
        assert out["responses"][row].tolist() == before + _greedy_from(model_b, prompt + before, 8 - at)
    torch.testing.assert_close(out["rollout_log_probs"][:, :at], reference_log_probs(model_a, out, 1.0)[:, :at],
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(out["rollout_log_probs"][:, at:], reference_log_probs(model_b, out, 1.0)[:, at:],
                               atol=1e-4, rtol=0)
    versions = sampled[TOKEN_VERSIONS]
    assert (versions[:, :at] == 5).all() and (versions[:, at:] == 6).all() and interrupted(sampled) == 8
    torch.testing.assert_close(sampled["rollout_log_probs"][:, :at], reference_log_probs(model_b, sampled, 1.0)[:, :at],
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(sampled["rollout_log_probs"][:, at:], reference_log_probs(model_a, sampled, 1.0)[:, at:],
                               atol=1e-4, rtol=0)
    assert quiet["responses"].tolist() == plain["responses"].tolist() and (quiet[TOKEN_VERSIONS] == 6).all()
    torch.testing.assert_close(quiet["rollout_log_probs"], plain["rollout_log_probs"], atol=1e-6, rtol=0)
    print(f"\nvLLM sync between decode steps: sync {cost.sync_s * 1e3:.1f} ms, resume step {cost.resume_s * 1e3:.1f} ms "
          f"(recompute beyond a median step {cost.recompute_s * 1e3:.1f} ms)")


def test_sampled_logprobs_reads_flat_and_dict_formats():
    """Both vLLM log-prob containers give the sampled tokens' log-probs, in order."""
    from vllm.logprobs import FlatLogprobs, Logprob

    from rlcore.rollout.vllm import _sampled_logprobs

    ids = [7, 3, 9]
    flat = FlatLogprobs()
    for tok, lp in zip(ids, [-0.5, -1.25, -2.0]):
        flat.append({tok: Logprob(logprob=lp, rank=1)})
    assert _sampled_logprobs(flat, ids) == [-0.5, -1.25, -2.0]
    dicts = [{7: Logprob(-0.5), 4: Logprob(-3.0)}, {3: Logprob(-1.25)}, {1: Logprob(-0.1), 9: Logprob(-2.0)}]
    assert _sampled_logprobs(dicts, ids) == [-0.5, -1.25, -2.0]


def test_only_the_expected_cast_warning_is_dropped():
    """float32 tensors into a bf16 engine's parameters are cast by design (rollout.dtype); other
    dtype mismatches still reach the log."""
    from rlcore.rollout.vllm_reload import quiet_expected_casts

    logger = logging.getLogger("vllm.model_executor.models.utils")
    fmt = "Attempted to load weight %s with dtype %s into parameter with dtype %s"

    def passes(sent: torch.dtype, param: torch.dtype) -> bool:
        return logger.filter(logger.makeRecord(logger.name, logging.WARNING, __file__, 1, fmt, ("w", sent, param), None))

    with quiet_expected_casts(torch.bfloat16):
        assert not passes(torch.float32, torch.bfloat16)
        assert passes(torch.float32, torch.float16)  # not the engine's dtype
        assert passes(torch.bfloat16, torch.float8_e4m3fn)  # not float32 -> bf16
    assert passes(torch.float32, torch.bfloat16)  # only while a sync runs


def test_only_the_expected_chat_template_warmup_warning_is_dropped():
    """Engines have no tokenizer by design; vLLM's warm-up failure about it is noise, other
    warnings of that logger still pass."""
    from rlcore.rollout.vllm import _quiet_chat_template_warmup

    logger = logging.getLogger("vllm.renderers.base")

    def passes(message: str) -> bool:
        record = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, message, (), None)
        return logger.filter(record)

    with _quiet_chat_template_warmup():
        assert not passes("Chat template warmup failed")
        assert passes("Something else went wrong")
    assert passes("Chat template warmup failed")  # the filter is gone after the engine started


class _LLMOnAGpu:
    """A stand-in for a `vllm.LLM` on a GPU (there is none here; on a CPU sleep is a no-op): it
    records the sleep and wake calls the engine makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        return True


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_uses_the_level_the_weight_sync_allows(level):
    """Level 2 (weights dropped) when every sync sends every weight, level 1 (weights to host
    memory) when a sync sends only some (LoRA): `VLLMRolloutEngine.sleep_level_for`."""
    llm = _LLMOnAGpu()
    engine = VLLMRolloutEngine(llm, pad_token_id=PAD, eos_token_ids=[EOS], device="cuda", param_names=["lm_head.weight"],
                               tied_embeddings=False, sleep_level=level)  # type: ignore[arg-type]
    engine.sleep()
    engine.sleep()  # asleep already: nothing more
    engine.wake()
    assert llm.calls == [("sleep", level), ("wake_up", None)]
    with pytest.raises(ValueError, match="sleep_level=3: vLLM's sleep levels are 1"):
        VLLMRolloutEngine(llm, pad_token_id=PAD, eos_token_ids=[EOS], device="cuda", param_names=[],  # type: ignore[arg-type]
                          tied_embeddings=False, sleep_level=3)
