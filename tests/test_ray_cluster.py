"""rlcore on a multi-node Ray cluster (3 nodes on 127.0.0.1, `ray_cluster` in conftest, one for
this file): the pools' label selectors, custom resources and STRICT_SPREAD put the actor's two
FSDP ranks on the two `pool=train` nodes (gloo between them) and critic, rollout and reward on the
head; a node killed mid-step stops `rlcore train` (exit 4) with an error naming role, rank and
node; `rlcore pipeline run --ray-address` runs train and evaluate as Ray jobs, retries the train
job that lost a node, and the retry resumes from the last checkpoint on the remaining nodes and
ends with the metrics and weights of the same run on the shared one-node Ray (`ray_local`), bit
for bit (same seed, same ranks, the same float operations in the same order: where a rank runs
changes none)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import stop_process_group  # tests/ is on sys.path (pytest rootdir conftest)
from safetensors.torch import load_file
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

from rlcore.checkpoint import CheckpointManager, step_of
from rlcore.cli import CONFIG_DIR
from rlcore.tracking import read_jsonl

pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]

GRPO = CONFIG_DIR / "tiny_grpo.yaml"
STEPS = 4
# the cluster layout: actor ranks one per `pool=train` node; rollout, reward (and a critic) on the node
# with the `gen_slot` resource (the head)
ON_CLUSTER = [
    "ray.pools={train: {strategy: STRICT_SPREAD, label_selector: {pool: train}}, gen: {resources: {gen_slot: 1}}}",
    "ray.roles={actor: train, rollout: gen, reward: gen, critic: gen}",
]


def quick_grpo(prepared: dict[str, str], out: Path) -> list[str]:
    """A short GRPO run of the tiny example with 2 FSDP actor ranks on Ray, a checkpoint every step."""
    return [
        f"model.path={prepared['model']}", f"data.train_files=[{prepared['train']}]", f"data.val_files=[{prepared['val']}]",
        f"trainer.output_dir={out}", "trainer.backend=ray", "actor.world_size=2", "algorithm.use_reference=false",
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4", f"trainer.total_steps={STEPS}",
        "trainer.save_every=1", "trainer.keep_last=10", "trainer.val_before_train=false", "trainer.val_every=100",
        "trainer.loggers=[jsonl]", f"ray.call_timeout_s={scaled(300):.0f}", f"ray.init_timeout_s={scaled(300):.0f}",
        "ray.colocate=[[rollout, reward]]",  # one process for both: a Python process less to start
    ]


def rlcore_train(overrides: list[str], env: dict[str, str], config: Path = GRPO) -> subprocess.Popen:
    """`rlcore train` in its own process group (a local Ray it starts is stopped with it)."""
    return subprocess.Popen([sys.executable, "-m", "rlcore.cli", "train", str(config), *overrides], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    """Its exit status and stderr; an interrupted test stops it (and what it started)."""
    try:
        _, err = proc.communicate(timeout=scaled(timeout))
    except BaseException:
        stop_process_group(proc)
        raise
    return proc.returncode, err


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    last = CheckpointManager(out / "checkpoints").latest()
    assert last is not None and step_of(last) == STEPS, last
    return load_file(last / "actor" / "model.safetensors")


def step_metrics(out: Path) -> list[dict]:
    """metrics.jsonl without what depends on the machine's speed."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "perf/time"))}
            for r in read_jsonl(out / "metrics.jsonl")]


@pytest.fixture(scope="module")
def prepared(tiny_example, tmp_path_factory) -> dict[str, str]:
    """The tiny example's data as the pipeline's data prep writes it (same rows, same order), so a
    run on these files and the pipeline's train stage see the same batches."""
    from rlcore.data.io import read_rows, write_rows
    from rlcore.lifecycle.data_prep import prepare_dataset

    folder = tmp_path_factory.mktemp("prepared")
    val = write_rows(read_rows(tiny_example.val_file)[:32], folder / "val32.parquet")  # a quick final validation
    data = prepare_dataset([tiny_example.train_file], folder / "prep", [val])
    return {"model": str(tiny_example.model_dir), "train": data.train_file, "val": data.val_file,
            "fingerprint": data.fingerprint}


