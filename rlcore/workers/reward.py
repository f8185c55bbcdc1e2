"""Reward worker: decode responses, score them in parallel under timeouts, place token rewards.

A response is decoded up to its first end token (any the model declares, see
`rlcore.workers.tokenizer`), so a scorer sees what the model said, never what follows an end token
(rollouts stop there; a response from elsewhere may run on).

An agent trajectory (`rlcore.rollout.agent`) is scored as a whole: `solution_str` is its final
assistant turn (the answer given after the last tool result), and `extra_info` carries the rest
beside the row's own fields: `messages` (the whole conversation: prompt, assistant turns with their
parsed `tool_calls`, tool results, interaction replies), `num_turns`, `num_tool_calls`,
`num_tool_errors`, `finish_reason` and, when an interaction gave one, `interaction_reward`. verl's
`compute_score(data_source, solution_str, ground_truth, extra_info)` signature is unchanged."""

from __future__ import annotations

import numpy as np
import torch

from rlcore.config import RewardConfig, RoleSpec, require_spec
from rlcore.controller import Dispatch, Worker, register
from rlcore.protocol import Batch
from rlcore.rewards import RewardScorer, ScoreItem, scores_to_token_rewards
from rlcore.workers.tokenizer import cut_at_end, end_token_ids, load_tokenizer


class RewardWorker(Worker):
    def __init__(self, spec: RoleSpec[RewardConfig], rank: int = 0, world_size: int = 1) -> None:
        super().__init__(rank=rank, world_size=world_size, role="reward")
        self.spec: RoleSpec[RewardConfig] = require_spec(spec, "reward")

    def setup(self) -> None:
        cfg = self.spec.section
        self.tokenizer = load_tokenizer(self.spec.model.path)  # the policy's: what the responses are in
        self.end_ids = end_token_ids(self.spec.model.path)
        self.scorer = RewardScorer(cfg.function, num_workers=cfg.num_workers, timeout_s=cfg.timeout_s,
                                   error_score=cfg.error_score, clip=cfg.clip)

    def decode_responses(self, batch: Batch) -> list[str]:
        if "agent_messages" in batch.meta:
            return [final_answer(messages) for messages in batch.meta["agent_messages"]]
        responses = batch["responses"]
        lengths = batch["response_mask"].sum(-1).long().tolist()
        return [self.tokenizer.decode(cut_at_end(row[:n].tolist(), self.end_ids), skip_special_tokens=True)
                for row, n in zip(responses, lengths)]

    @register(dispatch=Dispatch.RANK_ZERO)
    def compute_reward(self, batch: Batch) -> tuple[Batch, dict[str, float | str]]:
        """Each sample's score, by `reward.function`; the call's metrics: failed, timed-out and
        clipped calls, and the first error's text (`reward/first_error`) when a call failed."""
        texts = self.decode_responses(batch)
        extra_info = batch.meta.get("extra_info", np.array([None] * len(batch), dtype=object))
        if "agent_messages" in batch.meta:
            extra_info = [trajectory_info(batch.meta, i, ei) for i, ei in enumerate(extra_info)]
        items = [
            ScoreItem(data_source=str(ds), solution_str=text, ground_truth=str(gt), extra_info=ei if isinstance(ei, dict) else None)
            for ds, text, gt, ei in zip(batch.meta["data_source"], texts, batch.meta["ground_truth"], extra_info)
        ]
        result = self.scorer.score(items)
        scores = torch.as_tensor(result.scores, dtype=torch.float32)
        acc = torch.as_tensor(result.extra["acc"], dtype=torch.float32) if "acc" in result.extra else (scores >= 1.0).float()
        out = Batch(
            tensors={
                "token_level_scores": scores_to_token_rewards(scores, batch["response_mask"]),
                "scores": scores,
                "acc": acc,
            },
            meta={"response_text": np.array(texts, dtype=object)},
        )
        metrics: dict[str, float | str] = {
            "reward/errors": float(result.n_errors),
            "reward/timeouts": float(result.n_timeouts),
            "reward/clipped": float(result.n_clipped),  # beyond ±reward.clip (see RewardScorer)
        }
        if result.first_error:
            metrics["reward/first_error"] = result.first_error
        return out, metrics

    def shutdown(self) -> None:
        self.scorer.close()


def final_answer(messages: list[dict]) -> str:
    """The content of a trajectory's last assistant turn ("" if it has none)."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            return str(m.get("content", ""))
    return ""


def trajectory_info(meta: dict[str, np.ndarray], i: int, extra_info: object) -> dict:
    """Sample i's `extra_info`, with its agent trajectory added (module docstring)."""
    info = dict(extra_info) if isinstance(extra_info, dict) else {}
    info.update(messages=list(meta["agent_messages"][i]), num_turns=int(meta["agent_turns"][i]),
                num_tool_calls=int(meta["agent_tool_calls"][i]), num_tool_errors=int(meta["agent_tool_errors"][i]),
                finish_reason=str(meta["agent_finish"][i]))
    reward = float(meta["agent_reward"][i])
    if not np.isnan(reward):
        info["interaction_reward"] = reward
    return info
