"""What a person sees from the `rlcore` command around the pipeline (#14): its version; a config
typo or a placeholder left in a config reported by `pipeline run` in one line before Prefect starts (-v anywhere adds the
traceback); rlcore configuring only its own loggers, so Prefect's log lines keep their format; a
clear message naming the setting when Prefect's ephemeral server is slow to start; `pipeline emit`
reaching the server without importing torch; data prep not retrying a data error; progress with
elapsed<remaining time; labelled plots."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PREFECT_HTTP, prefect_env  # tests/ is on sys.path (pytest rootdir conftest)
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

import rlcore
from rlcore import cli
from rlcore.console_log import configure_logging
from rlcore.errors import RLCoreError

ROOT = Path(__file__).resolve().parents[1]
TINY_GRPO = str(ROOT / "rlcore" / "configs" / "tiny_grpo.yaml")


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, **prefect_env(tmp_path / "prefect"), OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        if key not in extra:
            env.pop(key, None)
    return env


def rlcore_cli(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlcore.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=scaled(timeout))


def test_version(tmp_path: Path) -> None:
    done = rlcore_cli(["--version"], tmp_path, cli_env(tmp_path))
    assert done.returncode == 0 and done.stdout.strip() == f"rlcore {rlcore.__version__}"


@pytest.mark.slow  # three CLI processes
def test_pipeline_run_reports_a_config_typo_in_one_line_before_prefect_starts(tmp_path: Path) -> None:
    env = cli_env(tmp_path)
    done = rlcore_cli(["pipeline", "run", "trainer.total_stepz=2"], tmp_path, env)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["rlcore: error: invalid config: trainer.total_stepz: unknown key"]
    assert done.stdout == ""
    assert not (tmp_path / "prefect").exists()  # Prefect never started (its home is made at start)
    assert not (tmp_path / "mlflow.db").exists()

    # -v anywhere on the command line: the same message after the traceback
    verbose = rlcore_cli(["pipeline", "run", "trainer.total_stepz=2", "-v"], tmp_path, env)
    assert verbose.returncode == 2 and "Traceback" in verbose.stderr
    assert verbose.stderr.splitlines()[-1] == "rlcore: error: invalid config: trainer.total_stepz: unknown key"

    missing = rlcore_cli(["pipeline", "run", "--data", str(tmp_path / "nope.parquet")], tmp_path, env)
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [f"rlcore: error: --data: no such data file: {tmp_path / 'nope.parquet'}"]

    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    no_server = rlcore_cli(["pipeline", "run", "--ray-address", f"127.0.0.1:{port}"], tmp_path, env)
    assert no_server.returncode == 2
    [line] = no_server.stderr.splitlines()
    assert line.startswith(f"rlcore: error: --ray-address http://127.0.0.1:{port}: nothing accepts connections on port {port} ")
    assert not (tmp_path / "prefect").exists()


def test_rlcore_configures_only_its_own_loggers(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    # as in a process where Prefect has not set up its logging yet (another test may have imported it)
    monkeypatch.setattr(root, "handlers", [h for h in root.handlers if type(h).__name__ != "PrefectConsoleHandler"])
    root_before = (root.level, list(root.handlers))
    configure_logging(verbose=True)
    configure_logging(verbose=True)  # again (main called twice in one process): still one line per record
    assert (root.level, list(root.handlers)) == root_before
    logging.getLogger("rlcore.lifecycle.stages").info("from rlcore")
    logging.getLogger("somelib").info("from another library")
    err = capsys.readouterr().err
    [line] = [ln for ln in err.splitlines() if "from rlcore" in ln]
    assert line.endswith("| INFO    | rlcore.lifecycle.stages - from rlcore")
    assert "from another library" not in err
    configure_logging(verbose=False)
    logging.getLogger("rlcore.x").info("quiet now")
    assert "quiet now" not in capsys.readouterr().err


def test_ephemeral_start_up_timeout_defaults_longer_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.EPHEMERAL_TIMEOUT_VAR, raising=False)
    cli._ephemeral_timeout_default()
    assert os.environ[cli.EPHEMERAL_TIMEOUT_VAR] == str(cli.EPHEMERAL_TIMEOUT_S)
    assert cli.EPHEMERAL_TIMEOUT_S > 20  # Prefect's own default
    monkeypatch.setenv(cli.EPHEMERAL_TIMEOUT_VAR, "7")
    cli._ephemeral_timeout_default()
    assert os.environ[cli.EPHEMERAL_TIMEOUT_VAR] == "7"


@pytest.mark.slow
@pytest.mark.prefect  # Prefect's ephemeral server (in the CLI's process), the behaviour under test: not the session's
def test_ephemeral_server_timeout_names_the_setting_and_prefect_logs_keep_their_format(tmp_path: Path) -> None:
    env = cli_env(tmp_path, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="0")
    paths = ["model.path=/m", "data.train_files=[/t]", "data.val_files=[/v]"]  # past the placeholder check; never read
    done = rlcore_cli(["pipeline", "run", "--config", TINY_GRPO, *paths], tmp_path, env)
    assert done.returncode == 2
    [message] = [ln for ln in done.stderr.splitlines() if ln.startswith("rlcore: error:")]
    assert "did not start within 0 s (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)" in message
    assert "Traceback" not in done.stderr
    # Prefect's own console format (time | level | logger - message), not rlcore's
    [start] = [ln for ln in done.stderr.splitlines() if "Starting temporary server" in ln]
    assert " | INFO    | prefect - Starting temporary server on http://127.0.0.1:" in start


@pytest.mark.slow
@pytest.mark.prefect
def test_pipeline_emit_reaches_the_server_without_importing_torch(tmp_path: Path, prefect_api) -> None:
    from rlcore.lifecycle.events import data_resource

    api, _ = prefect_api
    data = tmp_path / "batch.jsonl"
    data.write_text("{}\n")
    probe = ("import json, sys; from rlcore.cli import main; rc = main(['pipeline', 'emit', sys.argv[1]]); "
             "print(json.dumps({'rc': rc, 'heavy': sorted(m for m in ('torch', 'transformers', 'mlflow', 'pyarrow') "
             "if m in sys.modules)}))")
    env = dict(cli_env(tmp_path, PREFECT_API_URL=api), PREFECT_HOME=str(tmp_path / "client"))
    done = subprocess.run([sys.executable, "-c", probe, str(data)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=scaled(120))
    assert done.returncode == 0, done.stderr[-2000:]
    # sent and confirmed before it returns: nothing left for Prefect's events worker to flush at exit
    assert "Still processing" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    *event_id, report = done.stdout.strip().splitlines()
    assert json.loads(report) == {"rc": 0, "heavy": []}
    # Every event about this file (the server is the session's: other tests' events are there too).
    resource = data_resource(data)["prefect.resource.id"]
    body = {"filter": {"event": {"name": ["rlcore.data.arrived"]}, "resource": {"id": [resource]}}}
    deadline = time.monotonic() + scaled(30)  # the server stores events in batches
    while not (events := PREFECT_HTTP.post(f"{api}/events/filter", json=body, timeout=scaled(10)).json()["events"]):
        assert time.monotonic() < deadline, "the event never reached the server"
        time.sleep(1)
    assert [e["id"] for e in events] == event_id
    assert events[0]["payload"]["path"] == str(data.resolve())


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.pipeline
def test_data_prep_does_not_retry_a_data_error(tmp_path: Path, prefect_api) -> None:
    """A bad row fails data prep at once (the same file would fail again), one attempt, one
    task run; the error reaches the user as rlcore's own message."""
    api, _ = prefect_api
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"data_source": "x", "prompt": [{"role": "user", "content": "1+1"}]}) + "\n")
    done = rlcore_cli(["pipeline", "run", "--config", TINY_GRPO, "--data", str(bad), "data.val_files=[]", "model.path=/no",
                       "--retries", "3"], tmp_path,
                      cli_env(tmp_path, PREFECT_API_URL=api))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "rlcore: error: 1 bad row(s) in the dataset:" in done.stderr
    assert "field 'reward_model': missing" in done.stderr
    assert "Retry 1/1 will start" not in done.stderr  # what Prefect logs before a retry
    finished = [ln for ln in done.stderr.splitlines() if "Task run 'data_prep-" in ln and "Finished in state" in ln]
    assert len(finished) == 1 and "Failed" in finished[0]


