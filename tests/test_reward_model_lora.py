"""LoRA on reward-model training (`algorithm.name: rm`, `reward_model.lora`), on tiny models built
here (Llama and Qwen2, both with grouped-query attention): only the backbone's adapter and the
score head train, the parameter counts are in the metrics, a checkpoint holds the adapter (with
the head) and resumes exactly, and the merged folder is a plain sequence classifier whose own
transformers forward gives the trained model's scores, which an RL run's reward model (the merged
folder as `reward_model.path`) scores with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_reward_model import _policy_dir, other_tokenizer, rl_config  # tests/ is on sys.path (pytest rootdir conftest)
from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlcore.config import ConfigError, config_from_dict, role_spec
from rlcore.protocol import Batch
from rlcore.workers.reward_model import RewardModelWorker, merge_reward_model

PROMPTS = ["12+34=", "5+5=", "70+8=", "1+1="]


def _backbone(folder, arch):
    """A causal LM with the reward model's tokenizer (its chat template) and no pad token in its
    config: the reward model's pad comes from the tokenizer, and the merged folder must say so."""
    tok = other_tokenizer()
    torch.manual_seed(0)
    sizes = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, eos_token_id=tok.eos_token_id, pad_token_id=None)
    lm = LlamaForCausalLM(LlamaConfig(**sizes)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**sizes))
    lm.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _pairs() -> Batch:
    chosen = ["#### 46", "#### 10", "#### 78", "#### 2"]
    rejected = ["#### 36", "#### 1", "#### 8", "#### 11"]
    return Batch(tensors={"margin": torch.zeros(4), "margin_given": torch.zeros(4)},
                 meta={"prompt_messages": [[{"role": "user", "content": p}] for p in PROMPTS],
                       "chosen_text": chosen, "rejected_text": rejected})


def _rm_config(model_dir, tmp_path, **lora):
    return config_from_dict({
        "model": {"path": str(model_dir)}, "data": {"train_files": ["unused.parquet"], "train_batch_size": 4},
        "algorithm": {"name": "rm"}, "trainer": {"device": "cpu", "output_dir": str(tmp_path / "run")},
        "reward_model": {"optim": {"lr": 1e-2}, "mini_batch_size": 2, "lora": {"rank": 4, "alpha": 8, **lora}}})


def _adapter(worker):
    return worker.adapter.state(keep=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lora_reward_model_trains_resumes_exactly_and_merges_to_a_servable_classifier(tmp_path, arch):
    base = _backbone(tmp_path / "base", arch)
    config = _rm_config(base, tmp_path)
    batch = _pairs()
    worker = RewardModelWorker(role_spec(config, "reward_model"))
    worker.setup()
    trained = [n for n, p in worker.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n or n.startswith("score.modules_to_save.") for n in trained)
    assert "score.modules_to_save.default.weight" in trained  # the fresh head trains in full, beside the adapter
    first = worker.update_reward_model(batch)
    assert 0 < first["reward_model/trainable_params"] < 0.2 * first["reward_model/total_params"]
    assert first["reward_model/trainable_params"] == sum(p.numel() for n, p in worker.model.named_parameters() if n in trained)

    ckpt = tmp_path / "ckpt1"
    ckpt.mkdir()
    worker.save_checkpoint(str(ckpt))
    assert sorted(p.name for p in ckpt.iterdir()) == ["reward_model_adapter", "reward_model_optim.pt"]  # no model copy
    second = worker.update_reward_model(batch)
    resumed = RewardModelWorker(role_spec(config, "reward_model"))
    resumed.load_checkpoint(str(ckpt))
    again = resumed.update_reward_model(batch)
    steady = lambda m: {k: v for k, v in m.items() if not k.startswith("perf/")}  # noqa: E731
    assert steady(again) == steady(second)
    a, b = _adapter(worker), _adapter(resumed)
    assert a.keys() == b.keys() and "base_model.model.score.weight" in a and all(torch.equal(a[k], b[k]) for k in a)
    assert first["reward_model/loss"] != second["reward_model/loss"]  # it trained

    worker.save_checkpoint(str(tmp_path / "ckpt2"))
    merged = merge_reward_model(base, tmp_path / "ckpt2" / "reward_model_adapter", tmp_path / "merged")
    pairs, enc = worker.reader.encode_pairs(batch)
    want = worker.score_pairs(batch)
    theirs = AutoModelForSequenceClassification.from_pretrained(merged).eval()  # transformers' own, as is
    assert theirs.config.pad_token_id == worker.reader.pad_token_id == other_tokenizer().pad_token_id
    with torch.no_grad():
        own = theirs(input_ids=enc.input_ids, attention_mask=enc.attention_mask).logits.squeeze(-1)
    torch.testing.assert_close(own, torch.cat([want["chosen_scores"], want["rejected_scores"]]), atol=1e-5, rtol=0)
    assert (own[:4] - own[4:]).abs().min() > 0  # not a constant head

    # an RL run scoring with it: the merged folder as reward_model.path (its trained head kept)
    scorer = RewardModelWorker(role_spec(rl_config(_policy_dir(tmp_path), merged), "reward_model"))
    scorer.setup()
    got = scorer.score_pairs(batch)
    for side in ("chosen_scores", "rejected_scores"):
        torch.testing.assert_close(got[side], want[side], atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides, message", [
    ({"reward_model": {"path": "rm", "lora": {"rank": 4}}},
     r"reward_model.lora applies to training a reward model \(algorithm.name=rm\), not to algorithm.name=grpo"),
    ({"algorithm": {"name": "rm"}, "actor": {"lora": {"rank": 4}}}, "actor.lora: algorithm.name=rm trains a reward model"),
    ({"critic": {"lora": {"rank": 4}}}, "critic.lora: algorithm.name=grpo has no critic"),
    ({"algorithm": {"name": "rm"}, "reward_model": {"lora": {"rank": 4, "dropout": 1.0}}}, "reward_model.lora.dropout"),
])
def test_lora_on_a_role_the_run_does_not_train_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"model": {"path": "m"}, "data": {"train_files": ["unused.parquet"]}, **overrides})


