"""Exactly on-policy steps skip the old-log-prob pass (`actor.recompute_old_log_prob: auto`).

The update on such a step is the same as with the pass: the weights after it, the reported metrics,
and the old log-probs and entropy that come back from the update's forward, on a Llama and on a
Qwen2 with grouped-query attention (worker level, fast). The recipe-level tests (slow, tiny example)
check that the pass is really skipped (its phase is absent and the worker method never called),
that a run reports the same numbers with and without it, and that the modes that need it keep it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_runs import SCORE_IN_PROCESS  # tests/ is on sys.path
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlcore.config import config_from_dict, role_spec
from rlcore.protocol import Batch
from rlcore.workers.actor import ActorWorker

VOCAB, P, R, N = 64, 6, 5, 8


def _save(kind: str, path: Path) -> Path:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=64,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False))
    else:  # grouped-query attention: 4 query heads share 2 key/value heads
        model = Qwen2ForCausalLM(Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory) -> Path:
    return _save(request.param, tmp_path_factory.mktemp(request.param) / "model")


def _config(model_dir: Path, tmp_path: Path, **actor):
    return config_from_dict({
        "model": {"path": str(model_dir)},
        "data": {"train_files": [str(tmp_path / "unused.parquet")], "train_batch_size": 4},
        "actor": {"ppo_mini_batch_size": 4, "optim": {"lr": 1e-2}, "max_tokens_per_micro_batch": 40, "tis_cap": 2.0,
                  "use_kl_loss": True, **actor},
        "rollout": {"backend": "hf", "n": 2},
        "trainer": {"device": "cpu", "output_dir": str(tmp_path / "run")},
    })


def _batch(seed: int = 0) -> Batch:
    """8 samples with left-padded prompts and responses of different lengths; rollout and reference
    log-probs near the model's (uniform-ish at init)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, VOCAB, (N, P), generator=g)
    responses = torch.randint(3, VOCAB, (N, R), generator=g)
    prompt_mask = torch.ones(N, P, dtype=torch.long)
    prompt_mask[::2, :2] = 0  # left padding
    response_mask = (torch.arange(R) < torch.randint(2, R + 1, (N, 1), generator=g)).float()
    attn = torch.cat([prompt_mask, response_mask.long()], 1)
    near = -float(np.log(VOCAB))
    return Batch(
        tensors={
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0), "response_mask": response_mask,
            "advantages": torch.randn(N, 1, generator=g).expand(N, R).contiguous(),
            "rollout_log_probs": near + 0.1 * torch.randn(N, R, generator=g),
            "ref_log_probs": near + 0.1 * torch.randn(N, R, generator=g),
        },
        meta={"uid": np.array([str(i // 2) for i in range(N)], dtype=object)},
    )


def test_the_on_policy_update_equals_the_update_after_the_recompute_pass(model_dir, tmp_path):
    cfg = _config(model_dir, tmp_path, entropy_coeff=0.01)
    assert cfg.old_log_probs_from_update
    with_pass, without = ActorWorker(role_spec(cfg, "actor")), ActorWorker(role_spec(cfg, "actor"))
    with_pass.setup()
    without.setup()
    batch = _batch()
    before = {n: p.detach().clone() for n, p in with_pass.model.named_parameters()}

    old = with_pass.compute_log_prob(batch)
    metrics_pass = with_pass.update_actor(batch.union(old), 2)
    out, metrics_skip = without.update_actor_on_policy(batch)

    # the update's forward gave what the pass computed (rows in the batch's order; padding zero)
    torch.testing.assert_close(out["old_log_probs"], old["old_log_probs"], rtol=0, atol=1e-6)
    torch.testing.assert_close(out["entropy"], old["entropy"], rtol=0, atol=1e-6)
    assert set(metrics_skip) == set(metrics_pass)
    for key, value in metrics_pass.items():
        if key in ("perf/actor_compute_tokens", "perf/actor_real_tokens"):  # forwards since the last update:
            assert metrics_skip[key] * 2 == value, key  # the skipped pass was one of the two over the batch
            continue
        assert metrics_skip[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert metrics_skip["actor/pg_clipfrac"] == 0.0  # ratio 1: nothing clipped
    moved = 0.0
    for (name, a), b in zip(with_pass.model.named_parameters(), without.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)  # bitwise today on CPU
        moved = max(moved, (a.detach() - before[name]).abs().max().item())
    assert moved > 1e-4  # the step changed the weights (lr 1e-2)


def test_the_on_policy_update_refuses_a_second_epoch(model_dir, tmp_path):
    worker = ActorWorker(role_spec(_config(model_dir, tmp_path, ppo_epochs=2), "actor"))
    worker.setup()
    with pytest.raises(ValueError, match="ppo_epochs=2"):
        worker.update_actor_on_policy(_batch())


@pytest.mark.parametrize(("overrides", "skips"), [
    ({}, True),
    ({"actor": {"recompute_old_log_prob": "always"}}, False),
    ({"actor": {"ppo_epochs": 2}}, False),
    ({"actor": {"ppo_mini_batch_size": 2}}, False),  # two optimizer steps: the second needs the first's old log-probs
    ({"trainer": {"off_policy": "one_step"}}, False),
    ({"algorithm": {"use_kl_in_reward": True}}, False),  # the reward's KL penalty reads them before the update
])
def test_which_steps_skip_the_pass(tmp_path, overrides, skips):
    tree: dict = {"model": {"path": "m"}, "data": {"train_files": ["t"], "train_batch_size": 4},
                  "actor": {"ppo_mini_batch_size": 4}, "trainer": {}, "algorithm": {}}
    for section, values in overrides.items():
        tree[section].update(values)
    assert config_from_dict(tree).old_log_probs_from_update is skips


def test_an_unknown_setting_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"actor\.recompute_old_log_prob"):
        config_from_dict({"model": {"path": "m"}, "data": {"train_files": ["t"]}, "actor": {"recompute_old_log_prob": "never"}})


def _run(tiny_example, out: Path, algorithm: str, *extra: str) -> tuple[list[dict], dict[str, torch.Tensor], int]:
    """Two steps of the tiny recipe; its metrics, the final actor weights, and how often the actor's
    old-log-prob pass ran."""
    from safetensors.torch import load_file

    from rlcore.cli import CONFIG_DIR, tiny_example_overrides
    from rlcore.config import load_config
    from rlcore.trainer.run import make_trainer

    cfg = load_config(CONFIG_DIR / f"tiny_{algorithm}.yaml", tiny_example_overrides(tiny_example, str(out)) + [
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4", "trainer.total_steps=2",
        "trainer.save_every=2", "trainer.val_before_train=false", "trainer.val_every=100", "trainer.loggers=[jsonl]",
        "trainer.trace=false", SCORE_IN_PROCESS, *extra])
    trainer = make_trainer(cfg)
    actor = trainer.groups.actor.workers[0]
    calls = []
    original = actor.compute_log_prob
    actor.compute_log_prob = lambda batch: calls.append(len(batch)) or original(batch)
    history = trainer.fit()
    weights = load_file(out / "checkpoints" / "step_00000002" / "actor" / "model.safetensors")
    return history, weights, len(calls)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_run_reports_and_learns_the_same_without_the_pass(tiny_example, tmp_path, algorithm):
    extra = ("actor.entropy_coeff=0.001", "actor.use_kl_loss=true")  # entropy and KL to the reference in play
    skipped, w_skip, calls_skip = _run(tiny_example, tmp_path / "auto", algorithm, *extra)
    full, w_full, calls_full = _run(tiny_example, tmp_path / "always", algorithm, *extra, "actor.recompute_old_log_prob=always")

    assert (calls_skip, calls_full) == (0, 2)  # the pass never ran on the on-policy steps
    assert all("time/old_log_prob_s" not in m for m in skipped) and all("time/old_log_prob_s" in m for m in full)
    for a, b in zip(skipped, full):
        same = {k for k in b if not k.startswith(("time/", "throughput/", "memory/"))}
        assert same <= set(a)  # entropy, KL, rollout/logprob_diff_*: all still reported
        for key in same:
            if key in ("perf/actor_compute_tokens", "perf/actor_real_tokens"):
                assert a[key] * 2 == b[key], key  # the actor's forwards: the update's, without the pass's
                continue
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    for name in w_full:
        torch.testing.assert_close(w_skip[name], w_full[name], rtol=1e-6, atol=1e-7, msg=name)