@pytest.mark.slow  # imports Prefect, MLflow and torch
def test_data_prep_retries_only_transient_failures() -> None:
    """The task's retry condition, given the failed states Prefect builds from an exception."""
    from prefect.states import Failed

    from rlcore.data.schema import DataValidationError
    from rlcore.flows.data_prep import prepare_data_task
    from rlcore.lifecycle.retry import retry_if_transient

    assert prepare_data_task.retries == 1 and prepare_data_task.retry_condition_fn is retry_if_transient
    for transient in (OSError("disk hiccup"), TimeoutError("tracking store"), ConnectionError("reset")):
        assert retry_if_transient(prepare_data_task, None, Failed(data=transient))  # no task run needed
    for final in (DataValidationError([]), ValueError("no training rows left"), KeyError("prompt")):
        assert not retry_if_transient(prepare_data_task, None, Failed(data=final))


@pytest.mark.slow  # imports Prefect, MLflow, torch and Ray
def test_a_process_death_is_never_retried_and_every_task_says_so() -> None:
    """A dead process (the serving process gone: a broken pipe; a worker killed or out of memory) is
    final, also when wrapped by the code that saw it; every task of the pipeline asks the same
    condition, with the documented number of retries (`--retries` changes the stages')."""
    import ray.exceptions
    from prefect.states import Failed

    from rlcore.controller.ray_backend import WorkerDiedError
    from rlcore.flows import data_prep, evaluate, promote, reward_model, train
    from rlcore.lifecycle.retry import LOOKUP_RETRIES, STAGE_RETRIES, retry_if_transient

    died = WorkerDiedError("actor", 1, "update", "ActorDiedError: killed by SIGKILL", "", node_id=None)
    try:
        try:
            raise BrokenPipeError(32, "Broken pipe")
        except BrokenPipeError as err:
            raise RuntimeError("could not log the step") from err
    except RuntimeError as err:
        wrapped = err
    for death in (BrokenPipeError(32, "Broken pipe"), died, MemoryError(), wrapped, ray.exceptions.RayActorError(),
                  SystemExit(1), KeyboardInterrupt()):
        assert not retry_if_transient(None, None, Failed(data=death)), repr(death)
    assert retry_if_transient(None, None, Failed(data=ConnectionResetError("tracking server reset")))  # still transient
    assert retry_if_transient(None, None, Failed(data=RuntimeError("the tracking store answered 503")))

    stages = [data_prep.prepare_data_task, train.train_task, train.sft_task, evaluate.evaluate_task, promote.promote_task,
              reward_model.train_reward_model_task, reward_model.evaluate_reward_model_task]
    lookups = [train.champion_task, reward_model.reward_model_in_use_task]
    for task in stages + lookups:
        assert task.retry_condition_fn is retry_if_transient, task.name
    assert [t.retries for t in stages] == [STAGE_RETRIES] * len(stages) and STAGE_RETRIES == 1
    assert [t.retries for t in lookups] == [LOOKUP_RETRIES] * len(lookups) and LOOKUP_RETRIES == 2