@pytest.fixture(scope="module")
def single_node_run(prepared, ray_local, ray_cluster, tmp_path_factory) -> Path:
    """The reference: the same GRPO run on the shared one-node Ray (`ray_local`)."""
    out = tmp_path_factory.mktemp("single") / "run"
    code, err = finish(rlcore_train(quick_grpo(prepared, out) + [f"ray.address={ray_local}"], ray_cluster.env))
    assert code == 0, err[-4000:]
    return out


def test_roles_spread_over_the_nodes_and_a_lost_node_stops_rlcore_train_naming_it(ray_cluster, prepared, tmp_path):
    """PPO (actor, critic, rollout, reward) on the cluster: each rank reports its node; the raylet of
    actor rank 1's node killed while the run is in step 2: `rlcore train` exits 4 once Ray declares the
    node dead, naming role, rank and node and the intact step-1 checkpoint the same command resumes from."""
    out = tmp_path / "run"
    overrides = quick_grpo(prepared, out) + ON_CLUSTER + [f"ray.address={ray_cluster.gcs_address}"]
    train_nodes = set(ray_cluster.nodes_with(pool="train"))
    [head] = [nid for nid, n in ray_cluster.nodes.items() if n["head"]]

    run = rlcore_train(overrides, ray_cluster.env, CONFIG_DIR / "tiny_ppo.yaml")  # its data, sizes, ranks; PPO's algorithm
    manager = CheckpointManager(out / "checkpoints")
    deadline = time.monotonic() + scaled(600)
    while not manager.complete():  # step 1 is saved: the run is in step 2 now (a step takes ~1 s)
        assert run.poll() is None, run.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "no checkpoint in 600 s"
        time.sleep(0.1)
    # where the workers said they run (trace.jsonl: each step's line is written before its checkpoint)
    nodes = {role: [w["node_id"] for w in ranks] for role, ranks in read_jsonl(out / "trace.jsonl")[0]["workers"].items()}
    assert sorted(nodes) == ["actor", "critic", "reward", "rollout"]
    assert len(nodes["actor"]) == 2 and set(nodes["actor"]) == train_nodes  # one FSDP rank per train node
    assert nodes["critic"] == nodes["rollout"] == nodes["reward"] == [head]  # rollout+reward: one process
    victim = nodes["actor"][1]
    ray_cluster.kill_node(victim)
    killed_at = time.monotonic()
    code, err = finish(run)
    print(f"node loss reported {time.monotonic() - killed_at:.1f} s after the raylet was killed")
    ray_cluster.add_node(num_cpus=1, labels={"pool": "train"})  # a replacement, as an autoscaler would
    assert code == 4, err[-4000:]
    line = next(line for line in err.splitlines() if line.startswith("rlcore: error:"))
    assert line.startswith("rlcore: error: worker role='actor' rank=1 method=")  # a death, not a call timeout
    assert line.endswith(f"failed: its node {victim[:12]} ({socket.gethostname()}, 127.0.0.1) was lost (ActorDiedError)"), line
    latest = manager.latest()  # verified: every file's SHA-256, finite weights
    assert latest is not None and step_of(latest) < STEPS
    assert f"rlcore: the run's newest intact checkpoint: {latest.resolve()}; the same command resumes from it" in err


