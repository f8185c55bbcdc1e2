"""A pipeline stage as a Ray job: the flow submits it to a cluster's job server (Ray's job
submission API, `JobSubmissionClient`), follows its log line by line, gets back the stage's
result, and records the job on the stage's MLflow run; a job that fails or is stopped raises
with its reason.

The job's driver (on the cluster's head node) runs `python -m rlcore.cli pipeline stage FILE`:
FILE, written under the pipeline's work directory, names the stage function and its arguments,
and the stage's result comes back as the last line of the job's log (`RESULT_MARK`). Inside the
job `RAY_ADDRESS` names the cluster, so a `trainer.backend: ray` run places its workers there.
What a stage reads and writes (the work directory, prepared data, checkpoints, a SQLite MLflow
store) must be at the same paths on the head node: a shared file system, or the flow running on
the head node itself. The cluster's `python` must import this rlcore.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import secrets
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlcore.config import config_from_dict
from rlcore.errors import RLCoreError
from rlcore.lifecycle import pipeline_run, stages
from rlcore.lifecycle.job_server import connect, job_server_url, shown
from rlcore.lifecycle.results import PipelineContext
from rlcore.redact import redact_text

log = logging.getLogger(__name__)

RESULT_MARK = "rlcore-stage-result: "  # the job's last log line: the stage's result as JSON
JOB_TAG = "ray.job_id"
# the stages a job can run: name -> function(config, **kwargs) (kwargs as the flow's task passes them)
STAGES: dict[str, Callable[..., dict[str, Any]]] = {"train": stages.train_stage, "evaluate": stages.evaluate_stage}
EXIT_REFUSED = 2  # rlcore.cli: the input was refused (the same inputs fail the same way again)


class RayJobError(RuntimeError):
    """A stage's Ray job failed or was stopped: `job_id`, `status`, `exit_code` and the reason (the
    `rlcore: ...` lines its driver printed, else the last line of its log, else Ray's message)."""

    def __init__(self, message: str, job_id: str, status: str, exit_code: int | None):
        super().__init__(message)
        self.job_id, self.status, self.exit_code = job_id, status, exit_code


class RayJobRefused(RayJobError, RLCoreError):
    """The stage refused its input inside the job (exit status 2): retrying would fail again."""


class RayJobStopped(RayJobError, RLCoreError):
    """Someone stopped the job (`ray job stop`, the dashboard): a retry would undo that."""


def job_server(address: str) -> str:
    """The job server's URL: `http://` is added to a bare `host:port` (the dashboard's port, 8265
    by default); an address that is not a job server URL raises JobServerAddressError."""
    return job_server_url(address)


def job_client(address: str) -> Any:
    """Ray's job client for the job server at `address`, reached within the bounds of
    `rlcore.lifecycle.job_server.connect` (or JobServerAddressError / JobServerUnreachable)."""
    return connect(address)


# ---------------------------------------------------------------------- inside the job
def write_stage_file(workdir: str | Path, stage: str, kwargs: dict[str, Any]) -> Path:
    """The stage's name and arguments, for the job to read (only the owner may read it: the config
    may hold a webhook URL or other secrets, which a command line would show to everyone)."""
    if stage not in STAGES:
        raise ValueError(f"no stage {stage!r} runs as a Ray job (stages: {sorted(STAGES)})")
    folder = Path(workdir) / "ray_jobs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stage}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"stage": stage, "cwd": os.getcwd(), "kwargs": kwargs}, f)
    return path.resolve()


def run_stage_file(path: str | Path) -> dict[str, Any]:
    """Run the stage a file names (what `rlcore pipeline stage FILE` does in the job), in the
    directory the flow ran in (relative paths in the config mean the same there)."""
    spec = json.loads(Path(path).read_text())
    os.chdir(spec["cwd"])
    kwargs = dict(spec["kwargs"])
    config = config_from_dict(kwargs.pop("config"))
    return STAGES[spec["stage"]](config, **kwargs)


