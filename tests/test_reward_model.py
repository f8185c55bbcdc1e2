"""The reward model role on tiny models built here: the Bradley-Terry loss, the score as
transformers' own forward reads it (Llama and Qwen2 with grouped-query attention, packed and
padded, pad == EOS too), scoring that re-renders each conversation for a reward model whose
tokenizer and chat template differ from the policy's, the reward made from its scores, and the
bad inputs (not a sequence classifier, no chat template, NaN scores) refused or counted."""

from __future__ import annotations

import json
import math
import string

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForSequenceClassification,
)

from rlcore.algos import RunningMoments, bradley_terry_loss, combine_reward_scores
from rlcore.chat import prompt_ids
from rlcore.config import ConfigError, config_from_dict, role_spec
from rlcore.controller import InProcessWorkerGroup
from rlcore.data.preference import sequence_tensors
from rlcore.example.tokenizer import build_tokenizer
from rlcore.protocol import Batch
from rlcore.trainer.groups import WorkerGroups
from rlcore.trainer.metrics import Timer
from rlcore.trainer.preflight import preflight_problems
from rlcore.trainer.rm_scoring import NonFiniteRewardModelScore, RewardModelScoring
from rlcore.workers.forward import NotASequenceClassifier, sequence_scores
from rlcore.workers.loading import load_sequence_classifier
from rlcore.workers.reward_model import RewardModelInputError, RewardModelWorker

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}")


def other_tokenizer(chat_template: str | None = CHATML) -> PreTrainedTokenizerFast:
    """A character-level tokenizer unlike the tiny example's: other specials, the characters in
    reverse order (every id differs), no `####` token, a ChatML-style template."""
    specials = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"][::-1]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials + chars)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   unk_token="<|endoftext|>", chat_template=chat_template)


def save_rm(folder, tokenizer, seed=0, arch="llama"):
    """A random sequence classifier with grouped-query attention (4 heads, 2 KV heads), one label,
    with `tokenizer`. A Llama folder keeps a trained tokenizer.json under AutoTokenizer; a Qwen2
    one is read by Qwen2Tokenizer (other ids: refused at start-up, see the last test)."""
    torch.manual_seed(seed)
    sizes = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = (LlamaForSequenceClassification(LlamaConfig(**sizes)) if arch == "llama"
             else Qwen2ForSequenceClassification(Qwen2Config(**sizes)))
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # scores far apart, so a wrong reading shows
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def rl_config(policy, rm, **reward_model):
    return config_from_dict({"model": {"path": str(policy)}, "data": {"train_files": ["unused.parquet"]},
                             "trainer": {"device": "cpu"}, "reward_model": {"path": str(rm), **reward_model}})


# ----------------------------------------------------------------------------- the formulas
def test_bradley_terry_loss_and_its_margin():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    loss = bradley_terry_loss(chosen, rejected)
    want = [math.log1p(math.exp(-2.0)), math.log(2.0), math.log1p(math.exp(2.0))]
    assert loss.tolist() == pytest.approx(want, rel=1e-6)
    per_pair = bradley_terry_loss(chosen, rejected, torch.tensor([1.0, 0.0, 0.0]))
    assert per_pair[0].item() == pytest.approx(math.log1p(math.exp(-1.0)), rel=1e-6)  # must win by 1: costs more
    assert bradley_terry_loss(torch.tensor([1e4]), torch.tensor([-1e4])).item() == 0.0  # finite at any gap
    assert torch.isfinite(bradley_terry_loss(torch.tensor([-1e4]), torch.tensor([1e4]))).all()


def test_running_moments_equal_the_statistics_of_everything_seen():
    values = torch.randn(37, generator=torch.Generator().manual_seed(0)) * 3 + 1
    moments = RunningMoments()
    for part in values.split([5, 1, 20, 11]):
        moments.update(part)
    assert moments.count == 37
    assert moments.mean == pytest.approx(float(values.double().mean()), abs=1e-12)
    assert moments.std == pytest.approx(float(values.double().std(unbiased=False)), abs=1e-12)
    again = RunningMoments()
    again.load_state_dict(json.loads(json.dumps(moments.state_dict())))  # trainer state is JSON
    assert again == moments


