"""Held-out evaluation of a model folder: accuracy, mean reward, KL to a reference model and
response length, computed the same way for a candidate and for the champion.

Decoding is greedy (deterministic: two evaluations of one model agree exactly) through the same
rollout engine, prompt rendering, end tokens and reward functions as training, so an evaluation number means
what the training curves mean; an agent run's model is evaluated with its tools (or interaction)
through the same agent loop, and scored on the whole trajectory as in training. KL is exact per token: the full next-token distributions of the
evaluated model and the reference, compared along the evaluated model's own responses, averaged
over response tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rlcore.config import AgentConfig, role_spec
from rlcore.data import PromptLoader, RLDataset
from rlcore.protocol import Batch
from rlcore.rewards import RewardScorer, ScoreItem
from rlcore.rewards.registry import load_function
from rlcore.rewards.tools import ToolPool, tool_schemas
from rlcore.rollout import HFRolloutEngine, SamplingParams
from rlcore.rollout.agent import AgentLoop, AgentSettings
from rlcore.tracking import progress
from rlcore.workers.reward import final_answer, trajectory_info
from rlcore.workers.reward_model import RewardModelReader
from rlcore.workers.tokenizer import cut_at_end, end_token_ids, load_tokenizer, pad_token_id


@dataclass
class EvalResult:
    model_dir: str
    accuracy: float
    mean_reward: float
    kl_to_reference: float  # mean per-token KL(model || reference) on the model's responses
    response_length: float  # mean response tokens (EOS included)
    num_prompts: int
    reward_model_score: float | None = None  # mean raw score of the responses by a reward model, when given one

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items() if k != "model_dir" and v is not None}


def _load_lm(path: str | Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32, local_files_only=True).eval()


@torch.no_grad()
def response_token_kl(model, reference, gen: Batch, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact KL(model || reference) of the next-token distributions at each response position:
    ([N, R] per-token KL, [N, R] mask). Rows are processed in chunks to bound the logits' memory."""
    response_len = gen["responses"].shape[1]
    mask = gen["response_mask"].float()
    out = torch.zeros(mask.shape, dtype=torch.float32)
    for start in range(0, len(gen), chunk):
        sl = slice(start, start + chunk)
        kwargs = dict(input_ids=gen["input_ids"][sl], attention_mask=gen["attention_mask"][sl],
                      position_ids=gen["position_ids"][sl], use_cache=False)
        lp = F.log_softmax(model(**kwargs).logits[:, -response_len - 1 : -1].float(), dim=-1)
        lq = F.log_softmax(reference(**kwargs).logits[:, -response_len - 1 : -1].float(), dim=-1)
        out[sl] = (lp.exp() * (lp - lq)).sum(-1).clamp(min=0.0)
    return out * mask, mask