def test_retries_and_concurrency_limit_options(capsys: pytest.CaptureFixture[str]) -> None:
    """`--retries N` becomes the flow's `retries` parameter (absent: the flow's default, so a deployment
    made without it keeps it); `--concurrency-limit N` is the served deployment's; nonsense is one line."""
    assert cli._pipeline_inputs(cli.parse_args(["pipeline", "run", "--retries", "0"]))["retries"] == 0
    assert "retries" not in cli._pipeline_inputs(cli.parse_args(["pipeline", "serve"]))
    assert cli.parse_args(["pipeline", "serve", "--concurrency-limit", "2"]).concurrency_limit == 2
    assert cli.parse_args(["pipeline", "serve"]).concurrency_limit is None
    for argv, line in ((["pipeline", "run", "--retries", "-1"], "argument --retries: expected 0 or more, got -1"),
                       (["pipeline", "serve", "--concurrency-limit", "0"], "argument --concurrency-limit: expected 1 or more, got 0"),
                       (["pipeline", "serve", "--concurrency-limit", "two"],
                        "argument --concurrency-limit: expected a whole number, got 'two'")):
        with pytest.raises(SystemExit) as stopped:
            cli.main(argv)
        assert stopped.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: {line}")


def test_console_sink_shows_elapsed_and_remaining(capsys: pytest.CaptureFixture[str]) -> None:
    from rlcore.tracking import ConsoleSink

    sink = ConsoleSink(total_steps=4)
    for step in (3, 4):  # a resumed run: steps 1-2 were done by an earlier process
        sink.log(step, {"reward/mean": 0.5})
    first, last = capsys.readouterr().err.splitlines()
    assert first.startswith("[###############-----] step 3/4 [00:00<00:00] reward/mean=0.5")
    assert last.startswith("[####################] step 4/4 [00:00<00:00]")
    fresh = ConsoleSink(total_steps=2)
    fresh.log(0, {"val/acc": 0.3})  # validation before training: no step run yet, nothing to estimate from
    assert capsys.readouterr().err.startswith("[--------------------] step 0/2 [00:00<?] val/acc=0.3")


