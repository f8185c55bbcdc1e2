"""The workers' shared parts on a tiny random Llama: the update loop (independent of how rows are
cut into micro-batches, the non-finite guard), the no-grad forward loop, checkpoint I/O
(`weights_only` loads), and 2 FSDP2 ranks (gloo, spawned processes) against one process for the
actor and the critic, including resuming a one-process checkpoint on 2 ranks and back."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from gloo_ranks import spawn  # tests/ is on sys.path
from net import free_port  # tests/ is on sys.path
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

from rlcore.algos import get_policy_loss
from rlcore.config import ActorConfig, load_config, role_spec
from rlcore.controller import Dispatch
from rlcore.controller.dispatch import plan_dispatch
from rlcore.protocol import Batch
from rlcore.workers.actor import ActorWorker, PolicyObjective
from rlcore.workers.checkpointing import load_training_state, save_trained
from rlcore.workers.critic import CriticWorker
from rlcore.workers.loops import MicroBatching, UpdateSettings, forward_no_grad, run_update
from rlcore.workers.optim import build_optimizer, build_scheduler
from rlcore.workers.policy import PolicyLogProbs
from rlcore.workers.trainable import Trainable

VOCAB = 48
CPU = torch.device("cpu")


def _llama_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0)


def _policy(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(_llama_config())


def _batch(n: int = 8, p: int = 6, r: int = 5, seed: int = 0) -> Batch:
    """Left-padded prompts, right-padded responses of varied lengths, and what the losses read."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.tensor([6, 3, 4, 2, 5, 6, 1, 3])[:n]
    resp_len = torch.tensor([5, 5, 1, 2, 4, 5, 3, 1])[:n]
    prompts = torch.randint(3, VOCAB, (n, p), generator=g)
    responses = torch.randint(3, VOCAB, (n, r), generator=g)
    pmask = (torch.arange(p)[None, :] >= (p - prompt_len)[:, None]).long()
    rmask = (torch.arange(r)[None, :] < resp_len[:, None]).long()
    attn = torch.cat([pmask, rmask], 1)
    return Batch(
        tensors={
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0), "response_mask": rmask.float(),
            "advantages": torch.randn(n, 1, generator=g).expand(n, r).contiguous(),
            "returns": torch.randn(n, r, generator=g), "values": 0.1 * torch.randn(n, r, generator=g),
        },
    )


def _trainable(model: torch.nn.Module, cfg: ActorConfig, total_steps: int = 10) -> Trainable:
    optimizer = build_optimizer(model, cfg.optim)
    return Trainable(model, optimizer, build_scheduler(optimizer, cfg.optim, total_steps))


LOG_PROBS = PolicyLogProbs(temperature=1.0, chunk_tokens=1024, backend="torch")
VANILLA = get_policy_loss("vanilla")


def _with_old_log_probs(model: torch.nn.Module, batch: Batch) -> Batch:
    old = LOG_PROBS.no_grad(model, batch, "old_log_probs", MicroBatching(64, False, 0), CPU)["old_log_probs"]
    return batch.union(Batch(tensors={"old_log_probs": old - 0.05, "ref_log_probs": old + 0.02}))


