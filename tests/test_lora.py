"""LoRA (peft): config refusals, the adapter on Llama and Qwen2 (GQA, q/k/v biases) with the LM-head
and packed-sequence checks, the reference as the actor's own base (one copy of the weights, the
log-probs of a separate reference model), and a live weight sync of only what the adapter changes
that equals a fresh engine on the merged model (hf here; vLLM, merged and adapter, in
tests/test_lora_e2e.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlcore.cli import CONFIG_DIR
from rlcore.config import ConfigError, LoraConfig, load_config, role_spec
from rlcore.protocol import Batch
from rlcore.rollout import SamplingParams
from rlcore.rollout.hf import HFRolloutEngine
from rlcore.workers.actor import ActorWorker, ReferenceWorker
from rlcore.workers.attention import use_packed_attention
from rlcore.workers.forward import response_log_probs
from rlcore.workers.lora import apply_lora, merge_adapter
from rlcore.workers.model_checks import check_lm_head, check_packed_forward
from rlcore.workers.packed import pack_rows

VOCAB = 96


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _qwen2() -> Qwen2ForCausalLM:
    """Grouped-query attention (4 query heads, 2 KV heads), biases on q/k/v, an untied head."""
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2))


ARCHS = {"llama": _llama, "qwen2": _qwen2}


def _randomize_adapter(model: torch.nn.Module, seed: int = 1) -> None:
    """A trained-looking adapter: B (zero at init) drawn at random, so the adapter changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _batch(n: int = 6, p: int = 6, r: int = 5, seed: int = 0) -> Batch:
    """A left-padded RL batch with advantages (as the actor's update takes it)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.tensor([6, 2, 5, 3, 6, 1])[:n]
    resp_len = torch.tensor([5, 5, 1, 2, 4, 3])[:n]
    prompts = torch.randint(3, VOCAB, (n, p), generator=g)
    responses = torch.randint(3, VOCAB, (n, r), generator=g)
    pmask = (torch.arange(p)[None, :] >= (p - prompt_len)[:, None]).long()
    rmask = (torch.arange(r)[None, :] < resp_len[:, None]).long()
    attn = torch.cat([pmask, rmask], 1)
    return Batch(tensors={
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attn,
        "position_ids": (attn.cumsum(-1) - 1).clamp(min=0), "response_mask": rmask.float(),
        "advantages": torch.randn(n, 1, generator=g).expand(n, r).contiguous()})


def _config(model_dir: Path, tmp_path: Path, *extra: str):
    return load_config(CONFIG_DIR / "tiny_grpo.yaml", [
        f"model.path={model_dir}", f"data.train_files=[{tmp_path / 'unused.parquet'}]", f"trainer.output_dir={tmp_path / 'run'}",
        "trainer.device=cpu", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.optim.lr=1e-2",
        "actor.optim.warmup_steps=0", "actor.lora.rank=4", "actor.lora.alpha=8", *extra])


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize("overrides, message", [
    (["actor.lora.target_modules=q_proj"], "actor.lora.target_modules: 'q_proj': expected 'all-linear' or a list"),
    (["actor.lora.target_modules=[]"], "actor.lora.target_modules: expected a non-empty list"),
    (["actor.lora.target_modules=[q_proj, lm_head]"], "actor.lora.target_modules: LoRA on the input embeddings or the output head"),
    (["actor.lora.rank=-1"], "actor.lora.rank"),
    (["actor.lora.dropout=1.0"], "actor.lora.dropout"),
    (["actor.lora.rank=0", "rollout.lora_sync=merged"], "rollout.lora_sync=merged needs LoRA on the actor"),
    (["rollout.backend=hf", "rollout.lora_sync=adapter"], "rollout.lora_sync=adapter needs rollout.backend=vllm"),
    (["critic.lora.alpha=0"], "critic.lora.alpha"),
])
def test_bad_lora_settings_are_refused_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        _config(tmp_path / "model", tmp_path, *overrides)


# ---------------------------------------------------------------------- the adapter on a model
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_adapter_keeps_head_and_packing_checks_and_counts(arch):
    model = ARCHS[arch]()
    total_before = sum(p.numel() for p in model.parameters())
    adapter = apply_lora(model, LoraConfig(rank=4, alpha=8), "actor.lora")
    assert type(adapter.model) is type(model) and adapter.model is model  # injected in place, class kept
    _randomize_adapter(model)
    # all-linear: q, k, v, o, gate, up, down of every layer; never the head or the embeddings
    lora_modules = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert lora_modules == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert type(model.get_output_embeddings()) is torch.nn.Linear
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert adapter.total_params == total_before + adapter.trainable_params
    assert adapter.trainable_params == sum(p.numel() for n, p in model.named_parameters() if p.requires_grad)
    # the LoRA model's own forward and rlcore's head path agree; packed rows still do not see each other
    check_lm_head(model)
    check_packed_forward(model)
    batch = _batch()
    packed, _ = response_log_probs(model, batch, 1.0, remove_padding=True)
    padded, _ = response_log_probs(model, batch, 1.0, remove_padding=False)
    mask = batch["response_mask"]
    torch.testing.assert_close(packed * mask, padded * mask, atol=1e-5, rtol=0)
    # on rlcore's attention, rows with one prompt (0 and 1, 4 and 5 here) hold it once: same log-probs
    use_packed_attention(model)
    check_packed_forward(model)
    shared_batch = _batch()
    for a, b in ((0, 1), (4, 5)):
        shared_batch["input_ids"][b, :6] = shared_batch["input_ids"][a, :6]
        shared_batch["attention_mask"][b, :6] = shared_batch["attention_mask"][a, :6]
    shared_batch["position_ids"] = (shared_batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    assert pack_rows(shared_batch["attention_mask"], 5, shared_batch["input_ids"]).shared_tokens == 12  # rows 1 and 5 hold no prompt
    shared, _ = response_log_probs(model, shared_batch, 1.0, remove_padding=True, share_prompts=True)
    unshared, _ = response_log_probs(model, shared_batch, 1.0, remove_padding=False)
    torch.testing.assert_close(shared * mask, unshared * mask, atol=1e-5, rtol=0)
    model.config._attn_implementation = "sdpa"
    with adapter.disabled():  # the base: what the model computed before the adapter
        base_lp, _ = response_log_probs(model, batch, 1.0)
    fresh, _ = response_log_probs(ARCHS[arch](), batch, 1.0)
    torch.testing.assert_close(base_lp, fresh, atol=0, rtol=0)
    assert (packed - base_lp).abs().max() > 1e-3  # ...and the adapter does change them


def test_unknown_target_module_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"actor\.lora\.target_modules=\['wq'\]: .*wq"):
        apply_lora(_llama(), LoraConfig(rank=4, target_modules=["wq"]), "actor.lora")


# ---------------------------------------------------------------------- reference = base, one copy
def test_reference_is_the_actors_base_one_copy_equal_to_a_reference_model(tmp_path, monkeypatch):
    from rlcore.example.build import save_untrained_model
    from rlcore.trainer.roles import build_worker_groups, placement

    model_dir = save_untrained_model(tmp_path / "model", seed=0)  # with the example's tokenizer (rollout, reward)
    loads: list[str] = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def counting(cls, path, *args, **kwargs):
        loads.append(str(path))
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(counting))
    cfg = _config(model_dir, tmp_path, "rollout.backend=hf", "algorithm.use_reference=true")
    groups = build_worker_groups(placement(cfg))
    try:
        assert groups.ref is groups.actor  # no reference worker: the actor group serves the role
        assert len(loads) == 2  # the actor's base and the rollout engine's; no reference copy (3 without LoRA)
        worker = groups.actor.workers[0]
        params = {p.data_ptr() for p in worker.model.parameters()}
        assert len(params) == len(list(worker.model.parameters()))
        batch = _batch()
        batch = batch.union(groups.actor.compute_log_prob(batch).select("old_log_probs"))
        before = groups.ref.compute_ref_log_prob(batch)["ref_log_probs"]
        torch.testing.assert_close(before, batch["old_log_probs"], atol=0, rtol=0)  # B = 0: adapter == base
        for _ in range(2):
            groups.actor.update_actor(batch, 2)
        after_policy = groups.actor.compute_log_prob(batch)["old_log_probs"]
        after_ref = groups.ref.compute_ref_log_prob(batch)["ref_log_probs"]
    finally:
        groups.close()
    monkeypatch.undo()
    reference = ReferenceWorker(role_spec(cfg, "ref"))  # a separate frozen copy, as a run without LoRA has
    reference.setup()
    separate = reference.compute_ref_log_prob(batch)["ref_log_probs"]
    mask = batch["response_mask"]
    torch.testing.assert_close(after_ref, separate, atol=1e-6, rtol=0)
    torch.testing.assert_close(before, separate, atol=1e-6, rtol=0)
    assert ((after_policy - separate) * mask).abs().max() > 1e-3  # the policy moved, its reference did not


# ---------------------------------------------------------------------- live sync (hf engine)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_live_sync_sends_only_the_adapted_modules_and_equals_the_merged_model(tmp_path, arch):
    model_dir = tmp_path / "model"
    ARCHS[arch]().save_pretrained(model_dir)
    actor = ActorWorker(role_spec(_config(model_dir, tmp_path, "rollout.backend=hf"), "actor"))
    actor.setup()
    _randomize_adapter(actor.model)
    plan = actor.weight_bucket_plan()
    sent = [n for bucket in plan for n in bucket]
    full = dict(AutoModelForCausalLM.from_pretrained(model_dir).state_dict())
    assert not [n for n in sent if "embed_tokens" in n or "lm_head" in n or "norm" in n]  # never changed
    expected = {n for n in full if ".self_attn." in n or ".mlp." in n}  # every weight (and q/k/v bias) of the adapted layers
    assert set(sent) == expected
    live = HFRolloutEngine.from_pretrained(str(model_dir), pad_token_id=0, eos_token_ids=[2])
    params = SamplingParams(n=1, do_sample=False, max_new_tokens=8)
    prompts = _prompts()
    before = live.generate(prompts, params)
    for names in plan:
        live.update_weights(actor.gather_weight_bucket(names))
    after = live.generate(prompts, params)
    # the engine on the merged model, made by peft from the saved adapter (not by rlcore's merge)
    actor.adapter.save(tmp_path / "adapter", keep=True)
    merged_dir = merge_adapter(model_dir, tmp_path / "adapter", tmp_path / "merged")
    fresh = HFRolloutEngine.from_pretrained(str(merged_dir), pad_token_id=0, eos_token_ids=[2]).generate(prompts, params)
    assert after["responses"].tolist() != before["responses"].tolist()
    assert after["responses"].tolist() == fresh["responses"].tolist()
    torch.testing.assert_close(after["rollout_log_probs"], fresh["rollout_log_probs"], atol=1e-6, rtol=0)


def _prompts() -> Batch:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (4, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return Batch(tensors={"input_ids": ids, "attention_mask": mask}, meta={"uid": np.array(list("abcd"), dtype=object)})


def test_adapter_init_comes_from_the_seed_not_the_process_rng():
    """Every rank and run starts from the same A (a Ray worker's torch RNG is seeded at random);
    the caller's RNG stream is left alone."""
    models = [_llama() for _ in range(3)]
    states = []
    for model, (rng_seed, seed) in zip(models, [(123, 7), (456, 7), (456, 8)]):
        torch.manual_seed(rng_seed)
        before = torch.random.get_rng_state()
        states.append(apply_lora(model, LoraConfig(rank=4), "actor.lora", seed=seed).state(keep=True))
        assert torch.equal(torch.random.get_rng_state(), before)
    a, b, c = states
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a if ".lora_A." in k)


