"""MLflow side of the lifecycle on a real SQLite store: the registry round trip (version from a
run's artifact folder, aliases, `models:/name@champion` loaded by transformers), training records
(params, files, plots; datasets with rlcore's fingerprint as digest), the experiment's UI kind,
and the train stage (steps logged live into its one run, kept across a retry) stopping on a
health breach with the last healthy checkpoint as the candidate."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

QUICK = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "data.val_batch_size=64",
         "trainer.val_before_train=false"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from rlcore.lifecycle.mlflow_store import MlflowStore

    root = tmp_path_factory.mktemp("mlflow")
    return MlflowStore(f"sqlite:///{root / 'mlflow.db'}", experiment="test", artifact_root=root / "artifacts")


def test_registry_round_trip_loads_with_transformers(store, tiny_example, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlcore.lifecycle.mlflow_store import ModelRegistry

    run = store.start_run("train")
    store.log_artifact(run, tiny_example.model_dir, "model")
    registry = ModelRegistry(store, "tiny-test")
    assert registry.by_alias("champion") is None
    v1 = registry.register(run, "model", tags={"lineage.dataset_fingerprint": "abc"})
    v2 = registry.register(run, "model")
    assert (v1.version, v2.version) == ("1", "2")
    assert v1.source.endswith("/model") and v1.run_id == run
    registry.set_alias("champion", v1.version)
    registry.set_alias("challenger", v2.version)
    registry.set_alias("champion", v2.version)  # an alias moves; it is never on two versions
    assert registry.by_alias("champion").version == "2"
    assert registry.by_alias("challenger").version == "2"
    assert registry.get("1").aliases == [] and registry.get("1").tags["lineage.dataset_fingerprint"] == "abc"

    local = registry.download("champion", tmp_path / "dl")
    assert (local / "model.safetensors").is_file() and (local / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(local)
    original = load_file(str(Path(tiny_example.model_dir) / "model.safetensors"))
    state = model.state_dict()
    for name, tensor in original.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)


def test_experiment_opens_in_the_model_training_view(store):
    experiment = store.client.get_experiment(store.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"


def test_log_training_records_params_files_and_plots(store, tmp_path):
    from mlflow.artifacts import download_artifacts

    from rlcore.lifecycle.mlflow_store import log_training

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = [{"step": 0, "val/acc": 0.3, "val/pass@4": 0.5},
               {"step": 1, "reward/mean": 0.4, "acc/mean": 0.4, "actor/kl": 0.01},
               {"step": 2, "reward/mean": 0.5, "acc/mean": 0.5, "actor/kl": 0.02, "val/acc": 0.35}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "config.yaml").write_text("a: 1\n")
    run = store.start_run("train")
    log_training(store, run, run_dir, {"actor": {"optim": {"lr": 2e-5}}, "rollout": {"n": 4}})
    data = store.client.get_run(run).data
    assert data.params["actor.optim.lr"] == "2e-05" and data.params["rollout.n"] == "4"
    assert data.metrics == {}  # steps reach the run live, from the training run itself (tracking.run_id)
    names = {f.path for f in store.client.list_artifacts(run)} | {f.path for f in store.client.list_artifacts(run, "plots")}
    assert {"config.yaml", "metrics.jsonl", "plots/reward.png", "plots/accuracy.png", "plots/kl.png"} <= names
    png = Path(download_artifacts(run_id=run, artifact_path="plots/kl.png", dst_path=str(tmp_path / "p"),
                                  tracking_uri=store.tracking_uri))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dataset_is_logged_with_its_fingerprint_as_digest(store, tiny_example):
    from rlcore.data import read_rows
    from rlcore.lifecycle.fingerprint import rows_fingerprint
    from rlcore.lifecycle.mlflow_store import log_dataset

    run = store.start_run("train")
    log_dataset(store, run, tiny_example.val_file, "val", "validation", tags={"rlcore.dataset_fingerprint": "abc"})
    [used] = store.client.get_run(run).inputs.dataset_inputs
    rows = read_rows(tiny_example.val_file)
    fingerprint = rows_fingerprint(rows)
    assert (used.dataset.name, used.dataset.digest) == ("val", fingerprint[:32])
    assert json.loads(used.dataset.profile)["num_rows"] == len(rows)
    assert json.loads(used.dataset.source)["uri"] == str(Path(tiny_example.val_file).resolve())
    assert "prompt" in used.dataset.schema
    assert {t.key: t.value for t in used.tags} == {"mlflow.data.context": "validation", "rlcore.fingerprint": fingerprint,
                                                  "rlcore.dataset_fingerprint": "abc"}


class _Hook(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802
        _Hook.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.pipeline  # the lifecycle's data-prep and train stages
def test_health_stop_keeps_last_healthy_checkpoint(store, tiny_example, tmp_path):
    from rlcore.cli import CONFIG_DIR
    from rlcore.example.overrides import example_overrides
    from rlcore.lifecycle import pipeline_run, stages

    _Hook.received = []
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = example_overrides() + QUICK + [
            f"tracking.mlflow_uri={store.tracking_uri}", "tracking.experiment=test", "trainer.save_every=1",
            f"registry.webhook_url=http://127.0.0.1:{server.server_port}/h"]
        healthy = pipeline_run.load_pipeline_config(str(CONFIG_DIR / "tiny_grpo.yaml"), base + ["trainer.total_steps=1"])
        ctx = pipeline_run.start_pipeline(healthy, tmp_path, "health-test")
        prepared = stages.prepare_data_stage(healthy, tmp_path)
        first = stages.train_stage(healthy, prepared, tmp_path, ctx)
        assert first["stopped"] is None and first["checkpoint"].endswith("step_00000001")

        # Same pipeline run (as a retry would be): resumes at step 1; the entropy floor trips at step 2.
        sick = pipeline_run.load_pipeline_config(str(CONFIG_DIR / "tiny_grpo.yaml"),
                                           base + ["trainer.total_steps=3", "health.min_entropy=1000"])
        second = stages.train_stage(sick, prepared, tmp_path, ctx)
    finally:
        server.shutdown()
        server.server_close()
    stopped = second["stopped"]
    assert stopped["metric"] == "actor/entropy" and stopped["step"] == 2 and stopped["limit"] == 1000
    # Each attempt is one MLflow run of the stage, into which its training logged every step (no
    # run of its own); the retry's run has the whole record: the step it resumed after, then its own.
    assert [m.step for m in store.client.get_metric_history(first["run_id"], "reward/mean")] == [1]
    assert [m.step for m in store.client.get_metric_history(second["run_id"], "reward/mean")] == [1, 2]
    runs = store.client.search_runs([store.experiment_id], "tags.`rlcore.pipeline_run` = 'health-test'")
    assert sorted(r.data.tags["rlcore.stage"] for r in runs) == ["pipeline", "train", "train"]
    assert {r.data.tags.get("mlflow.parentRunId") for r in runs} == {None, ctx["run_id"]}
    assert store.client.search_runs([store.experiment_id], "tags.`rlcore.algorithm` = 'grpo'") == []  # no orphan run
    [train_input, val_input] = sorted(store.client.get_run(second["run_id"]).inputs.dataset_inputs, key=lambda d: d.dataset.name)
    assert (train_input.dataset.name, train_input.dataset.digest) == ("train", prepared["train_fingerprint"][:32])
    assert {t.key: t.value for t in val_input.tags}["mlflow.data.context"] == "validation"
    assert second["checkpoint"] == first["checkpoint"]  # step 2 was never saved
    assert second["candidate_dir"].endswith("step_00000001/actor")
    run = store.client.get_run(second["run_id"])
    assert "entropy collapse at step 2" in run.data.tags["health.reason"]
    assert "model" in {f.path for f in store.client.list_artifacts(second["run_id"])}
    [event] = _Hook.received
    assert event["event"] == "health_stop" and event["health"]["step"] == 2
    assert event["candidate_checkpoint"] == first["checkpoint"]
    assert event["id"] == "health-test:health_stop:train"  # outside Prefect: the pipeline run's name, the event, the stage


def test_runs_left_open_by_a_failed_pipeline_end_with_the_reason(store, tmp_path):
    """What a failed or crashed pipeline run's hooks do to MLflow (rlcore.lifecycle.run_end): every
    run of it still RUNNING, the pipeline's and its stages', ends with the status and the reason;
    finished stage runs and other pipeline runs are left as they are."""
    from rlcore.config import load_config
    from rlcore.lifecycle import pipeline_run

    config = load_config(None, ["model.path=/m", "data.train_files=[/t.parquet]", "tracking.experiment=test",
                                f"tracking.mlflow_uri={store.tracking_uri}"])
    ctx = pipeline_run.start_pipeline(config, tmp_path, "failing-run")
    finished = store.start_run("data_prep", ctx["run_id"], pipeline_run.stage_tags(ctx, "data_prep"))
    store.end_run(finished)
    train = store.start_run("train", ctx["run_id"], pipeline_run.stage_tags(ctx, "train"))
    other = pipeline_run.start_pipeline(config, tmp_path, "another-run")
    ended = pipeline_run.end_open_runs(config, {pipeline_run.PIPELINE_TAG: "failing-run"}, "KILLED", "process exited with -9")
    assert sorted(ended) == sorted([ctx["run_id"], train])
    for run_id in ended:
        run = store.client.get_run(run_id)
        assert run.info.status == "KILLED" and run.info.end_time is not None
        assert run.data.tags["failure"] == "process exited with -9"
    assert store.client.get_run(finished).info.status == "FINISHED" and "failure" not in store.client.get_run(finished).data.tags
    assert store.client.get_run(other["run_id"]).info.status == "RUNNING"
    assert store.client.get_run(ctx["run_id"]).data.params["data.train_files"] == '["/t.parquet"]'


@pytest.mark.vllm
def test_champion_folder_is_served_by_vllm_as_is(store, tiny_example, tmp_path):
    """The downloaded champion, an MLflow model as the pipeline logs it, is still a plain HF
    folder: vLLM starts on it and decodes like HF."""
    pytest.importorskip("vllm")
    from rlcore.data import PromptLoader, RLDataset
    from rlcore.lifecycle.mlflow_store import ModelRegistry, log_model_folder
    from rlcore.rollout import SamplingParams, make_rollout_engine
    from rlcore.workers.tokenizer import load_tokenizer

    run = store.start_run("train")
    log_model_folder(store, run, tiny_example.model_dir, "model")
    registry = ModelRegistry(store, "tiny-serve")
    registry.set_alias("champion", registry.register(run, "model").version)
    local = registry.download("champion", tmp_path / "dl")
    assert (local / "MLmodel").is_file()

    tok = load_tokenizer(str(local))
    prompts = next(iter(PromptLoader(RLDataset([tiny_example.val_file], tok, 32), batch_size=16, seed=0, shuffle=False)))
    greedy = SamplingParams(n=1, do_sample=False, max_new_tokens=8)
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    vllm_engine = make_rollout_engine("vllm", path=str(local), **ids)
    try:
        served = vllm_engine.generate(prompts, greedy)
    finally:
        vllm_engine.close()
    reference = make_rollout_engine("hf", path=str(local), **ids).generate(prompts, greedy)
    # vLLM's CPU kernels and HF's differ by up to ~1e-4 in log-probs; the example's greedy choices lead by
    # > 1e-3 logits (test_example_build), so the same tokens are chosen.
    assert torch.equal(served["responses"], reference["responses"])
    torch.testing.assert_close(served["rollout_log_probs"], reference["rollout_log_probs"], atol=1e-4, rtol=0)
