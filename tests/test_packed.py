"""Packed sequences (`model.use_remove_padding`, the default) against the padded forward.

On tiny random models built here, a Llama (multi-head, untied head) and a Qwen2 (grouped-query
attention, tied embeddings, attention biases), each set up as `load_causal_lm` sets it up
(`rlcore_varlen` attention): the actor's log-probs and entropies, the policy-loss gradient, the
critic's values and value-loss gradient and the DPO loss gradient are the padded path's within
float32 tolerance (1e-5 absolute on log-probs, values and losses; gradients 1e-4 of each
parameter's largest entry: sums run in another order). Also: the index maps on a hand-made batch,
the tokens the workers report computing against the real ones on a long-tailed length mix (≤ 1.05
packed, and the padded waste the same counter sees), and refusals that name the config key.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, SIZES, VOCAB, assert_grads_close, random_rows, tiny_model  # tests/ is on sys.path
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlcore.algos import get_policy_loss
from rlcore.config import ActorConfig, CriticConfig, PreferenceConfig, load_config, role_spec
from rlcore.protocol import Batch
from rlcore.workers.actor import ActorWorker, PolicyObjective
from rlcore.workers.critic import CriticWorker, ValueObjective
from rlcore.workers.forward import response_values
from rlcore.workers.loading import load_causal_lm
from rlcore.workers.loops import GlobalCounts, prompt_units
from rlcore.workers.packed import pack_rows
from rlcore.workers.policy import PolicyLogProbs
from rlcore.workers.preference import DPOObjective

PACKED_ARCHS = ["llama", "qwen2-gqa"]
MODES = {"padded": (False, False), "packed": (True, False), "shared": (True, True)}  # (remove_padding, share_prompts)


def _rl_batch(seed: int = 0) -> Batch:
    """Rows of varied lengths: one with an empty response, one whose response mask has interior
    zeros (tool output: attended to, not trained on), three with one prompt (rows 0, 5, 6: the
    samples of a prompt) and two with another (2, 7), advantages, old and reference log-probs."""
    t = random_rows([7, 2, 5, 3, 6, 7, 7, 5], [9, 1, 0, 4, 6, 3, 9, 2], seed)
    for row, same_as in ((5, 0), (6, 0), (7, 2)):
        t["input_ids"][row, : -t["responses"].shape[1]] = t["input_ids"][same_as, : -t["responses"].shape[1]]
    t["response_mask"][3, 1:3] = 0.0
    n, r = t["responses"].shape
    g = torch.Generator().manual_seed(seed + 1)
    t.update(advantages=torch.randn(n, 1, generator=g).expand(n, r).contiguous(),
             old_log_probs=-3.0 + 0.1 * torch.randn(n, r, generator=g), ref_log_probs=-3.0 + 0.1 * torch.randn(n, r, generator=g),
             returns=torch.randn(n, r, generator=g), values=0.1 * torch.randn(n, r, generator=g))
    return Batch(tensors=t)


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    names, params = zip(*[(k, p) for k, p in model.named_parameters() if p.requires_grad])
    return dict(zip(names, torch.autograd.grad(loss, params)))


def test_pack_rows_maps_each_response_token_to_its_predecessor():
    # row 0: prompt [5, 6] response [7, 8]; row 1: prompt [9] response [10] (and a padded slot); row 2: no response
    input_ids = torch.tensor([[0, 5, 6, 7, 8], [0, 0, 9, 10, 0], [3, 4, 2, 0, 0]])
    mask = (input_ids > 0).long()
    packed = pack_rows(mask, response_len=2)
    assert packed.pack(input_ids).tolist() == [[9, 10, 3, 4, 2, 5, 6, 7, 8]]  # shortest sequence first
    assert packed.position_ids.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2, 3]]
    assert packed.cu_seqlens.tolist() == [0, 2, 5, 9] and packed.seq_lens == (2, 3, 4) and packed.max_seqlen == 4
    assert packed.predictor_index.tolist() == [6, 7, 0]  # the hidden states at 6, 7 and 9 predict 7, 8 and 10
    assert packed.targets(input_ids[:, 3:]).tolist() == [7, 8, 10]
    assert packed.scatter(torch.tensor([1.0, 2.0, 3.0])).tolist() == [[1.0, 2.0], [3.0, 0.0], [0.0, 0.0]]
    assert packed.shared is None and packed.shared_tokens == 0


def test_pack_rows_holds_a_shared_prompt_once():
    # rows 0, 1 and 3: prompt [5, 6]; row 2: prompt [9]; row 3's response is empty
    input_ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 11, 0], [0, 0, 9, 10, 0], [0, 5, 6, 0, 0]])
    mask = (input_ids > 0).long()
    packed = pack_rows(mask, response_len=2, input_ids=input_ids)
    # row 1's response first (it attends to row 0's prompt), then the sequences by length: row 2, row 0
    assert packed.pack(input_ids).tolist() == [[11, 9, 10, 5, 6, 7, 8]]
    assert packed.position_ids.tolist() == [[2, 0, 1, 0, 1, 2, 3]]
    assert packed.cu_seqlens.tolist() == [1, 3, 7] and packed.seq_lens == (2, 4)
    assert packed.shared.buckets == ((1, 2, 1),) and packed.shared.key_index.tolist() == [3, 4, 0]
    assert packed.shared_tokens == 4 and packed.max_seqlen == 4  # rows 1 and 3 did not repeat [5, 6]
    # 7, 8 by 6, 7; 11 by row 0's 6 (packed position 4); 10 by 9
    assert packed.predictor_index.tolist() == [4, 5, 4, 1]
    assert packed.targets(input_ids[:, 3:]).tolist() == [7, 8, 11, 10]


@pytest.mark.parametrize("arch", PACKED_ARCHS)
def test_packed_log_probs_entropy_and_policy_gradient_equal_padded(arch):
    model = tiny_model(arch)
    batch = _rl_batch()
    cfg = ActorConfig(entropy_coeff=0.01, use_kl_loss=True)
    counts = GlobalCounts(tokens=float(batch["response_mask"].sum()), rows=float(len(batch)))
    out = {}
    for mode, (packed, shared) in MODES.items():
        log_probs = PolicyLogProbs(temperature=0.9, chunk_tokens=7, backend="torch", remove_padding=packed, share_prompts=shared)
        logp, entropy = log_probs(model, batch, compute_entropy=True)
        loss = PolicyObjective(cfg, get_policy_loss("vanilla"), log_probs, model)(batch, counts)(batch).loss
        out[mode] = logp, entropy, loss.detach(), _grads(model, loss)
    real = batch["attention_mask"][:, -batch["responses"].shape[1]:].bool()
    for mode in ("packed", "shared"):
        for padded_value, packed_value in zip(out["padded"][:3], out[mode][:3]):
            torch.testing.assert_close(packed_value.detach()[real] if packed_value.ndim else packed_value,
                                       padded_value.detach()[real] if padded_value.ndim else padded_value, atol=1e-5, rtol=0)
        assert torch.all(out[mode][0][~real] == 0)  # padded response slots are left at 0, never computed
        assert_grads_close(out[mode][3], out["padded"][3])


@pytest.mark.parametrize("arch", PACKED_ARCHS)
def test_packed_critic_values_and_gradient_equal_padded(arch):
    model = tiny_model(arch, head="values")
    batch = _rl_batch(seed=3)
    counts = GlobalCounts(tokens=float(batch["response_mask"].sum()), rows=float(len(batch)))
    out = {}
    for mode, (packed, shared) in MODES.items():
        objective = ValueObjective(CriticConfig(), model, remove_padding=packed, share_prompts=shared)
        values = response_values(model, batch, remove_padding=packed, share_prompts=shared)
        loss = objective(batch, counts)(batch).loss
        out[mode] = values.detach(), loss.detach(), _grads(model, loss)
    real = batch["attention_mask"][:, -batch["responses"].shape[1]:].bool()
    for mode in ("packed", "shared"):
        torch.testing.assert_close(out[mode][0][real], out["padded"][0][real], atol=1e-5, rtol=0)
        torch.testing.assert_close(out[mode][1], out["padded"][1], atol=1e-5, rtol=0)
        assert_grads_close(out[mode][2], out["padded"][2])


@pytest.mark.parametrize("arch", PACKED_ARCHS)
def test_packed_dpo_loss_and_gradient_equal_padded(arch):
    model = tiny_model(arch)
    prompt_lens, chosen_lens, rejected_lens = [6, 2, 4], [3, 8, 1], [5, 2, 7]
    tensors: dict[str, torch.Tensor] = {}
    for prefix, lens, seed in (("chosen_", chosen_lens, 0), ("rejected_", rejected_lens, 0)):  # one prompt per pair
        rows = random_rows(prompt_lens, lens, seed, prompt_width=6, response_width=8)
        tensors.update({prefix + k: v for k, v in rows.items()})
    tensors.update(ref_chosen_logps=torch.tensor([-12.0, -30.0, -4.0]), ref_rejected_logps=torch.tensor([-20.0, -8.0, -25.0]))
    batch = Batch(tensors=tensors)
    out = {}
    for mode, (packed, shared) in MODES.items():
        log_probs = PolicyLogProbs(temperature=1.0, chunk_tokens=1024, backend="torch", remove_padding=packed, share_prompts=shared)
        objective = DPOObjective(PreferenceConfig(), log_probs, model)
        result = objective(batch, GlobalCounts(tokens=0.0, rows=3.0))(batch)
        out[mode] = result.loss.detach(), result.stats, _grads(model, result.loss)
    for mode in ("packed", "shared"):  # shared: each pair's chosen and rejected hold their prompt once
        torch.testing.assert_close(out[mode][0], out["padded"][0], atol=1e-5, rtol=0)
        for name, (total, count) in out["padded"][1].items():
            assert out[mode][1][name][0] == pytest.approx(total, abs=1e-4) and out[mode][1][name][1] == count, name
        assert_grads_close(out[mode][2], out["padded"][2])


def test_shared_prompts_on_transformers_own_attention_are_not_shared():
    """A model not switched to rlcore's attention (a caller's own, as LoRA's tests and helpers use)
    would drop the shared-prompt keyword: asked to share, it packs every row whole instead."""
    config, lm, _ = ARCHS["qwen2-gqa"]
    torch.manual_seed(0)
    model = lm(config)  # transformers' sdpa: packed sequences kept apart by their position ids, no shared prompts
    batch = _rl_batch()
    padded, _ = PolicyLogProbs(1.0, 1024, "torch", remove_padding=False)(model, batch)
    shared, _ = PolicyLogProbs(1.0, 1024, "torch", remove_padding=True, share_prompts=True)(model, batch)
    real = batch["attention_mask"][:, -batch["responses"].shape[1]:].bool()
    torch.testing.assert_close(shared[real], padded[real], atol=1e-5, rtol=0)


def test_transformers_style_packing_without_cu_seqlens_is_kept_apart():
    """A caller that packs the transformers way (restarting position ids, no mask, no cu_seqlens)
    still gets sequences that do not see each other under `rlcore_varlen`."""
    model = tiny_model("qwen2-gqa").eval()
    a, b = torch.randint(1, VOCAB, (1, 6)), torch.randint(1, VOCAB, (1, 4))
    with torch.no_grad():
        alone = torch.cat([model.model(input_ids=x, use_cache=False).last_hidden_state for x in (a, b)], 1)
        together = model.model(input_ids=torch.cat([a, b], 1), position_ids=torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]]),
                               use_cache=False).last_hidden_state
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)


def test_sliding_window_shorter_than_a_sequence_is_refused_at_load_naming_the_key(tmp_path):
    torch.manual_seed(0)
    config = Qwen2Config(**SIZES, num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=3,
                         max_window_layers=0)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"sliding_window=3.*model.use_remove_padding=false"):
        load_causal_lm(tmp_path, "float32", torch.device("cpu"))
    assert load_causal_lm(tmp_path, "float32", torch.device("cpu"), remove_padding=False) is not None


def _long_tailed_batch(n: int = 24, seed: int = 0) -> Batch:
    """Responses lognormal in length (median ~12, a few ~10x that), prompts 4-16 tokens."""
    g = torch.Generator().manual_seed(seed)
    response_lens = torch.exp(torch.randn(n, generator=g) * 1.0 + 2.5).clamp(1, 160).long().tolist()
    prompt_lens = torch.randint(4, 17, (n,), generator=g).tolist()
    t = random_rows(prompt_lens, response_lens, seed)
    t["advantages"] = torch.randn(n, 1, generator=g).expand(n, t["responses"].shape[1]).contiguous()
    return Batch(tensors=t)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_update_actor_reports_computed_against_real_tokens(tmp_path, packed):
    """What `update_actor` puts in metrics.jsonl: the tokens its forwards ran on (old log-probs,
    then one pass per epoch) against the real ones; packed ≤ 1.05 on a long-tailed mix."""
    tiny_model("llama").save_pretrained(tmp_path / "policy")
    cfg = load_config(None, [f"model.path={tmp_path / 'policy'}", "data.train_files=[unused.parquet]", "trainer.device=cpu",
                             "data.train_batch_size=6", "actor.ppo_mini_batch_size=3", "rollout.n=4", "actor.ppo_epochs=2",
                             "actor.max_tokens_per_micro_batch=256", f"model.use_remove_padding={str(packed).lower()}"])
    actor = ActorWorker(role_spec(cfg, "actor"))
    actor.setup()
    batch = _long_tailed_batch()
    batch = batch.union(actor.compute_log_prob(batch))
    metrics = actor.update_actor(batch, 4)
    real = float(batch["attention_mask"].sum()) * 3  # the old-log-prob pass and two epochs
    assert metrics["perf/actor_real_tokens"] == real
    ratio = metrics["perf/actor_compute_token_ratio"]
    assert ratio == metrics["perf/actor_compute_tokens"] / real
    if packed:
        assert ratio <= 1.05
    else:  # micro-batches of the batch-wide padded width
        assert ratio > 3


def test_critic_reports_computed_against_real_tokens(tmp_path):
    tiny_model("qwen2-gqa", head="values").save_pretrained(tmp_path / "critic")
    cfg = load_config(None, [f"model.path={tmp_path / 'critic'}", "data.train_files=[unused.parquet]", "trainer.device=cpu",
                             "algorithm.name=ppo", "algorithm.adv_estimator=gae", "data.train_batch_size=6",
                             "actor.ppo_mini_batch_size=6", "rollout.n=4", "critic.max_tokens_per_micro_batch=200"])
    critic = CriticWorker(role_spec(cfg, "critic"))
    critic.setup()
    batch = _long_tailed_batch(seed=1)
    batch = batch.union(Batch(tensors={"returns": torch.randn(batch["responses"].shape)}))
    batch = batch.union(critic.compute_values(batch))
    metrics = critic.update_critic(batch, 4)
    assert metrics["perf/critic_real_tokens"] == float(batch["attention_mask"].sum()) * 2
    assert metrics["perf/critic_compute_token_ratio"] <= 1.05



def test_prompt_units_keep_a_prompts_rows_together_within_the_budget():
    # rows 0-2 share a 4-token prompt, rows 3-4 a 2-token one; a unit counts its prompt once
    units, tokens = prompt_units([0, 0, 0, 3, 3], [10, 8, 12, 5, 6], [4, 4, 4, 2, 2], max_tokens=20)
    assert units == [[0, 1], [2], [3, 4]] and tokens == [14, 12, 9]


def _grouped_batch(prompts: int = 6, n: int = 4, seed: int = 0) -> Batch:
    """GRPO's layout: `n` samples of each prompt (prompts 4-16 tokens, responses long-tailed)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(4, 17, (prompts,), generator=g).repeat_interleave(n).tolist()
    response_lens = torch.exp(torch.randn(prompts * n, generator=g) * 0.8 + 2.3).clamp(1, 60).long().tolist()
    t = random_rows(prompt_lens, response_lens, seed)
    r = t["responses"].shape[1]
    for row in range(prompts * n):  # the samples of a prompt repeat its first row's prompt
        t["input_ids"][row, :-r] = t["input_ids"][row - row % n, :-r]
    t["advantages"] = torch.randn(prompts * n, 1, generator=g).expand(prompts * n, r).contiguous()
    return Batch(tensors=t)


