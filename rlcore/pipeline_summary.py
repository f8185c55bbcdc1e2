"""The summary `rlcore pipeline run` prints: what the run trained from, what it measured and
registered, and where to look next (the lifecycle's `Summary`, made by
`rlcore.lifecycle.stages.summarize`), as aligned lines for a person."""

from __future__ import annotations


def format_summary(summary: dict) -> str:
    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    if summary.get("warm_start"):
        start = (f"the champion {summary['warm_start']}, at {pct(summary['warm_start_accuracy'])} accuracy "
                 "(warm start: registry.warm_start)")
    else:
        start = "the SFT model" if summary.get("sft_model") else "the base model"
    lines = [
        "",
        f"rlcore pipeline run {summary['pipeline_run']}",
        f"  data             fingerprint {summary['dataset_fingerprint'][:16]}",
        f"  trained from     {start} ({summary['steps']} steps)",
    ]
    if summary.get("sft_model"):
        lines.append(f"  SFT warm start   {summary['sft_model']} (the base model and KL reference of this run)")
    if summary.get("health_stop"):
        lines.append(f"  health stop      {summary['health_stop']}")
    if "reward_model" in summary:
        if summary.get("reward_model_version") is not None:
            verdict = "champion" if summary["reward_model_champion"] else "challenger"
            lines.append(f"  reward model     version {summary['reward_model_version']} ({verdict}; held-out pairwise "
                         f"accuracy {pct(summary['reward_model_pairwise_accuracy'])}): {summary['reward_model_reason']}")
        lines.append(f"  trained against  {summary['reward_model']}")
    if summary.get("accuracy_start") is None:  # training started from the baseline
        lines.append(f"  accuracy         before {pct(summary['accuracy_before'])} ({summary['baseline'] or 'n/a'}) -> "
                     f"after {pct(summary['accuracy_after'])}")
    else:  # trained from the base (or SFT) model while a champion exists: both numbers
        lines.append(f"  accuracy (rule)  before {pct(summary['accuracy_start'])} (where training started) -> after "
                     f"{pct(summary['accuracy_after'])}; the champion has {pct(summary['accuracy_before'])}")
    if summary.get("reward_model_score_after") is not None:
        before = summary.get("reward_model_score_start")
        lines.append(f"  RM score         of the greedy answers: before {'n/a' if before is None else f'{before:.3f}'} -> "
                     f"after {summary['reward_model_score_after']:.3f} (what RLHF optimised)")
    if summary.get("version") is not None:
        verdict = "yes: now the champion" if summary["champion"] else "no: challenger"
        lines += [f"  registered       version {summary['version']} ({summary['model_uri']})",
                  f"  champion         {verdict}",
                  f"  why              {summary['reason']}"]
    else:
        lines.append(f"  registered       nothing ({summary['reason']})")
    links = summary.get("links") or {}
    lines.append(f"  run directory    {summary['run_dir']}")
    for key, label in (("mlflow_run", "MLflow run"), ("model_version", "model version"), ("prefect_flow_run", "Prefect run")):
        if links.get(key):
            lines.append(f"  {label:<16} {links[key]}")
    lines += [
        f"  open the UIs     {summary['mlflow_ui']}",
        f"                   {summary['prefect_ui']}",
    ]
    return "\n".join(lines)
