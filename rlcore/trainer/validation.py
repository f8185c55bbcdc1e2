"""Validation of an RL policy on held-out prompts: accuracy and reward, and with `rollout.val_n`
> 1 the sampled-validation numbers verl reports, overall and per `data_source`:

- mean@n: the mean accuracy over the n samples of a prompt (then over prompts),
- pass@n: whether any of the n samples is right,
- maj@n: whether the most frequent answer among the n samples is right (answers compared as
  their stripped response text; ties go to the answer seen first).

An agent run (`rollout.agent`) validates through the agent loop, as it trains (the rollout worker
generates every batch with it), and reports what its episodes did, overall (`val/agent/...`) and
per data source (`val/<source>/agent/...`): turns_mean, tool_calls_mean, tool_call_rate,
tool_error_rate, answer_has_tool_result (`rlcore.trainer.metrics.episode_means`), greedy
or sampled as validation samples.

With `trainer.trace`, every validation sample is recorded (`samples`, written to val_trace.jsonl,
beside trace.jsonl, as a `"validation": true` record of the step): its data source, reward, accuracy and, for an agent,
its episode's facts (`episode_facts`), from which `agent_numbers` recomputes every `val/agent/*`
number; `trainer.trace_samples` of them keep their conversation, as in training.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import torch

from rlcore.config import Config
from rlcore.data import PromptLoader
from rlcore.trainer.groups import WorkerGroups
from rlcore.trainer.metrics import Timer, episode_facts, episode_means
from rlcore.trainer.rl_steps import score
from rlcore.trainer.rollout_parts import generate, val_sampling
from rlcore.trainer.tracing import sample_records


def sampled_validation_metrics(uids: list[str], sources: list[str], answers: list[str], acc: list[float],
                               n: int) -> dict[str, float]:
    """mean@n, pass@n and maj@n over prompts (samples of a prompt share its uid), overall and per
    data source (`val/<source>/...`)."""
    by_prompt: dict[str, list[tuple[str, float]]] = defaultdict(list)
    source_of: dict[str, str] = {}
    for uid, source, answer, a in zip(uids, sources, answers, acc):
        by_prompt[uid].append((answer.strip(), a))
        source_of[uid] = source
    per_prompt: dict[str, dict[str, float]] = {}
    for uid, samples in by_prompt.items():
        votes = Counter(answer for answer, _ in samples)
        top = max(votes.values())
        majority = next(answer for answer, _ in samples if votes[answer] == top)  # first of the most voted
        per_prompt[uid] = {
            f"mean@{n}": sum(a for _, a in samples) / len(samples),
            f"pass@{n}": float(any(a > 0.5 for _, a in samples)),
            f"maj@{n}": next(a for answer, a in samples if answer == majority),
        }
    out: dict[str, float] = {}
    groups: dict[str, list[str]] = {"": list(per_prompt)}
    for uid in per_prompt:
        groups.setdefault(f"{source_of[uid]}/", []).append(uid)
    for prefix, members in groups.items():
        for key in (f"mean@{n}", f"pass@{n}", f"maj@{n}"):
            out[f"val/{prefix}{key}"] = sum(per_prompt[u][key] for u in members) / len(members)
    return out


class RLValidator:
    """Generates on the validation prompts with the validation sampling settings and scores them;
    the engine is not put to sleep (validation runs right after a weight sync)."""

    def __init__(self, config: Config, loader: PromptLoader) -> None:
        self.config = config
        self.loader = loader
        self.samples: list[dict[str, Any]] = []  # the last run's per-sample records (with trainer.trace)

    def run(self, groups: WorkerGroups, step: int, policy_version: int) -> dict[str, float]:
        timer = Timer()
        scores: list[torch.Tensor] = []
        accs: list[torch.Tensor] = []
        uids: list[str] = []
        sources: list[str] = []
        answers: list[str] = []
        agent: dict[str, list[Any]] = {k: [] for k in AGENT_META}
        self.samples = []
        for prompts in self.loader.epoch_batches():
            sampling = val_sampling(self.config, step)
            gen = generate(groups, prompts, sampling, policy_version, timer)
            gen, _ = score(groups, gen, timer, self.config.reward)
            if self.config.trainer.trace:
                self.samples += sample_records(gen, groups, sampling.n, trained=False)
            if AGENT_META[0] in gen.meta:
                for key in AGENT_META:
                    agent[key].extend(gen.meta[key])
            scores.append(gen.tensors["scores"])
            accs.append(gen.tensors["acc"])
            uids.extend(str(u) for u in gen.meta["uid"])
            sources.extend(str(s) for s in gen.meta["data_source"])
            answers.extend(str(t) for t in gen.meta["response_text"])
        acc = torch.cat(accs)
        out: dict[str, Any] = {"val/reward": float(torch.cat(scores).mean()), "val/acc": float(acc.mean()),
                               "time/validate_s": sum(timer.seconds.values())}
        for source in sorted(set(sources)):
            picked = torch.tensor([s == source for s in sources])
            out[f"val/{source}/acc"] = float(acc[picked].mean())
        n = self.config.rollout.val_n
        if n > 1:
            out.update(sampled_validation_metrics(uids, sources, answers, acc.tolist(), n))
        if agent[AGENT_META[0]]:
            out.update(agent_validation_metrics(agent, sources))
        return out


AGENT_META = ("agent_turns", "agent_tool_calls", "agent_tool_errors", "agent_trace")  # what the agent numbers read


def agent_validation_metrics(meta: dict[str, list[Any]], sources: list[str]) -> dict[str, float]:
    """`val/agent/<name>` over every validation sample and `val/<source>/agent/<name>` per data
    source, of the agent loop's `agent_*` meta."""
    return agent_numbers([episode_facts(meta, i) for i in range(len(sources))], sources)


def agent_numbers(facts: list[dict[str, Any]], sources: list[str]) -> dict[str, float]:
    """`val/agent/<name>` over every episode and `val/<source>/agent/<name>` per data source
    (`episode_means` of `episode_facts`): what validation logs, and what val_trace.jsonl's
    record recomputes it from (`recorded_agent_numbers`)."""
    out = {f"val/agent/{k}": v for k, v in episode_means(facts).items()}
    for source in sorted(set(sources)):
        mine = [f for f, s in zip(facts, sources) if s == source]
        out.update({f"val/{source}/agent/{k}": v for k, v in episode_means(mine).items()})
    return out


def recorded_agent_numbers(record: dict[str, Any]) -> dict[str, float]:
    """Every `val/agent/*` number of a validation, recomputed from its val_trace.jsonl record (one
    entry per validation sample, each with its data source and episode facts)."""
    samples = record["samples"]
    return agent_numbers([s["episode"] for s in samples], [str(s["data_source"]) for s in samples])


__all__ = ["RLValidator", "agent_numbers", "agent_validation_metrics", "recorded_agent_numbers", "sampled_validation_metrics"]
