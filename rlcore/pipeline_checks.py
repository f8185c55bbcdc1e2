"""`rlcore pipeline run/serve`'s inputs checked before Prefect starts, each refusal one line naming
the option: the files given, the configs as the flow will load them (the reward model's and the
SFT warm start's too) with no placeholder left in them, and `--ray-address` (its form without the
network; then that a Ray job server answers there)."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from rlcore.config import Config, SFTConfig, load_config, load_sft_config
from rlcore.errors import RLCoreError

# What the shipped configs (rlcore/configs/tiny_*.yaml) hold where a path must be filled in.
PLACEHOLDER = re.compile(r"REPLACE_WITH_[A-Z0-9_]*")
STAGE_FILLED = frozenset({"trainer.output_dir"})  # every training stage writes under the pipeline's work directory
EXAMPLE_FILLED = frozenset({"model.path", "data.train_files", "data.val_files"})  # rlcore.example.overrides


def placeholders(tree: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, placeholder) of every value of a config tree still holding one; a list's items
    are named by the list's key (what an override sets)."""
    if isinstance(tree, dict):
        for name, value in tree.items():
            yield from placeholders(value, f"{key}.{name}" if key else str(name))
    elif isinstance(tree, list):
        for item in tree:
            yield from placeholders(item, key)
    elif isinstance(tree, str) and (found := PLACEHOLDER.search(tree)):
        yield key, found.group()


def check_no_placeholders(config: Config | SFTConfig, option: str, filled: Collection[str]) -> None:
    """A config still holding placeholders is refused before any stage starts, naming each key, unless
    the pipeline fills that key itself (`filled`): it would otherwise fail minutes later in the flow."""
    left = {key: value for key, value in placeholders(config.model_dump(mode="json")) if key not in filled}
    if left:
        listed = ", ".join(f"{key} ({value})" for key, value in left.items())
        raise RLCoreError(f"{option}: still holds placeholder{'s' if len(left) > 1 else ''} {listed}: set "
                          f"{'them' if len(left) > 1 else 'it'} in the file or override (e.g. {next(iter(left))}=...)")


def check_pipeline_inputs(inputs: dict[str, Any], data_path: str | None, data_from_events: bool = False) -> Config:
    """The config and its overrides as the flow will load them, checked before Prefect starts: a
    typo or a placeholder left is one line in well under a second, not a flow-run traceback after
    Prefect's start-up. (The tiny example's model and data paths are not known yet: the flow builds
    it first.) `data_from_events`: every run gets its data file from an event (`pipeline serve`
    without a cron schedule), so `data.train_files` is filled in too."""
    example = EXAMPLE_FILLED if inputs.get("example") else frozenset()
    if data_path is not None and not Path(data_path).is_file():
        raise RLCoreError(f"--data: no such data file: {data_path}")
    sft = inputs.get("sft") or {}
    for flag, key in (("--sft-data", "data_path"), ("--sft-config", "config_path")):
        if sft.get(key) and not Path(sft[key]).is_file():
            raise RLCoreError(f"{flag}: no such file: {sft[key]}")
    extra = [f"data.train_files=[{data_path}]"] if data_path else []  # as pipeline_run.load_pipeline_config
    rm_policy: list[str] = []
    if inputs.get("reward") == "model":
        from rlcore.lifecycle.rm_plan import champion_alias_uri, check_reward_model_config

        rm_config = load_config(inputs["reward_config_path"], inputs["reward_overrides"])
        rm_policy = [f"reward_model.path={champion_alias_uri(rm_config)}"]  # as the flow: trained against its champion
    config = load_config(inputs["config_path"], [*rm_policy, *inputs["overrides"], *extra])
    if rm_policy:
        check_reward_model_config(rm_config, config)
    sft_config = None
    if sft:  # the warm start's config as its stage will load it (rlcore.lifecycle.stages.sft_stage_config)
        sft_data = [f"data.train_files=[{sft['data_path']}]"] if sft.get("data_path") else []
        try:
            sft_config = load_sft_config(sft.get("config_path"),
                                         [f"model.path={config.model.path}", *sft_data, *sft.get("overrides", [])])
        except RLCoreError as err:
            raise RLCoreError(f"--sft-config/--sft-data: {err}") from None
    # then what is left to fill in, once every config is known to load
    check_no_placeholders(config, "--config", STAGE_FILLED | example | ({"data.train_files"} if data_from_events else set()))
    if rm_policy:
        check_no_placeholders(rm_config, "--reward-config", STAGE_FILLED | example)
    if sft_config is not None:  # its model.path is the RL config's (checked above)
        check_no_placeholders(sft_config, "--sft-config/--sft-data", STAGE_FILLED | example)
    return config


def ray_address(address: str) -> str:
    """--ray-address as a job server URL, checked without the network (milliseconds): an empty,
    malformed or non-HTTP address is one line naming the option, its secrets redacted."""
    from rlcore.lifecycle.job_server import JobServerAddressError, job_server_url

    try:
        return job_server_url(address)
    except JobServerAddressError as err:
        raise RLCoreError(f"--ray-address {err}") from None


def check_job_server(address: str) -> None:
    """--ray-address answers as a Ray job server, before Prefect starts (a typo is one line): each
    network step within rlcore.lifecycle.job_server.TIMEOUT_S, the address shown redacted."""
    from rlcore.lifecycle.job_server import JobServerAddressError, JobServerUnreachable, connect

    try:
        connect(address)
    except JobServerAddressError as err:
        raise RLCoreError(f"--ray-address {err}") from None
    except JobServerUnreachable as err:
        raise RLCoreError(f"--ray-address {err}; the job server is the head node's dashboard (`ray start --head "
                          "--dashboard-host ...`, port 8265)") from None