def test_reward_is_the_weighted_sum_of_rule_and_normalised_clipped_model_scores():
    rule, rm = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([3.0, 1.0, 41.0])
    reward, clipped = combine_reward_scores(rule, rm, weight=2.0, rule_weight=0.5, mean=1.0, std=2.0, clip=5.0)
    assert reward.tolist() == pytest.approx([0.5 + 2.0 * 1.0, 0.0, 2.0 * 5.0], rel=1e-6)
    assert clipped.tolist() == [False, False, True]


# ----------------------------------------------------------------------------- the score
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_scores_are_what_transformers_forward_reads_from_the_saved_folder(tmp_path, arch, pad_is_eos):
    """Trained from a causal LM (fresh head, pad_token_id written), saved, loaded back as is by
    AutoModelForSequenceClassification: its own forward on a right-padded batch gives rlcore's
    scores, packed and padded, also when the pad token is the EOS (then the score is read at the
    token before the final EOS, as transformers does)."""
    torch.manual_seed(0)
    eos, pad = 2, (2 if pad_is_eos else 0)
    sizes = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64,
                 eos_token_id=eos, pad_token_id=pad)
    if arch == "llama":
        LlamaForCausalLM(LlamaConfig(**sizes, num_attention_heads=4, num_key_value_heads=4)).save_pretrained(tmp_path / "lm")
    else:
        from transformers import Qwen2ForCausalLM
        Qwen2ForCausalLM(Qwen2Config(**sizes, num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "lm")
    model = load_sequence_classifier(tmp_path / "lm", "float32", torch.device("cpu"), key="model.path", new_head_ok=True,
                                     pad_token_id=pad)
    model.save_pretrained(tmp_path / "rm")
    lengths = [7, 3, 5, 1]
    ids = torch.randint(3, 48, (4, 7))
    ids[0, 6] = ids[2, 4] = eos  # sequences that end in EOS
    mask = (torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad))
    theirs = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert theirs.config.pad_token_id == pad and theirs.config.num_labels == 1
    with torch.no_grad():
        want = theirs(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        for packed in (True, False):
            torch.testing.assert_close(sequence_scores(model.eval(), ids, mask, packed), want, rtol=1e-5, atol=1e-5)
    reloaded = load_sequence_classifier(tmp_path / "rm", "float32", torch.device("cpu"), key="reward_model.path")
    torch.testing.assert_close(reloaded.score.weight, model.score.weight)  # the trained head, not a fresh one


def _policy_dir(tmp_path):
    folder = tmp_path / "policy"
    build_tokenizer().save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 0}))
    return folder


def _generated(policy_tok, prompts: list[str], responses: list[list[int]]) -> Batch:
    """A rollout-shaped batch: LEFT-padded prompt ids, RIGHT-padded response ids (mask as given by
    each list's length), one sample per prompt."""
    p_ids = [prompt_ids([{"role": "user", "content": p}], policy_tok)[1] for p in prompts]
    tensors = sequence_tensors(p_ids, responses, policy_tok.pad_token_id)
    n = len(prompts)
    return Batch(tensors={**tensors, "scores": torch.tensor([1.0, 0.0] + [0.0] * n)[:n]},
                 meta={"uid": np.array([f"u{i // 2}" for i in range(n)], dtype=object),
                       "request_id": np.array([f"u{i // 2}/{i % 2}" for i in range(n)], dtype=object),
                       "prompt_messages": [[{"role": "user", "content": p}] for p in prompts]})


