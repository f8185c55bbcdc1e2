"""What a step reports: phase timings (and peak device memory), per-rank worker metrics averaged,
and the numbers an operator watches on an RL batch (reward, lengths, advantages, KL, staleness)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from rlcore.algos import kl_penalty, masked_mean
from rlcore.protocol import Batch


class Timer:
    """Seconds per phase and, where this process drives a GPU, its peak allocated memory.

    Peak memory (`torch.cuda.max_memory_allocated`, reset at each phase start) is measured only
    when CUDA is already initialised here: the in-process backend on a GPU. A Ray controller
    never touches CUDA, so it neither measures nor creates a context by asking.
    """

    def __init__(self, device_memory: bool | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.peak_gib: dict[str, float] = {}
        if device_memory is None:
            device_memory = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        self.device_memory = device_memory

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.device_memory:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        yield
        if self.device_memory:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30
            self.peak_gib[name] = max(self.peak_gib.get(name, 0.0), peak)
        self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` to phase `name`: time measured elsewhere (a wait that ends on another
        thread, say), reported as `time/<name>_s` like a `phase`."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def metrics(self) -> dict[str, float]:
        """`time/<phase>_s` and `memory/<phase>_peak_gib`."""
        out = {f"time/{name}_s": secs for name, secs in self.seconds.items()}
        out.update({f"memory/{name}_peak_gib": peak for name, peak in self.peak_gib.items()})
        return out


def mean_over_ranks(per_rank: dict[str, float] | list[dict[str, float]]) -> dict[str, float]:
    """Worker groups may return one metrics dict per rank: average them."""
    if isinstance(per_rank, dict):
        return per_rank
    keys = per_rank[0].keys()
    return {k: float(np.mean([m[k] for m in per_rank])) for k in keys}


def rl_batch_metrics(gen: Batch, timer: Timer, *, step: int, max_new_tokens: int) -> dict[str, float]:
    """Reward, accuracy, lengths, advantages, entropy, KL to the reference, rollout/actor log-prob
    gap, staleness and phase times of one RL step's scored samples."""
    mask = gen.tensors["response_mask"].float()
    valid = mask.bool()
    lengths = mask.sum(-1)
    scores = gen.tensors["scores"]
    m: dict[str, float] = {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "acc/mean": float(gen.tensors["acc"].mean()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_frac": float((lengths >= max_new_tokens).float().mean()),
    }
    if "advantages" in gen:
        adv = gen.tensors["advantages"]
        m["advantages/mean"] = float(masked_mean(adv, mask))
        m["advantages/max"] = float(adv[valid].max()) if valid.any() else 0.0
        m["advantages/min"] = float(adv[valid].min()) if valid.any() else 0.0
    if "entropy" in gen:
        m["actor/entropy"] = float(masked_mean(gen.tensors["entropy"], mask))
    if "ref_log_probs" in gen:
        kl = kl_penalty(gen.tensors["old_log_probs"], gen.tensors["ref_log_probs"], "k3")
        m["actor/kl"] = float(masked_mean(kl, mask))
        per_sequence = (kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # the health guard's KL spread
        m["actor/kl_std"] = float(per_sequence.std()) if len(per_sequence) > 1 else 0.0
    if "rollout_log_probs" in gen and "old_log_probs" in gen:
        diff = (gen.tensors["rollout_log_probs"] - gen.tensors["old_log_probs"]).abs()[valid]
        m["rollout/logprob_diff_mean"] = float(diff.mean()) if diff.numel() else 0.0
        m["rollout/logprob_diff_max"] = float(diff.max()) if diff.numel() else 0.0
    if "policy_version" in gen.meta:  # the actor trains on the weights after step-1 updates
        staleness = (step - 1) - gen.meta["policy_version"].astype(np.int64)
        m["rollout/staleness_max"] = float(staleness.max())
        m["rollout/staleness_mean"] = float(staleness.mean())
    if "agent_turns" in gen.meta:
        m.update(agent_metrics(gen))
    m.update(timer.metrics())  # tokens/s and MFU per phase: rlcore.trainer.throughput
    return m


def agent_metrics(gen: Batch) -> dict[str, float]:
    """Multi-turn rollouts (`rlcore.rollout.agent`): turns and tool calls per sample, failed and
    timed-out calls, the share of response tokens masked out of the loss (tool outputs and
    template tokens), tool latency, and how episodes ended (`agent/finish/<reason>`, shares; a
    trajectory a token limit ended counts in `response_length/clip_frac`)."""
    meta = gen.meta
    calls = float(meta["agent_tool_calls"].sum())
    errors = float(meta["agent_tool_errors"].sum())
    episodes = agent_episode_metrics(meta)
    prompt_len = gen.tensors["prompts"].shape[1]
    attended = float(gen.tensors["attention_mask"][:, prompt_len:].float().sum())
    trained = float(gen.tensors["response_mask"].float().sum())
    latencies = [t["latency_s"] for trace in meta["agent_trace"] for t in trace if t.get("kind") == "tool"]
    m = {
        **{f"agent/{k}": v for k, v in episodes.items()},
        "agent/turns_max": float(meta["agent_turns"].max()),
        "agent/tool_calls": calls,
        "agent/tool_errors": errors,
        "agent/tool_timeouts": float(meta["agent_tool_timeouts"].sum()),
        "agent/interaction_errors": float(meta["agent_interaction_errors"].sum()),
        "agent/masked_token_frac": 1.0 - trained / attended if attended else 0.0,
        "agent/tool_latency_mean_s": float(np.mean(latencies)) if latencies else 0.0,
    }
    reasons, counts = np.unique(meta["agent_finish"].astype(str), return_counts=True)
    m.update({f"agent/finish/{r}": float(c) / len(gen) for r, c in zip(reasons, counts)})
    # a trajectory is clipped when a token limit ended it (its model tokens may exceed one turn's limit)
    m["response_length/clip_frac"] = float(np.isin(meta["agent_finish"].astype(str), ["max_new_tokens", "max_total_tokens"]).mean())
    return m


def answer_uses_tool_result(trace: Sequence[Mapping[str, Any]]) -> bool | None:
    """Whether an agent trajectory's final answer (its last assistant turn's text) contains the last
    result a tool returned without error (stripped); None when no tool returned one. A substring
    test: a cheap sign that the model read its tool (the stall a warm start that ignores results gives)."""
    results = [str(t.get("result", "")).strip() for t in trace if t.get("kind") == "tool" and t.get("ok")]
    answers = [str(t.get("text", "")) for t in trace if t.get("kind") == "assistant"]
    if not results or not results[-1] or not answers:
        return None
    return results[-1] in answers[-1]


def episode_facts(meta: Mapping[str, Any], i: int) -> dict[str, Any]:
    """What sample `i`'s agent episode did (from the agent loop's `agent_*` meta): its assistant
    turns, tool calls, failed calls, and whether its final answer holds the last tool result
    (`answer_uses_tool_result`; None when no tool answered). trace.jsonl records these per sample,
    so `episode_means` recomputes the logged numbers from it."""
    return {"turns": int(meta["agent_turns"][i]), "tool_calls": int(meta["agent_tool_calls"][i]),
            "tool_errors": int(meta["agent_tool_errors"][i]),
            "answer_has_tool_result": answer_uses_tool_result(meta["agent_trace"][i])}


def episode_means(facts: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The one formula training (`agent/...`) and validation (`val/agent/...`, per data source too)
    report over episodes (`episode_facts`): turns_mean, tool_calls_mean (calls per sample),
    tool_call_rate (samples with a call), tool_error_rate (failed calls per call: raised, timed
    out, unreadable, unknown tool), answer_has_tool_result (of the samples a tool answered, those
    whose final answer contains the last result; absent when none was answered)."""
    turns = np.array([f["turns"] for f in facts], dtype=np.float64)
    calls = np.array([f["tool_calls"] for f in facts], dtype=np.float64)
    errors = np.array([f["tool_errors"] for f in facts], dtype=np.float64)
    m = {"turns_mean": float(turns.mean()), "tool_calls_mean": float(calls.mean()),
         "tool_call_rate": float((calls > 0).mean()),
         "tool_error_rate": float(errors.sum() / calls.sum()) if calls.sum() else 0.0}
    answered = [f["answer_has_tool_result"] for f in facts if f["answer_has_tool_result"] is not None]
    if answered:
        m["answer_has_tool_result"] = float(np.mean(answered))
    return m


def agent_episode_metrics(meta: Mapping[str, Any], rows: Sequence[int] | None = None) -> dict[str, float]:
    """`episode_means` of the episodes of `rows` (default all)."""
    idx = range(len(meta["agent_turns"])) if rows is None else rows
    return episode_means([episode_facts(meta, int(i)) for i in idx])


__all__ = ["Timer", "agent_episode_metrics", "agent_metrics", "answer_uses_tool_result", "episode_facts", "episode_means",
           "mean_over_ranks", "rl_batch_metrics"]