@torch.no_grad()
def evaluate_model(
    model_dir: str | Path,
    val_file: str | Path,
    reference_dir: str | Path | None = None,
    *,
    max_prompt_length: int = 64,
    max_new_tokens: int = 32,
    batch_size: int = 256,
    reward_function: str | None = None,
    apply_chat_template: bool = True,
    limit: int | None = None,
    label: str | None = None,
    agent: AgentConfig | None = None,
    reward_model: RewardModelReader | None = None,
) -> EvalResult:
    """Greedy evaluation of `model_dir` on `val_file` (the first `limit` prompts, if given), with
    a progress bar over prompts named by `label` (default: the folder's last two parts).

    `reference_dir`: the model KL is measured against (None: KL is not measured, reported 0).
    `agent`: the run's `rollout.agent`; when on, responses are agent trajectories (tools in a
    sandboxed pool), KL and length are over the model's own tokens.
    `reward_model`: a loaded reward model (`open_reward_model`) that also scores each (prompt,
    response) conversation as in RL (`reward_model_score`: the mean raw score; not for agent runs).
    """
    model_dir = str(Path(model_dir).resolve())
    tokenizer = load_tokenizer(model_dir)
    agent = agent if agent is not None and agent.enabled else None
    tools = (tool_schemas(agent.tools) or None) if agent is not None else None
    dataset = RLDataset([val_file], tokenizer, max_prompt_length=max_prompt_length,
                        apply_chat_template=apply_chat_template, on_bad_row="skip", tools=tools)
    if limit is not None:
        dataset.items = dataset.items[:limit]
    loader = PromptLoader(dataset, batch_size=min(batch_size, len(dataset)), seed=0, shuffle=False, drop_last=False)
    end_ids = end_token_ids(model_dir)  # every end token it declares, as in training and in vLLM
    engine = HFRolloutEngine.from_pretrained(model_dir, pad_token_id=pad_token_id(model_dir), eos_token_ids=end_ids)
    reference = _load_lm(reference_dir) if reference_dir is not None else None
    params = SamplingParams(n=1, do_sample=False, max_new_tokens=max_new_tokens, seed=0)
    scores: list[float] = []
    accs: list[float] = []
    rm_scores: list[float] = []
    kl_sum = tokens = 0.0
    label = label or "/".join(Path(model_dir).parts[-2:])
    pool = ToolPool(agent.tools, num_workers=agent.tool_workers, timeout_s=agent.tool_timeout_s, memory_mb=agent.tool_memory_mb,
                    max_chars=agent.tool_max_chars) if agent is not None and agent.tools else None
    loop = None
    if agent is not None:
        interaction = load_function(agent.interaction, "interaction") if agent.interaction else None
        loop = AgentLoop(engine, tokenizer, end_ids, AgentSettings(agent.max_turns, agent.max_total_tokens), pool, interaction)
    with pool if pool is not None else contextlib.nullcontext(), RewardScorer(reward_function, num_workers=0) as scorer, \
            progress(len(dataset), f"evaluate {label}", unit="prompts") as bar:
        for batch in loader.epoch_batches():
            gen = loop.generate(batch, params) if loop is not None else engine.generate(batch, params)
            lengths = gen["response_mask"].sum(-1).long().tolist()
            extra_info = list(gen.meta["extra_info"])
            if loop is not None:  # scored as in training: the final answer, the trajectory in extra_info
                texts = [final_answer(m) for m in gen.meta["agent_messages"]]
                extra_info = [trajectory_info(gen.meta, i, ei) for i, ei in enumerate(extra_info)]
            else:
                texts = [tokenizer.decode(cut_at_end(row[:n].tolist(), end_ids), skip_special_tokens=True)
                         for row, n in zip(gen["responses"], lengths)]
            items = [ScoreItem(str(ds), text, str(gt), ei if isinstance(ei, dict) else None)
                     for ds, text, gt, ei in zip(gen.meta["data_source"], texts, gen.meta["ground_truth"], extra_info)]
            result = scorer.score(items)
            scores.extend(result.scores.tolist())
            if reward_model is not None and loop is None:
                enc = reward_model.encode(list(gen.meta["prompt_messages"]), texts)
                rm_scores.extend(reward_model.scores(enc).tolist())
            batch_acc = result.extra["acc"] if "acc" in result.extra else (result.scores >= 1.0)
            accs.extend(float(a) for a in batch_acc)
            tokens += float(sum(lengths))
            if reference is not None:
                kl, mask = response_token_kl(engine.model, reference, gen)
                kl_sum += float(kl.sum())
            bar.update(len(lengths))
    n = len(scores)
    return EvalResult(
        model_dir=model_dir,
        accuracy=sum(accs) / n,
        mean_reward=sum(scores) / n,
        kl_to_reference=kl_sum / tokens if tokens else 0.0,
        response_length=tokens / n,
        num_prompts=n,
        reward_model_score=sum(rm_scores) / len(rm_scores) if rm_scores else None,
    )


@torch.no_grad()
def evaluate_reward_model(model_dir: str | Path, pair_files: list[str], config: Any, batch_size: int = 256) -> dict[str, float]:
    """Held-out numbers of the reward model in `model_dir` on the pairwise rows of `pair_files`,
    read as in training and RL (its own template, `config.reward_model`'s limits and margin): what
    the reward-model gate compares (`pairwise_accuracy`), plus loss, score gap and the pair count,
    computed by the same function as training's `val/*` (`held_out_pair_metrics`)."""
    from rlcore.data.preference import PreferenceDataset, collate_rm_pairs
    from rlcore.workers.reward_model import held_out_pair_metrics, open_reward_model

    reader = open_reward_model(model_dir, key="reward_model.path", spec=role_spec(config, "reward_model"), device=torch.device("cpu"))
    limit = config.reward_model.max_length
    dataset = PreferenceDataset(pair_files, reader.tokenizer, kind="pairwise", max_prompt_length=limit,
                                max_response_length=limit, apply_chat_template=config.data.apply_chat_template,
                                on_bad_row="skip")

    def batches() -> Iterator[Batch]:
        for start in range(0, len(dataset), batch_size):
            items = [dataset[i] for i in range(start, min(len(dataset), start + batch_size))]
            yield collate_rm_pairs(items, [str(it.index) for it in items])

    out = held_out_pair_metrics(batches(), reader.pair_scores, config.reward_model.margin)
    return {"pairwise_accuracy": out["pairwise_acc"], "rm_loss": out["rm_loss"], "score_margin": out["score_margin"],
            "num_pairs": out["num_pairs"]}