def test_a_failed_or_stopped_ray_job_raises_with_its_reason(ray_cluster):
    """What the flow's tasks get from a job that did not succeed: the reason its driver printed
    (`rlcore: ...` lines), and whether a retry may help (a refused input or a stopped job: no)."""
    import threading

    from rlcore.lifecycle.ray_job import RayJobRefused, RayJobStopped, finish_job, job_client, submit
    from rlcore.lifecycle.retry import is_deterministic

    client = job_client(ray_cluster.dashboard_url)
    try:
        refused = submit(client, retry_for_s=60, entrypoint="python -c \"import sys; print('rlcore: error: data.train_files: no such "
                                               "file x.parquet', file=sys.stderr); sys.exit(2)\"")
    except RuntimeError as e:
        raise AssertionError(f"{e}\n{ray_cluster.dashboard_logs()}") from None
    with pytest.raises(RayJobRefused) as info:
        finish_job(client, refused, "train")
    assert str(info.value) == (f"Ray job {refused} (train) failed with exit code 2: rlcore: error: data.train_files: "
                               "no such file x.parquet")
    assert is_deterministic(info.value)  # Prefect's retry condition: not retried

    lines: list[str] = []
    running = submit(client, entrypoint="python -c \"import time; print('working', flush=True); time.sleep(300)\"")

    def stop_when_working() -> None:
        deadline = time.monotonic() + scaled(120)
        while "working" not in lines and time.monotonic() < deadline:
            time.sleep(0.2)
        client.stop_job(running)

    stopper = threading.Thread(target=stop_when_working)
    stopper.start()
    with pytest.raises(RayJobStopped, match=f"Ray job {running} \\(train\\) was stopped: ") as info:
        finish_job(client, running, "train", lines.append)
    stopper.join()
    assert "working" in lines  # its log came through while it ran
    assert info.value.status == "STOPPED" and is_deterministic(info.value)