def test_scoring_rerenders_each_conversation_in_the_reward_models_own_template(tmp_path):
    """Policy: the tiny example's char tokenizer and template; reward model: a GQA Llama with another
    vocabulary (every id differs) and a ChatML template. The scores are those transformers gives
    the conversation rendered by the reward model's template (its tokenizer as AutoTokenizer loads
    it), the response cut at its first end token: never the policy's ids."""
    policy_tok = build_tokenizer()
    rm_tok = other_tokenizer()
    rm_dir = save_rm(tmp_path / "rm", rm_tok)
    config = rl_config(_policy_dir(tmp_path), rm_dir)
    eos = policy_tok.eos_token_id
    enc = lambda text: policy_tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    responses = [enc("#### 46") + [eos], enc("#### 47") + [eos] + enc("99"), enc("#### 5")]  # ends, junk after EOS, cut off
    gen = _generated(policy_tok, ["12+34=", "12+35=", "2+3="], responses)
    assert enc("12+34=") != rm_tok("12+34=", add_special_tokens=False)["input_ids"]  # the vocabularies differ

    group = InProcessWorkerGroup(lambda r, ws: RewardModelWorker(role_spec(config, "reward_model"), r, ws), role="reward_model")
    try:
        out = group.compute_rm_score(gen)
    finally:
        group.shutdown()
    assert list(out.meta["rm_response_text"]) == ["#### 46", "#### 47", "#### 5"]
    theirs = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    own_tok = AutoTokenizer.from_pretrained(rm_dir)
    for i, (prompt, text) in enumerate(zip(["12+34=", "12+35=", "2+3="], out.meta["rm_response_text"])):
        rendered = own_tok.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": text}],
                                               tokenize=False)
        assert rendered.startswith("<|im_start|>user\n") and "<|user|>" not in rendered
        ids = torch.tensor([own_tok(rendered, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            want = theirs(input_ids=ids).logits.item()
        assert out["rm_scores"][i].item() == pytest.approx(want, abs=1e-5)
    assert len(set(out["rm_scores"].tolist())) == 3


def test_the_reward_is_the_models_score_and_nonfinite_scores_are_refused_or_skipped(tmp_path):
    """A reward model that scores every conversation containing '7' NaN (its embedding row is):
    with on_nonfinite=error the step stops naming the sample; with skip the sample is counted,
    out of the update (mask zeroed) and at the batch's mean reward; the others get exactly
    (score - mean) / std of the batch (the first batch: running stats = its own)."""
    rm_tok = other_tokenizer()
    rm_dir = save_rm(tmp_path / "rm", rm_tok)
    weights = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    with torch.no_grad():
        weights.get_input_embeddings().weight[rm_tok.convert_tokens_to_ids("7")] = float("nan")
    weights.save_pretrained(rm_dir)
    policy_tok = build_tokenizer()
    eos = policy_tok.eos_token_id
    enc = lambda text: policy_tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    gen = _generated(policy_tok, ["12+34=", "12+34=", "20+20="], [enc("#### 46") + [eos], enc("#### 47") + [eos], enc("#### 40") + [eos]])
    for mode in ("error", "skip"):
        config = rl_config(_policy_dir(tmp_path), rm_dir, on_nonfinite=mode, clip=None)
        spec = role_spec(config, "reward_model")
        groups = WorkerGroups(reward_model=InProcessWorkerGroup(lambda r, ws, s=spec: RewardModelWorker(s, r, ws), role="reward_model"))
        scoring = RewardModelScoring(config, groups)
        try:
            pending = scoring.launch(gen, Timer())
            if mode == "error":
                with pytest.raises(NonFiniteRewardModelScore, match=r"1 of 3 samples NaN/inf \(first: sample u0/1\).*reward_model.on_nonfinite"):
                    scoring.collect(pending, gen, Timer())
                continue
            scored, metrics = scoring.collect(pending, gen, Timer())
        finally:
            groups.close()
    raw = scored["rm_scores"]
    assert torch.isnan(raw[1]) and torch.isfinite(raw[[0, 2]]).all()
    assert metrics["reward_model/nonfinite"] == 1.0
    finite = raw[[0, 2]].double()
    want = (finite - finite.mean()) / (finite.std(unbiased=False) + 1e-8)
    torch.testing.assert_close(scored["scores"][[0, 2]].double(), want, rtol=1e-5, atol=1e-5)  # the model's score alone
    assert scored["scores"][1].item() == pytest.approx(float(want.mean()), abs=1e-5)
    assert scored["response_mask"][1].sum() == 0 and scored["token_level_scores"][1].abs().sum() == 0
    assert scored["response_mask"][0].sum() > 0 and scored["rule_scores"].tolist() == [1.0, 0.0, 0.0]
    assert scoring.state_dict()["moments"]["count"] == 2.0  # the NaN never entered the running statistics


# ----------------------------------------------------------------------------- bad input
def test_a_folder_that_is_not_a_reward_model_is_refused_naming_the_key(tmp_path):
    policy = _policy_dir(tmp_path)
    torch.manual_seed(0)
    tok = build_tokenizer()
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    config = rl_config(policy, tmp_path / "lm")
    problems = [p for p in preflight_problems(config) if p.startswith("reward_model.path")]
    assert len(problems) == 1 and "is not a reward model" in problems[0] and "LlamaForCausalLM" in problems[0]
    with pytest.raises(NotASequenceClassifier, match=r"reward_model.path: .* is not a reward model"):
        RewardModelWorker(role_spec(config, "reward_model")).setup()


def test_a_reward_model_tokenizer_without_a_chat_template_is_refused_naming_the_key(tmp_path):
    rm_dir = save_rm(tmp_path / "rm", other_tokenizer(chat_template=None))
    config = rl_config(_policy_dir(tmp_path), rm_dir)
    problems = [p for p in preflight_problems(config) if p.startswith("reward_model.path")]
    assert len(problems) == 1 and "no chat template" in problems[0]
    with pytest.raises(RewardModelInputError, match=r"reward_model.path: the tokenizer of .* has no chat template"):
        RewardModelWorker(role_spec(config, "reward_model")).setup()


@pytest.mark.parametrize("overrides, message", [
    ({"reward_model": {"weight": 2.0}}, "reward_model.weight is set but reward_model.path is not"),
    ({"reward_model": {"path": "/rm", "weight": 0.0}}, "reward_model.weight and reward_model.rule_weight are both 0"),
    ({"reward_model": {"path": "/rm"}, "algorithm": {"name": "dpo"}}, "generates nothing to score"),
    ({"reward_model": {"path": "/rm"}, "algorithm": {"adv_estimator": "remax"}}, "ReMax's greedy baseline"),
    ({"reward_model": {"margin": 1.0}}, "reward_model.margin applies to training a reward model"),
    ({"reward_model": {"path": "/rm"}, "algorithm": {"name": "rm"}}, "algorithm.name=rm trains a new one"),
    ({"reward_model": {"clip": 3.0}, "algorithm": {"name": "rm"}}, "reward_model.clip applies to RL runs"),
    ({"reward_model": {"path": "/rm", "world_size": 2}}, "reward_model.world_size=2 needs trainer.backend=ray"),
    ({"registry": {"metric": "pairwise_accuracy"}}, "gates reward models"),
    ({"registry": {"metric": "mean_reward"}, "algorithm": {"name": "rm"}}, "gated on its held-out pairwise accuracy"),
])
def test_reward_model_settings_a_run_would_ignore_are_refused_at_load(overrides, message):
    tree = {"model": {"path": "/m"}, "data": {"train_files": ["t.parquet"]}}
    for section, values in overrides.items():
        tree.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        config_from_dict(tree)
    dumped = config_from_dict({"model": {"path": "/m"}, "data": {"train_files": ["t.parquet"]},
                               "reward_model": {"path": "/rm", "rule_weight": 0.5}}).model_dump(mode="json")
    assert config_from_dict(dumped).reward_model.rule_weight == 0.5  # a dumped config loads again


def test_a_reward_model_whose_tokenizer_json_autotokenizer_reads_otherwise_is_refused_at_start(tmp_path):
    """A Qwen2 reward model folder with a trained char-level tokenizer.json: AutoTokenizer builds
    Qwen2Tokenizer from it (other ids than the file's), so which ids the reward model sees would
    depend on who loads it; the start-up tokenizer check refuses it, naming reward_model.path."""
    from rlcore.data.io import write_rows
    from rlcore.trainer.tokenizer_check import TokenizerMismatchError, check_run_tokenization

    rm_dir = save_rm(tmp_path / "rm", other_tokenizer(), arch="qwen2")
    data = write_rows([{"data_source": "tiny_arith", "prompt": [{"role": "user", "content": "12+34="}],
                        "reward_model": {"ground_truth": "46"}}], tmp_path / "train.jsonl")
    config = config_from_dict({"model": {"path": str(_policy_dir(tmp_path))}, "data": {"train_files": [str(data)]},
                               "rollout": {"backend": "hf"}, "reward_model": {"path": str(rm_dir)}})
    with pytest.raises(TokenizerMismatchError, match=r"reward_model.path: .*tokenizer.json loaded as the file and through AutoTokenizer"):
        check_run_tokenization(config)