@pytest.mark.parametrize("micro", [MicroBatching(1, False, 0), MicroBatching(3, False, 0), MicroBatching(64, True, 20)])
def test_update_is_the_same_however_rows_are_cut_into_micro_batches(micro):
    cfg = ActorConfig(use_kl_loss=True, entropy_coeff=0.01, ppo_epochs=2, optim={"lr": 1e-3})
    batch = _with_old_log_probs(_policy(), _batch())
    results, weights = [], []
    for m in (MicroBatching(64, False, 0), micro):  # one forward per mini-batch, then `micro`
        trained = _trainable(_policy(), cfg)
        settings = UpdateSettings(epochs=2, mini_batch_size=2, micro=m, grad_clip=1.0)
        objective = PolicyObjective(cfg, VANILLA, LOG_PROBS, trained.model)
        results.append(run_update(trained, batch, objective, settings, mini_batch_rows=4, device=CPU))
        weights.append({k: v.clone() for k, v in trained.model.state_dict().items()})
    whole, cut = results
    assert whole.skipped_steps == cut.skipped_steps == 0
    assert cut.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-7)
    assert cut.grad_norm == pytest.approx(whole.grad_norm, rel=1e-5)
    assert set(cut.metrics) == {"kl_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    for k, v in whole.metrics.items():  # token-pooled, so independent of the micro-batches
        assert cut.metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    for k in weights[0]:
        torch.testing.assert_close(weights[1][k], weights[0][k], atol=1e-6, rtol=1e-5)


def test_non_finite_loss_skips_every_step_and_leaves_the_weights():
    cfg = ActorConfig(max_tokens_per_micro_batch=8192)
    batch = _with_old_log_probs(_policy(), _batch())
    batch["advantages"] = torch.full_like(batch["advantages"], float("nan"))
    trained = _trainable(_policy(), cfg)
    before = {k: v.clone() for k, v in trained.model.state_dict().items()}
    objective = PolicyObjective(cfg, VANILLA, LOG_PROBS, trained.model)
    result = run_update(trained, batch, objective, UpdateSettings.of(cfg), mini_batch_rows=4, device=CPU)
    assert result.skipped_steps == 2 and math.isnan(result.loss) and math.isnan(result.grad_norm)
    assert all(torch.equal(before[k], v) for k, v in trained.model.state_dict().items())
    assert trained.scheduler.last_epoch == 1  # one training step, even when its updates were skipped


def test_forward_no_grad_writes_each_row_back_and_restores_the_mode():
    model = _policy()
    batch = _batch()
    full, _ = LOG_PROBS(model, batch)
    model.train()
    packed = MicroBatching(64, True, 12)  # token-budget packing reorders rows across micro-batches
    out = forward_no_grad(model, batch, lambda mb: {"lp": LOG_PROBS(model, mb)[0], "row": mb["prompts"][:, 0]}, packed, CPU)
    assert model.training
    torch.testing.assert_close(out["lp"], full.detach(), atol=1e-5, rtol=1e-5)
    assert torch.equal(out["row"], batch["prompts"][:, 0].float())


def test_checkpoint_round_trip_with_weights_only_loads(tmp_path):
    cfg = ActorConfig(optim={"lr": 1e-3, "warmup_steps": 3, "schedule": "cosine"}, max_tokens_per_micro_batch=8192)
    batch = _with_old_log_probs(_policy(), _batch())

    def step(trained: Trainable) -> None:
        run_update(trained, batch, PolicyObjective(cfg, VANILLA, LOG_PROBS, trained.model), UpdateSettings.of(cfg),
                   mini_batch_rows=4, device=CPU)

    trained = _trainable(_policy(), cfg)
    step(trained), step(trained)
    save_trained(trained, tmp_path, "actor", rank=0)
    assert (tmp_path / "actor" / "model.safetensors").is_file() and (tmp_path / "actor_optim.pt").is_file()
    state = torch.load(tmp_path / "actor_optim.pt", weights_only=True)  # AdamW + LambdaLR: plain data
    assert state["scheduler"]["last_epoch"] == 2

    resumed = _trainable(LlamaForCausalLM.from_pretrained(tmp_path / "actor"), cfg)
    load_training_state(resumed, tmp_path, "actor", CPU)
    assert resumed.lr == trained.lr
    step(trained), step(resumed)
    for k, v in trained.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[k], v, atol=1e-7, rtol=0)


# ----- 2 FSDP2 ranks (gloo) against one process ---------------------------------------------------


def _models(tmp_path: Path) -> tuple[Path, Path]:
    policy, critic = tmp_path / "policy", tmp_path / "critic"
    _policy().save_pretrained(policy)
    torch.manual_seed(1)
    value_config = _llama_config()
    value_config.num_labels = 1
    value_config.classifier_dropout = 0.0  # HF's default 0.1 would make the updates random
    LlamaForTokenClassification(value_config).save_pretrained(critic)
    return policy, critic


def _config(policy: Path, critic: Path):
    return load_config(None, [
        f"model.path={policy}", f"critic.model_path={critic}", "data.train_files=[unused.parquet]",
        "data.val_files=[unused.parquet]", "trainer.device=cpu", "algorithm.name=ppo", "algorithm.adv_estimator=gae",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "actor.ppo_epochs=2",
        "critic.ppo_epochs=2", "actor.max_tokens_per_micro_batch=20", "critic.max_tokens_per_micro_batch=14",
        "actor.use_kl_loss=true", "actor.optim.lr=1e-3", "critic.optim.lr=1e-3", "trainer.total_steps=10",
    ])