def test_update_actor_with_shared_prompts_steps_as_without_and_computes_each_prompt_once(tmp_path):
    """`model.share_prompt_prefix` on the actor's real update (old log-probs, then an update of two
    mini-batches over token-budget micro-batches): the same log-probs, loss and new weights as
    without it, and the tokens computed are each micro-batch's prompts once plus its responses."""
    tiny_model("qwen2-gqa").save_pretrained(tmp_path / "policy")
    batch = _grouped_batch()
    out = {}
    for share in (False, True):
        cfg = load_config(None, [f"model.path={tmp_path / 'policy'}", "data.train_files=[unused.parquet]", "trainer.device=cpu",
                                 "data.train_batch_size=6", "actor.ppo_mini_batch_size=3", "rollout.n=4",
                                 "actor.max_tokens_per_micro_batch=150", f"model.share_prompt_prefix={str(share).lower()}"])
        actor = ActorWorker(role_spec(cfg, "actor"))
        actor.setup()
        old = actor.compute_log_prob(batch)
        metrics = actor.update_actor(batch.union(old), 4)
        out[share] = old["old_log_probs"], metrics, {k: v.clone() for k, v in actor.model.state_dict().items()}
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=0)
    for key in ("actor/pg_loss", "actor/grad_norm", "perf/actor_real_tokens"):
        assert out[True][1][key] == pytest.approx(out[False][1][key], rel=1e-4, abs=1e-6), key
    for name, w in out[False][2].items():
        torch.testing.assert_close(out[True][2][name], w, atol=1e-6, rtol=1e-5, msg=name)
    real = float(batch["attention_mask"].sum())
    prompts = float(batch["attention_mask"][:, : -batch["responses"].shape[1]].sum())
    assert out[False][1]["perf/actor_compute_tokens"] == 2 * real  # the old-log-prob pass and one epoch
    per_prompt = batch["attention_mask"].sum(1).view(6, 4).sum(1) - batch["attention_mask"][::4, : -batch["responses"].shape[1]].sum(1) * 3
    assert per_prompt.max() <= 150  # so each prompt's 4 rows fit in one micro-batch: its prompt computed once, not 4 times
    assert out[True][1]["perf/actor_compute_tokens"] == 2 * (real - prompts * 3 / 4)