# ---------------------------------------------------------------------- the flow's side
def run_stage_as_job(address: str, stage: str, config: dict[str, Any], kwargs: dict[str, Any], *,
                     workdir: str | Path, ctx: PipelineContext | None, log_line: Callable[[str], None] = log.info,
                     poll_s: float = 1.0) -> dict[str, Any]:
    """Run `stage` (see STAGES) as a Ray job on the cluster whose job server is `address`; its log
    goes to `log_line` as it is written; the job id is tagged (`ray.job_id`) on the MLflow runs
    the stage made. Returns the stage's result, or raises RayJobError (RayJobRefused when the stage
    refused its input, RayJobStopped when someone stopped the job: neither is retried)."""
    client = job_client(address)
    spec = write_stage_file(workdir, stage, {"config": config, **kwargs})
    run_name = ctx["run_name"] if ctx else "run"
    tracking = (ctx["tracking_uri"] if ctx else None) or pipeline_run.tracking_uri(config_from_dict(config))
    started = int(time.time() * 1000)
    job_id = submit(
        client, entrypoint=f"python -m rlcore.cli pipeline stage {shlex.quote(str(spec))}",
        submission_id=f"rlcore-{run_name}-{stage}-{secrets.token_hex(3)}",
        metadata={pipeline_run.PIPELINE_TAG: run_name, pipeline_run.STAGE_TAG: stage},
        runtime_env={"env_vars": {"MLFLOW_TRACKING_URI": tracking}},
    )
    log_line(f"{stage}: submitted Ray job {job_id} to {shown(job_server(address))}")
    try:
        logs = finish_job(client, job_id, stage, log_line, poll_s)
    finally:
        if ctx is not None:
            record_job(config, ctx, stage, job_id, client, address, started)
    return stage_result(logs, job_id)


def submit(client: Any, *, entrypoint: str, retry_for_s: float = 120.0, **kwargs: Any) -> str:
    """`client.submit_job`, tried again while the job server answers that it has no agent to take
    the job yet ("try again later": its head node's agent is starting, or busy on a loaded node)."""
    deadline = time.monotonic() + retry_for_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, **kwargs)
        except RuntimeError as e:
            if "try again later" not in str(e) or time.monotonic() > deadline:
                raise
            log.warning("Ray job server: %s; trying again", redact_text(str(e).splitlines()[0]))
            time.sleep(2.0)


def finish_job(client: Any, job_id: str, stage: str, log_line: Callable[[str], None] = log.info,
               poll_s: float = 1.0) -> str:
    """Follow the job to its end (its log to `log_line`); its whole log when it succeeded, else
    RayJobError with the reason. Interrupted here (a task's timeout, Ctrl-C), the job is stopped."""
    info = None
    try:
        info = follow_job(client, job_id, log_line, poll_s)
    finally:
        if info is None:
            _stop_quietly(client, job_id)
    logs = client.get_job_logs(job_id)
    status = info.status.value
    if status != "SUCCEEDED":
        raise job_error(stage, job_id, status, info.driver_exit_code, info.message, logs)
    return logs


def follow_job(client: Any, job_id: str, log_line: Callable[[str], None], poll_s: float = 1.0) -> Any:
    """Every line of the job's log to `log_line` (from this thread), until the job ends; returns
    its final `JobDetails`. Ray's log tail (a websocket) runs on a thread of its own; if it fails,
    the log is polled instead. Either way the stored log is read once the job has ended: the
    tail can close before the driver's last lines (often its error) reach it."""
    lines: queue.Queue[str | None] = queue.Queue()
    failed: list[BaseException] = []

    def tail() -> None:
        async def read() -> None:
            buffer = ""
            async for chunk in client.tail_job_logs(job_id):
                buffer += chunk
                *done, buffer = buffer.split("\n")
                for line in done:
                    lines.put(line)
            # a last line without its newline is left to the read of the stored log below

        try:
            asyncio.run(read())
        except Exception as e:  # noqa: BLE001 - fall back to polling below
            failed.append(e)
        finally:
            lines.put(None)

    tailing = threading.Thread(target=tail, name=f"tail-{job_id}", daemon=True)
    tailing.start()
    shown, ended_at = 0, None
    while True:
        try:
            line = lines.get(timeout=5.0)
        except queue.Empty:  # quiet for a while: a tail that outlives its job by 30 s is given up
            if ended_at is None and client.get_job_info(job_id).status.is_terminal():
                ended_at = time.monotonic()
            if ended_at is not None and time.monotonic() - ended_at > 30:
                failed.append(TimeoutError("the log tail did not end with the job"))
                break
            continue
        if line is None:
            break
        shown += 1
        if not line.startswith(RESULT_MARK):
            log_line(line)
    if failed:
        log.warning("Ray job %s: following its log failed (%s); polling it instead", job_id,
                    redact_text(str(failed[0])))
    return _poll_logs(client, job_id, log_line, shown, poll_s)