def _prefect_logs(api: str, flow_run_id: str) -> dict[str, list[str]]:
    """The flow run's log messages per task run name ("" for the flow's own)."""
    from conftest import PREFECT_HTTP

    tasks = PREFECT_HTTP.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run_id]}}}).json()
    names = {t["id"]: t["name"] for t in tasks}
    out: dict[str, list[str]] = {}
    offset = 0
    while True:
        page = PREFECT_HTTP.post(f"{api}/logs/filter", json={"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                                            "sort": "TIMESTAMP_ASC", "offset": offset, "limit": 200}).json()
        for entry in page:
            out.setdefault(names.get(entry["task_run_id"], ""), []).append(entry["message"])
        if len(page) < 200:
            return out
        offset += len(page)


@pytest.mark.prefect
@pytest.mark.pipeline
@pytest.mark.timeout(1800)  # with its fixtures: a reference run, a pipeline, three Ray jobs (~10 min at load 15)
def test_pipeline_runs_its_stages_as_ray_jobs_and_retries_a_lost_node_from_the_checkpoint(
        ray_cluster, prepared, single_node_run, prefect_api, tmp_path):
    """`rlcore pipeline run --ray-address`: train and evaluate run as Ray jobs on the cluster (the
    training inside the job finds the cluster by RAY_ADDRESS); a node lost mid-step fails the train
    job, the task fails with the job's reason and is retried: the next job resumes from the newest
    checkpoint on the nodes that remain and ends with the metrics and weights of the same run,
    uninterrupted, on one machine. (No model logged: registering adds nothing here.)"""
    api, prefect = prefect_api
    env = {**ray_cluster.env, **{k: v for k, v in prefect.items() if k.startswith("PREFECT")}}
    env.pop("MLFLOW_TRACKING_URI", None)
    work = tmp_path / "work"
    work.mkdir()
    spare = ray_cluster.add_node(num_cpus=1, labels={"pool": "train"})  # where the retry's rank goes
    overrides = [o for o in quick_grpo(prepared, work / "unused") if not o.startswith("trainer.output_dir")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlcore.cli", "pipeline", "run", "--json", "--ray-address", ray_cluster.dashboard_url,
         "--config", str(GRPO), "--output-dir", str(work), *overrides, *ON_CLUSTER, "tracking.log_model=false"],
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + scaled(600)
        while not any(CheckpointManager(d / "checkpoints").complete() for d in work.glob("pipeline-*/train")):
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "no checkpoint in 600 s"
            time.sleep(0.1)
        [train_dir] = work.glob("pipeline-*/train")
        # the node of an actor rank other than the spare's: STRICT_SPREAD put the two ranks on two of
        # the three train nodes, the spare among them or not (rank 1's node unless that is the
        # spare); the two train nodes left include the spare, so the retry must use it
        ranks = [w["node_id"] for w in read_jsonl(train_dir / "trace.jsonl")[0]["workers"]["actor"]]
        victim = next(node for node in reversed(ranks) if node != spare)
        victim_rank = ranks.index(victim)
        ray_cluster.kill_node(victim)
        written = {p.name: (p / "COMPLETE.json").read_text() for p in CheckpointManager(train_dir / "checkpoints").complete()}
        out, err = proc.communicate(timeout=scaled(900))
    finally:
        stop_process_group(proc)
    assert proc.returncode == 0, err[-4000:]
    summary = json.loads(out)
    assert summary["steps"] == STEPS and summary["accuracy_after"] is not None  # trained, then evaluated

    # the retried job resumed: every step once, the first job's checkpoints kept as they were, the
    # metrics and weights of the uninterrupted single-node run
    assert [r["step"] for r in read_jsonl(train_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert all((train_dir / "checkpoints" / name / "COMPLETE.json").read_text() == manifest
               for name, manifest in written.items())
    assert step_metrics(train_dir) == step_metrics(single_node_run)
    mine, ref = final_weights(train_dir), final_weights(single_node_run)
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    resumed = read_jsonl(train_dir / "trace.jsonl")[-1]["workers"]["actor"]
    assert victim not in {w["node_id"] for w in resumed} and spare in {w["node_id"] for w in resumed}

    # the jobs, as the cluster knows them
    from rlcore.lifecycle.ray_job import job_client

    jobs = [j for j in job_client(ray_cluster.dashboard_url).list_jobs()
            if (j.metadata or {}).get("rlcore.pipeline_run") == summary["pipeline_run"]]
    by_stage = {s: sorted((j for j in jobs if j.metadata["rlcore.stage"] == s), key=lambda j: j.start_time)
                for s in ("train", "evaluate")}
    assert [(j.status.value, j.driver_exit_code) for j in by_stage["train"]] == [("FAILED", 4), ("SUCCEEDED", 0)]
    assert [j.status.value for j in by_stage["evaluate"]] == ["SUCCEEDED"]
    failed_job, train_job = by_stage["train"]

    # each stage's MLflow run names its job (the failed attempt's run too)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              f"tags.`rlcore.pipeline_run` = '{summary['pipeline_run']}'")
    tagged = {(r.data.tags.get("rlcore.stage"), r.info.status): r.data.tags for r in runs}
    assert tagged[("train", "FAILED")]["ray.job_id"] == failed_job.submission_id
    assert f"its node {victim[:12]} (" in tagged[("train", "FAILED")]["failure"]
    assert tagged[("train", "FINISHED")]["ray.job_id"] == train_job.submission_id
    assert tagged[("train", "FINISHED")]["prefect.flow_run_id"] == summary["prefect_flow_run_id"]
    assert tagged[("evaluate", "FINISHED")]["ray.job_id"] == by_stage["evaluate"][0].submission_id

    # the jobs' logs in the train task's Prefect log, and the failed job's reason
    logs = _prefect_logs(api, summary["prefect_flow_run_id"])
    [train_task] = [name for name in logs if name.startswith("train-")]
    train_log = "\n".join(logs[train_task])
    assert f"train: submitted Ray job {failed_job.submission_id}" in train_log
    assert f"train: submitted Ray job {train_job.submission_id}" in train_log
    lost = f"rlcore: error: worker role='actor' rank={victim_rank} method="
    assert lost in train_log  # a line of the failed job's own log, streamed
    reason = next(m for m in logs[train_task] if f"Ray job {failed_job.submission_id} (train) failed with exit code 4: "
                  f"{lost}" in m)
    assert f"its node {victim[:12]} (" in reason and "was lost" in reason
    assert any("Retry" in m for m in logs[train_task])