def _run(world_size: int, rank: int, policy: Path, critic: Path, work: Path) -> dict:
    """Update actor and critic on `_batch()` (this rank's share), save, resume, update again."""
    cfg = _config(policy, critic)
    batch = _batch()
    batch = batch.union(Batch(tensors={"old_log_probs": torch.load(work / "old.pt"), "ref_log_probs": torch.load(work / "ref.pt")}))
    mine = plan_dispatch(Dispatch.DP_BALANCED, world_size, (batch,), {}).calls[rank][1][0]
    out: dict = {}
    actor, critic_w = ActorWorker(role_spec(cfg, "actor"), rank, world_size), CriticWorker(role_spec(cfg, "critic"), rank, world_size)
    actor.setup(), critic_w.setup()
    out["log_probs"] = actor.compute_log_prob(mine)["old_log_probs"]
    out["values"] = critic_w.compute_values(mine)["values"]
    out["actor"], out["critic"] = actor.update_actor(mine, 2), critic_w.update_critic(mine, 2)
    folder = work / f"ckpt_{world_size}"
    folder.mkdir(exist_ok=True)
    actor.save_checkpoint(str(folder)), critic_w.save_checkpoint(str(folder))
    resume_from = work / f"ckpt_{3 - world_size}"  # the other run's checkpoint: 1 process <-> 2 ranks
    if resume_from.is_dir():
        actor.load_checkpoint(str(resume_from))
        critic_w.load_checkpoint(str(resume_from))
    out["actor_again"], out["critic_again"] = actor.update_actor(mine, 2), critic_w.update_critic(mine, 2)
    out["weights"] = dict(actor.weights_for_rollout())
    return out


def _rank_main(rank: int, world_size: int, port: int, policy: Path, critic: Path, work: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        out = _run(world_size, rank, policy, critic, work)
        torch.save(out, work / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed  # 2 FSDP2 ranks on gloo
def test_two_fsdp2_ranks_report_and_step_as_one_process(tmp_path):
    policy, critic = _models(tmp_path)
    lp, _ = LOG_PROBS(LlamaForCausalLM.from_pretrained(policy), _batch())
    torch.save(lp.detach() - 0.05, tmp_path / "old.pt"), torch.save(lp.detach() + 0.02, tmp_path / "ref.pt")
    one = _run(1, 0, policy, critic, tmp_path)  # writes ckpt_1 (one process) first
    spawn(_rank_main, (2, free_port(), policy, critic, tmp_path), 2)  # resumes from ckpt_1
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert (tmp_path / "ckpt_2" / "actor_dcp").is_dir() and (tmp_path / "ckpt_2" / "critic_dcp").is_dir()

    plan = plan_dispatch(Dispatch.DP_BALANCED, 2, (_batch(),), {})
    gathered = plan.collect([Batch(tensors={"lp": r["log_probs"], "v": r["values"]}) for r in ranks])
    torch.testing.assert_close(gathered["lp"], one["log_probs"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gathered["v"], one["values"], atol=1e-5, rtol=1e-5)
    for key in ("actor", "critic", "actor_again", "critic_again"):
        for r in ranks:  # every rank reports the one-process numbers (rank-summed loss and pooled stats)
            assert set(r[key]) == set(one[key]), key
            for name, value in one[key].items():
                assert r[key][name] == pytest.approx(value, rel=1e-4, abs=1e-6), (key, name)
    assert one["actor"]["actor/kl_loss"] > 0 and one["actor"]["actor/pg_loss"] != 0
    # 2 ranks resumed from the one-process checkpoint; one process resumes from the 2 ranks' (DCP)
    cfg = _config(policy, critic)
    back = ActorWorker(role_spec(cfg, "actor"))
    back.load_checkpoint(str(tmp_path / "ckpt_2"))
    batch = _batch().union(Batch(tensors={"old_log_probs": torch.load(tmp_path / "old.pt"), "ref_log_probs": torch.load(tmp_path / "ref.pt")}))
    again = back.update_actor(batch, 2)
    for name, value in one["actor_again"].items():
        assert again[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    w1, w2, w3 = one["weights"], ranks[0]["weights"], dict(back.weights_for_rollout())
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=0, msg=k)
        torch.testing.assert_close(w3[k], w1[k], atol=1e-5, rtol=0, msg=k)
