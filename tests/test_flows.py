"""The flows load by entrypoint path exactly as prefect.yaml names them (re-exports of the
installed package's rlcore.flows), and the served deployment carries the cron schedule and the
data-event trigger."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import prefect_env  # tests/ is on sys.path (pytest rootdir conftest)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # importing Prefect, MLflow and torch takes a few seconds


@pytest.fixture(autouse=True)
def _isolated_prefect(tmp_path, monkeypatch):
    for key, value in prefect_env(tmp_path / "prefect").items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)


def test_prefect_yaml_entrypoints_load_as_flows():
    from prefect.flows import Flow, load_flow_from_entrypoint

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    entrypoints = [d["entrypoint"] for d in spec["deployments"]]
    assert "flows/rl_pipeline.py:rl_pipeline" in entrypoints
    for ep in entrypoints:
        path, name = ep.split(":")
        flow = load_flow_from_entrypoint(f"{ROOT / path}:{name}", use_placeholder_flow=False)
        assert isinstance(flow, Flow) and flow.name == name
        assert flow.fn.__module__ == f"rlcore.flows.{name}"  # the package's flow, not a copy
    main = next(d for d in spec["deployments"] if d["name"] == "rl-pipeline")
    assert main["schedules"][0]["cron"] == "0 3 * * *"
    trigger = main["triggers"][0]
    assert trigger["expect"] == ["rlcore.data.arrived"] and trigger["parameters"]["data_path"] == "{{ event.payload.path }}"


def test_rl_pipeline_parameters_and_task_policies():
    from rlcore.cli import load_flow

    flow = load_flow()
    params = flow.parameters.properties
    assert {"config_path", "overrides", "data_path", "example", "workdir", "ray_address"} <= set(params)
    assert params["ray_address"]["default"] is None  # without it every stage runs in the flow's process
    assert params["retries"]["default"] is None  # the tasks' own (rlcore.lifecycle.retry), unless --retries N
    from rlcore.flows.data_prep import prepare_data_task
    from rlcore.flows.train import train_task

    assert train_task.retries >= 1 and train_task.timeout_seconds
    assert prepare_data_task.cache_key_fn is not None


def test_deployment_has_cron_and_data_trigger():
    from rlcore.cli import load_flow
    from rlcore.flows.serve import build_deployment

    dep = build_deployment(load_flow(), {"example": True}, cron="*/30 * * * *")
    assert dep.name == "rl-pipeline"
    assert dep.entrypoint == "rlcore.flows.rl_pipeline.rl_pipeline"  # imported from the package, any working directory
    assert [s.schedule.cron for s in dep.schedules] == ["*/30 * * * *"]
    [trigger] = dep.triggers
    assert trigger.expect == {"rlcore.data.arrived"}
    assert trigger.parameters == {"data_path": "{{ event.payload.path }}"}
    assert dep.parameters == {"example": True}
    assert dep.concurrency_limit is None  # no limit unless `pipeline serve --concurrency-limit N`
    limited = build_deployment(load_flow(), {"example": True}, cron=None, concurrency_limit=2)
    assert limited.concurrency_limit == 2 and limited.concurrency_options is None  # Prefect's default: ENQUEUE