def test_progress_lines_off_a_terminal() -> None:
    """Off a terminal (pipes, logs, Prefect task logs) progress comes as whole lines: nothing for
    a task shorter than the interval, then `n/total unit [elapsed<remaining, rate]`."""
    from rlcore.tracking import progress

    lines: list[str] = []
    with progress(3, "quick", say=lines.append, every_s=60) as bar:
        bar.update(3)
    assert lines == []
    with progress(4, "tiny example SFT", unit="steps", say=lines.append, every_s=0) as bar:
        bar.update(1)
    assert lines[-1].startswith("tiny example SFT: 1/4 steps [00:00<")


def test_plots_have_y_axis_labels(tmp_path: Path) -> None:
    from rlcore.lifecycle.mlflow_store import CURVES, Y_LABELS, curve_figure, plot_curves

    records = [{"step": s, "reward/mean": 0.1 * s, "val/acc": 0.3, "actor/kl": 0.01 * s} for s in (1, 2, 3)]
    assert {p.name for p in plot_curves(records, tmp_path)} == {"reward.png", "accuracy.png", "kl.png"}
    assert set(Y_LABELS) == set(CURVES)
    fig = curve_figure("kl", {"actor/kl": [(1, 0.01), (2, 0.02)]})
    [ax] = fig.axes
    assert ax.get_ylabel() == "KL to the reference (per token)" and ax.get_xlabel() == "step"


def _refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, list[str]]:
    code = cli.main(argv)
    return code, capsys.readouterr().err.splitlines()


def test_pipeline_run_refuses_a_config_still_holding_placeholders_naming_the_keys(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A shipped config given as is (`REPLACE_WITH_...` paths) is one line, exit 2, before Prefect
    starts (it used to fail ~3 min into the flow); keys the pipeline fills itself are not named."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    code, err = _refusal(capsys, ["pipeline", "run", "--config", TINY_GRPO])
    assert code == 2 and err == ["rlcore: error: --config: still holds placeholders model.path (REPLACE_WITH_MODEL_DIR), "
                                 "data.train_files (REPLACE_WITH_TRAIN_FILE), data.val_files (REPLACE_WITH_VAL_FILE): "
                                 "set them in the file or override (e.g. model.path=...)"]
    data = tmp_path / "new.jsonl"
    data.write_text("{}\n")
    # --data fills data.train_files; what is left is named alone
    code, err = _refusal(capsys, ["pipeline", "run", "--config", TINY_GRPO, "--data", str(data), "model.path=/m",
                                  "--output-dir", str(tmp_path / "w")])
    assert code == 2 and err == ["rlcore: error: --config: still holds placeholder data.val_files (REPLACE_WITH_VAL_FILE): "
                                 "set it in the file or override (e.g. data.val_files=...)"]
    # --reward model fills the policy's reward_model.path; the reward model's own config is checked too
    rm = str(ROOT / "rlcore" / "configs" / "tiny_rm.yaml")
    code, err = _refusal(capsys, ["pipeline", "run", "--config", str(ROOT / "rlcore" / "configs" / "tiny_grpo_rm.yaml"),
                                  "--reward", "model", "--reward-config", rm, "model.path=/m", "data.train_files=[/t]",
                                  "data.val_files=[/v]", "--reward-override", "model.path=/m"])
    assert code == 2 and err == ["rlcore: error: --reward-config: still holds placeholders data.train_files "
                                 "(REPLACE_WITH_DPO_TRAIN_FILE), data.val_files (REPLACE_WITH_DPO_VAL_FILE): set them in the "
                                 "file or override (e.g. data.train_files=...)"]
    assert not (tmp_path / "prefect").exists() and not (tmp_path / "mlflow.db").exists()  # nothing started


def test_pipeline_checks_pass_what_the_pipeline_fills_in_itself() -> None:
    """The tiny example (every recipe, --reward model too): model and data paths come from the example
    the flow builds; a served deployment without a cron schedule gets its data from events."""
    from rlcore.algorithms import names_where
    from rlcore.pipeline_checks import check_pipeline_inputs

    for algorithm in names_where(generates=True):
        for reward in ("rule", "model"):
            args = cli.parse_args(["pipeline", "run", "--algorithm", algorithm, "--reward", reward])
            check_pipeline_inputs(cli._pipeline_inputs(args), None)
    served = cli._pipeline_inputs(cli.parse_args(["pipeline", "serve", "--config", TINY_GRPO, "model.path=/m",
                                                  "data.val_files=[/v]"]))
    check_pipeline_inputs(served, None, data_from_events=True)
    with pytest.raises(RLCoreError, match=r"^--config: still holds placeholder data.train_files \(REPLACE_WITH_TRAIN_FILE\)"):
        check_pipeline_inputs(served, None)  # a cron run would train on the config's files