@pytest.mark.slow  # ~30 s: two reward-model trainings of two steps, evaluations and MLflow's SQLite registry
@pytest.mark.pipeline  # the lifecycle's reward-model stages
def test_pipeline_registers_a_lora_reward_model_merged_with_its_adapter_beside_and_warm_starts_from_it(tiny_example, tmp_path):
    """The reward-model stages with `reward_model.lora` (a real SQLite MLflow registry here): the
    registered version is a plain classifier folder transformers loads as is, and the run's
    `adapter` artifact on the base gives the same scores. The next pipeline run (warm start, the
    default) trains a fresh adapter on that champion, score head included: before its first step
    it scores the held-out pairs as the champion did at the end of its training."""
    from mlflow.tracking import MlflowClient
    from peft import PeftModel

    from rlcore.cli import CONFIG_DIR
    from rlcore.config import load_config
    from rlcore.example.overrides import example_rm_overrides
    from rlcore.lifecycle import pipeline_run, rm_stages
    from rlcore.lifecycle import stages as lifecycle
    from rlcore.lifecycle.mlflow_store import MlflowStore, ModelRegistry
    from rlcore.lifecycle.promotion import promote_stage
    from rlcore.tracking import read_jsonl

    work = tmp_path / "work"
    work.mkdir()
    uri = f"sqlite:///{work / 'mlflow.db'}"
    config = load_config(CONFIG_DIR / "tiny_rm.yaml", example_rm_overrides() + [
        "trainer.total_steps=2", "trainer.save_every=2", "trainer.val_every=2", "trainer.val_before_train=false",
        "registry.promotion_margin=-1", f"tracking.mlflow_uri={uri}", "reward_model.lora.rank=4",
        "reward_model.lora.alpha=8", "reward_model.margin=0.5"])
    ctx = pipeline_run.start_pipeline(config, work, "rm-lora")
    train = rm_stages.train_reward_model_stage(config, work, ctx)
    evaluation = rm_stages.evaluate_reward_model_stage(config, train["candidate_dir"], None, work, ctx)
    decided = promote_stage(config, train, evaluation, work, ctx)
    assert decided["version"] == "1"
    # One checkpoint, one set of numbers: the gate's loss (margin 0.5 for rows without their own, as
    # training's loss) and accuracy are training's last `val/*` on the same pairs.
    [last_val] = [r for r in read_jsonl(Path(train["output_dir"]) / "metrics.jsonl") if r["step"] == 2 and "val/rm_loss" in r]
    assert evaluation["candidate"]["rm_loss"] == pytest.approx(last_val["val/rm_loss"], abs=1e-4)
    assert evaluation["candidate"]["pairwise_accuracy"] == last_val["val/pairwise_acc"]
    assert evaluation["candidate"]["score_margin"] == pytest.approx(last_val["val/score_margin"], abs=1e-4)

    registered = ModelRegistry(MlflowStore(uri), "rlcore-tiny-rm").download("1", tmp_path / "registered")
    assert not (registered / "adapter_config.json").exists()  # a merged model, not an adapter
    served = AutoModelForSequenceClassification.from_pretrained(registered).eval()  # as is
    adapter = MlflowClient(uri).download_artifacts(train["run_id"], "adapter", str(tmp_path))
    base = AutoModelForSequenceClassification.from_pretrained(tiny_example.model_dir, num_labels=1,
                                                              pad_token_id=served.config.pad_token_id)
    with_adapter = PeftModel.from_pretrained(base, adapter).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]])
    with torch.no_grad():
        want, got = with_adapter(input_ids=ids).logits, served(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert got[0] != got[1]

    champion = lifecycle.champion_stage(config, work)
    assert champion is not None and champion["version"] == "1"
    again = load_config(CONFIG_DIR / "tiny_rm.yaml", example_rm_overrides() + [
        "trainer.total_steps=2", "trainer.save_every=2", "trainer.val_every=2", "trainer.val_before_train=true",
        "registry.promotion_margin=-1", f"tracking.mlflow_uri={uri}", "reward_model.lora.rank=4",
        "reward_model.lora.alpha=8"])
    warm = rm_stages.train_reward_model_stage(again, work, pipeline_run.start_pipeline(again, work, "rm-lora-2"), champion)
    assert warm["parent_model"] == "models:/rlcore-tiny-rm/1" and warm["start_model"] == champion["path"]
    [first_end] = [r for r in read_jsonl(Path(train["output_dir"]) / "metrics.jsonl") if r["step"] == 2 and "val/score_margin" in r]
    [warm_start] = [r for r in read_jsonl(Path(warm["output_dir"]) / "metrics.jsonl") if r["step"] == 0]
    assert warm_start["val/pairwise_acc"] == first_end["val/pairwise_acc"]
    for key in ("val/score_margin", "val/chosen_score", "val/rejected_score"):  # a fresh head would score otherwise
        assert warm_start[key] == pytest.approx(first_end[key], abs=1e-4), key
    again_served = AutoModelForSequenceClassification.from_pretrained(warm["candidate_dir"]).eval()
    with torch.no_grad():
        assert not torch.allclose(again_served(input_ids=ids).logits, got)  # and it trained on from there