def test_reward_model_style_classifier_gets_lora_and_its_head_and_merges(tmp_path):
    """What a reward model (issue 17) reuses: `apply_lora` on a sequence classifier adapts the
    backbone, trains the freshly made score head in full, saves both as one peft adapter, and
    `merge_adapter` gives a plain classifier folder with the same scores."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    base = LlamaForSequenceClassification(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0))
    base.save_pretrained(tmp_path / "base")
    model = LlamaForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=1)
    adapter = apply_lora(model, LoraConfig(rank=4, alpha=8), "reward_model.lora", task="seq_cls")
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".lora_A." in n for n in trained) and {"score.modules_to_save.default.weight"} <= trained
    assert not any("score" in n and ".lora_" in n for n in trained)  # the head itself is trained, not adapted
    _randomize_adapter(model)
    with torch.no_grad():
        model.score.modules_to_save["default"].weight.normal_(0, 0.5)
    ids = torch.randint(3, VOCAB, (3, 7))
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    adapter.save(tmp_path / "adapter", keep=True)
    merged = merge_adapter(tmp_path / "base", tmp_path / "adapter", tmp_path / "merged", task="seq_cls")
    served = LlamaForSequenceClassification.from_pretrained(merged).eval()
    with torch.no_grad():
        torch.testing.assert_close(served(input_ids=ids).logits, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("precision", [["model.dtype=bfloat16"], ["actor.mixed_precision=bf16"],
                                       ["model.dtype=bfloat16", "model.pure_bf16=true"]])
def test_lora_trains_under_bf16_compute(tmp_path, precision):
    """bf16 compute over float32 masters (per-module compute copies in one process): the adapter
    takes its bf16 input as it comes (peft would cast it to the master's float32 first and fail),
    only the adapter moves, and the merged weights come from the masters."""
    _llama().save_pretrained(tmp_path / "model")
    actor = ActorWorker(role_spec(_config(tmp_path / "model", tmp_path, *precision), "actor"))
    actor.setup()
    batch = _batch()
    batch = batch.union(actor.compute_log_prob(batch).select("old_log_probs"))
    metrics = actor.update_actor(batch, 2)
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/bad_updates"] == 0
    state = actor.adapter.state(keep=True)
    assert max(float(v.abs().max()) for k, v in state.items() if ".lora_B." in k) > 0
    merged = dict(actor.gather_weight_bucket(actor.weight_bucket_plan()[0]))
    master = torch.bfloat16 if "model.pure_bf16=true" in precision else torch.float32
    assert {t.dtype for t in merged.values()} == {master}