def _poll_logs(client: Any, job_id: str, log_line: Callable[[str], None], skip: int, poll_s: float) -> Any:
    """The rest of the log by polling (after the first `skip` lines), until the job ends; returns
    its final `JobDetails`."""
    while True:
        info = client.get_job_info(job_id)
        terminal = info.status.is_terminal()
        lines = client.get_job_logs(job_id).split("\n")
        complete = lines if terminal else lines[:-1]  # the last one may be half written
        for line in complete[skip:]:
            if line and not line.startswith(RESULT_MARK):
                log_line(line)
        skip = max(skip, len(complete))
        if terminal:
            return info
        time.sleep(poll_s)


def _stop_quietly(client: Any, job_id: str) -> None:
    try:
        client.stop_job(job_id)
        log.warning("stopped Ray job %s", job_id)
    except Exception as e:  # noqa: BLE001 - the interruption being handled matters more
        log.warning("could not stop Ray job %s: %s", job_id, redact_text(str(e)))


def job_error(stage: str, job_id: str, status: str, exit_code: int | None, message: str | None, logs: str) -> RayJobError:
    """The error for a job that did not succeed, with the reason its driver gave."""
    said = [line for line in logs.splitlines() if line.startswith("rlcore: ")]
    last = next((line for line in reversed(logs.splitlines()) if line.strip()), "")
    if status == "STOPPED":
        reason = f"Ray job {job_id} ({stage}) was stopped: {message or 'stopped'}"
    else:
        code = f" with exit code {exit_code}" if exit_code is not None else ""
        if said:
            why = " / ".join(said)
        else:
            why = last or ((message or "").strip().splitlines() or ["no log"])[0]
        reason = f"Ray job {job_id} ({stage}) {status.lower()}{code}: {why}"
    cls = RayJobStopped if status == "STOPPED" else RayJobRefused if exit_code == EXIT_REFUSED else RayJobError
    return cls(reason, job_id, status, exit_code)


def stage_result(logs: str, job_id: str) -> dict[str, Any]:
    for line in reversed(logs.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    raise RayJobError(f"Ray job {job_id} succeeded but printed no stage result ({RESULT_MARK!r} line)", job_id,
                      "SUCCEEDED", 0)


def record_job(config: dict[str, Any], ctx: PipelineContext, stage: str, job_id: str, client: Any, address: str,
               started_ms: int) -> None:
    """Tag the MLflow runs the job's stage made (this pipeline run's runs of `stage` that started
    since the submission, give or take a minute of clock skew) with the job's id, status and server, and with this flow run's Prefect
    ids (the job's driver runs outside Prefect). Never fails the stage (a tag is not worth it)."""
    try:
        status = client.get_job_status(job_id).value
        store = pipeline_run.open_store(config_from_dict(config), ctx["workdir"])
        runs = store.client.search_runs(
            [store.experiment_id],
            filter_string=f"tags.`{pipeline_run.PIPELINE_TAG}` = '{ctx['run_name']}' and tags.`{pipeline_run.STAGE_TAG}` = '{stage}' "
                          f"and attributes.start_time >= {started_ms - 60_000}")
        tags = {**pipeline_run.stage_tags(ctx, stage), JOB_TAG: job_id, "ray.job_status": status,
                "ray.job_server": shown(job_server(address))}
        for run in runs:
            if JOB_TAG not in run.data.tags:
                store.set_tags(run.info.run_id, tags)
    except Exception as e:  # noqa: BLE001
        log.warning("could not record Ray job %s on the MLflow run of %s: %s", job_id, stage, redact_text(str(e)))


__all__ = ["JOB_TAG", "RESULT_MARK", "STAGES", "RayJobError", "RayJobRefused", "RayJobStopped", "finish_job", "follow_job",
           "job_client", "job_error", "submit",
           "job_server", "record_job", "run_stage_as_job", "run_stage_file", "stage_result", "write_stage_file"]
