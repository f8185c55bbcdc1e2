"""`rlcore` command line: train from a config (RL or SFT), read a run's trace, build the tiny example, run the pipeline.

rlcore's own errors (a bad config, data file, reward function, checkpoint or path, and a run
that stopped itself) are printed as their message alone, the traceback only with -v (anywhere
on the command line); exit status 2 when the input was refused, 3 when a run stopped itself, 4
when a worker was lost (its process or its node died, or it hung): rerunning resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import rlcore
from rlcore.algorithms import names_where
from rlcore.config import Config, load_config, load_sft_config
from rlcore.console_log import configure_logging, redacted_excepthook
from rlcore.errors import RLCoreError
from rlcore.lifecycle.job_server import TIMEOUT_S as JOB_SERVER_TIMEOUT_S
from rlcore.lifecycle.retry import LOOKUP_RETRIES, STAGE_RETRIES
from rlcore.pipeline_checks import check_job_server, check_pipeline_inputs, ray_address
from rlcore.pipeline_summary import format_summary
from rlcore.redact import redact_text

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def _cmd_train(args: argparse.Namespace) -> int:
    """Train from a config; with `registry.webhook_url` set, POST the same notifications as the
    pipeline: `finished` (or `health_stop` when the run stopped itself, `failed` on an error)."""
    config = load_config(args.config, args.overrides)  # first: a typo is reported before the trainer loads
    from rlcore.lifecycle.notify import notify
    from rlcore.trainer.run import run_training
    from rlcore.trainer.run_state import TrainingStopped

    url = config.registry.webhook_url
    about = {"command": "train", "config": str(Path(args.config).resolve()), "algorithm": config.algorithm.name,
             "run_dir": str(Path(config.trainer.output_dir).resolve())}
    try:
        history = run_training(config)
    except TrainingStopped as stop:
        notify(url, "health_stop", {**about, "reason": str(stop), "checkpoint": _latest_checkpoint(config)})
        raise
    except BaseException as err:
        error = "".join(traceback.format_exception_only(type(err), err)).strip()
        checkpoint = _latest_checkpoint(config)
        notify(url, "failed", {**about, "error": error, "checkpoint": checkpoint})
        if user_error_exit(err) == EXIT_WORKER_LOST:
            err.add_note(f"the run's newest intact checkpoint: {checkpoint or 'none yet'}; the same command resumes "
                         "from it (trainer.resume=auto)")
        raise
    last = history[-1] if history else {}
    shown = {k: v for k, v in last.items() if k.startswith(("val/", "acc/", "reward/"))}
    notify(url, "finished", {**about, "steps_run": len(history), "total_steps": config.trainer.total_steps,
                             "metrics": shown, "checkpoint": _latest_checkpoint(config)})
    print(redact_text(json.dumps(shown, indent=1)))
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    """Supervised fine-tuning from a config; prints the output model folder (an RL config's
    `model.path`) and the last step's losses."""
    config = load_sft_config(args.config, args.overrides)  # first: a typo is reported before torch loads
    from rlcore.trainer.sft import run_sft_config

    model_dir, history = run_sft_config(config)
    last = history[-1] if history else {}
    shown = {k: v for k, v in last.items() if k.endswith("/loss")}
    print(redact_text(json.dumps({"model": str(model_dir.resolve()), "steps": last.get("step", 0), **shown}, indent=1)))
    return 0


def _cmd_pipeline_stage(args: argparse.Namespace) -> int:
    """One pipeline stage from a file the flow wrote: what a stage's Ray job runs (`--ray-address`).
    The stage's result is the last line printed (rlcore.lifecycle.ray_job.RESULT_MARK)."""
    from rlcore.lifecycle.ray_job import RESULT_MARK, run_stage_file

    result = run_stage_file(args.file)
    print(RESULT_MARK + json.dumps(result, default=str), flush=True)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    """Which layouts of the config's roles fit on the given hardware (`rlcore.plan`). The
    arguments and the config are checked first, before torch loads."""
    from rlcore.flops import PEAK_BF16_FLOPS, peak_flops_for
    from rlcore.plan.hardware import Hardware, PlanInputError, parse_fraction, parse_size, shown

    hardware = Hardware(args.nodes, args.devices_per_node, parse_size(args.device_memory), parse_fraction(args.headroom))
    if args.device is not None and peak_flops_for(args.device) is None:
        raise PlanInputError(f"--device {shown(args.device)}: no known peak for it (known: {', '.join(PEAK_BF16_FLOPS)})")
    config = load_config(args.config, args.overrides)
    from rlcore.plan import plan_run, render

    report = plan_run(config, hardware, exact=args.exact, tensor_parallel=args.tensor_parallel, progress=_say)
    print(render(report, args.config, args.device))
    return 0


def _cmd_trace(args: argparse.Namespace) -> int:
    """One recorded trajectory of a run's trace.jsonl (a training step's) or, with --validation,
    val_trace.jsonl (a validation's), as a readable conversation; unreadable lines skipped are named
    in one note."""
    from rlcore.trainer.tracing import format_trajectory, recorded_conversation

    found = recorded_conversation(args.run_dir, args.step, args.sample, validation=args.validation)
    if found.note:
        print(f"rlcore: note: {redact_text(found.note)}", file=sys.stderr)
    try:
        text = format_trajectory(found.step, found.sample, args.sample, found.recorded, validation=args.validation)
        print(redact_text(text), flush=True)  # a trace written before the redaction policy, too
    except BrokenPipeError:  # `rlcore trace RUN | head -1`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
    return 0


def _latest_checkpoint(config: Config) -> str | None:
    """The run's newest complete checkpoint (what a notified operator would pick up), if any; None
    when it cannot be read (a notification must not hide the error it reports)."""
    from rlcore.checkpoint import CheckpointManager

    try:
        latest = CheckpointManager(Path(config.trainer.output_dir) / "checkpoints").latest()
    except Exception:  # noqa: BLE001
        return None
    return str(latest.resolve()) if latest is not None else None


def _cmd_example_build(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else None
    if args.task == "tool":
        from rlcore.example.tool_build import build_tool_example

        example = build_tool_example(out, seed=args.seed, force=args.force, log_fn=_say)
    else:
        from rlcore.example import build_tiny_example

        example = build_tiny_example(out, seed=args.seed, force=args.force, log_fn=_say)
    print(example.model_dir)
    return 0


def _say(line: str) -> None:
    """Progress of a long step (the example's build) on stderr: stdout is the command's answer."""
    print(line, file=sys.stderr, flush=True)


def tiny_example_overrides(example, output_dir: str) -> list[str]:
    """Model, data and output paths of a built tiny example (see rlcore.example.overrides)."""
    from rlcore.example.overrides import tiny_example_overrides as overrides

    return overrides(example, output_dir)


def _quiet_defaults() -> None:
    """No telemetry (no network here), unless the user set these explicitly."""
    for key, value in (("PREFECT_SERVER_ANALYTICS_ENABLED", "false"), ("MLFLOW_DISABLE_TELEMETRY", "true"),
                       ("DO_NOT_TRACK", "true")):
        os.environ.setdefault(key, value)


def load_flow(name: str = "rl_pipeline"):
    """A flow of the installed package (rlcore.flows.<name>): the repository's flows/ and
    prefect.yaml re-export these, and a wheel carries them."""
    import importlib

    return getattr(importlib.import_module(f"rlcore.flows.{name}"), name)


def _pipeline_inputs(args: argparse.Namespace) -> dict:
    """Flow parameters: the given config, or the tiny example with its embedded config (and, with
    `--reward model`, the embedded reward-model config on the example's preference set)."""
    example = args.config is None
    # the tiny example's classic-RLHF recipes (tiny_<algorithm>_rm.yaml) keep the policy near its start with a KL term
    recipe = f"tiny_{args.algorithm}_rm.yaml" if args.reward == "model" else f"tiny_{args.algorithm}.yaml"
    config_path = Path(args.config) if args.config else CONFIG_DIR / recipe
    sft = None
    if args.sft_data or args.sft_config:
        sft = {"data_path": str(Path(args.sft_data).resolve()) if args.sft_data else None,
               "config_path": str(Path(args.sft_config).resolve()) if args.sft_config else None, "overrides": []}
    inputs = {
        "config_path": str(config_path.resolve()),
        "overrides": list(args.overrides),
        "example": example,
        "workdir": str(Path(args.output_dir).resolve()),
        "sft": sft,
    }
    if args.ray_address is not None:  # only when given: a deployment made without it keeps the flow's default
        inputs["ray_address"] = ray_address(args.ray_address)
    if args.retries is not None:  # likewise
        inputs["retries"] = args.retries
    if args.reward == "model":
        if args.reward_config is None and not example:
            raise RLCoreError("--reward model: give the reward model's training config (--reward-config FILE, "
                              "algorithm.name: rm); only the tiny example has an embedded one")
        rm_path = Path(args.reward_config) if args.reward_config else CONFIG_DIR / "tiny_rm.yaml"
        inputs.update(reward="model", reward_config_path=str(rm_path.resolve()), reward_overrides=list(args.reward_override))
    elif args.reward_config or args.reward_override:
        raise RLCoreError("--reward-config and --reward-override need --reward model")
    return inputs


EPHEMERAL_TIMEOUT_VAR = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
EPHEMERAL_TIMEOUT_S = 120  # Prefect's 20 s is too short on a loaded 2-core machine


class PrefectStartError(RLCoreError):
    """Prefect's ephemeral server did not answer in time; the message names the setting."""


def _ephemeral_timeout_default() -> None:
    """A longer start-up timeout for the ephemeral Prefect server, unless the user set one; must
    run before Prefect is imported (it reads its settings then)."""
    os.environ.setdefault(EPHEMERAL_TIMEOUT_VAR, str(EPHEMERAL_TIMEOUT_S))


def _cmd_pipeline_run(args: argparse.Namespace) -> int:
    """The main job: the rl_pipeline flow (data_prep -> train -> evaluate -> promote) on the tiny
    example, with Prefect in ephemeral mode and MLflow in a SQLite file here."""
    inputs = _pipeline_inputs(args)
    check_pipeline_inputs(inputs, args.data)
    if "ray_address" in inputs:
        check_job_server(inputs["ray_address"])
    if inputs["example"]:  # built here with progress on stderr (first time ~1 min), not silently in the flow
        from rlcore.example import build_tiny_example

        build_tiny_example(seed=0, log_fn=_say)
    _quiet_defaults()
    _ephemeral_timeout_default()
    from rlcore.lifecycle.prefect_db import use_own_database_if_foreign

    use_own_database_if_foreign()
    flow = load_flow()
    from rlcore.lifecycle.flow_secrets import sealed

    try:
        with sealed({**inputs, "data_path": args.data}) as stored:  # Prefect stores the parameters: no secrets
            summary = flow(**stored)
    except RuntimeError as err:
        if "ephemeral Prefect API server" not in str(err):
            raise
        raise PrefectStartError(
            f"Prefect's ephemeral API server did not start within {os.environ[EPHEMERAL_TIMEOUT_VAR]} s "
            f"({EPHEMERAL_TIMEOUT_VAR}): set it higher on a loaded machine, or start a server "
            "(`prefect server start`) and set PREFECT_API_URL=http://127.0.0.1:4200/api") from err
    print(redact_text(json.dumps(summary, indent=1, default=str) if args.json else format_summary(summary)))
    return 0


def _require_server() -> str | None:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        print("rlcore: serving needs a Prefect server: run `prefect server start` and set "
              "PREFECT_API_URL=http://127.0.0.1:4200/api", file=sys.stderr)
    return url


def _cmd_pipeline_serve(args: argparse.Namespace) -> int:
    """Deploy rl_pipeline with a cron schedule and a data-event trigger; run its flow runs here."""
    _quiet_defaults()
    if not _require_server():
        return 2
    from rlcore.flows.serve import serve_until_stopped

    inputs = _pipeline_inputs(args)
    # The config as run (the example's paths change neither its webhook nor its MLflow store): runs
    # that crash unseen are notified by the server, whatever happens to the processes running them.
    config = load_config(inputs["config_path"], inputs["overrides"])
    check_pipeline_inputs(inputs, None, data_from_events=not args.cron)  # as `pipeline run`: refused before serving
    if "ray_address" in inputs:
        check_job_server(inputs["ray_address"])
    if args.unresponsive_after <= args.heartbeat:
        raise RLCoreError(f"--unresponsive-after ({args.unresponsive_after:g} s) must exceed --heartbeat ({args.heartbeat:g} s)")
    print(f"rlcore: serving rl_pipeline (cron {args.cron or 'none'}{f', watching {args.watch}' if args.watch else ''}) "
          f"on {redact_text(str(_require_server()))}; Ctrl-C or SIGTERM stops it", file=sys.stderr, flush=True)
    serve_until_stopped(load_flow(), inputs, cron=args.cron or None, watch_dir=args.watch,
                        watch_interval_s=args.watch_interval, limit=args.limit, webhook_url=config.registry.webhook_url,
                        unresponsive_after_s=args.unresponsive_after, heartbeat_s=args.heartbeat, config=config,
                        concurrency_limit=args.concurrency_limit)
    return 0


def _cmd_pipeline_emit(args: argparse.Namespace) -> int:
    """Announce a data file: the served pipeline's trigger runs the pipeline on it."""
    _quiet_defaults()
    if not _require_server():
        return 2
    from rlcore.lifecycle.events import emit_data_arrived

    path = Path(args.path)
    if not path.is_file():
        print(f"rlcore: no such data file: {path}", file=sys.stderr)
        return 2
    print(emit_data_arrived(path))
    return 0


def _cmd_runs(args: argparse.Namespace) -> int:
    """The recent pipeline runs, or two registered versions side by side (rlcore.lifecycle.runs_report)."""
    from rlcore.lifecycle import runs_report as report

    store = report.open_store(args.tracking_uri or report.default_uri(), args.experiment)
    if args.compare:
        rows = report.compare_versions(store, args.model, *args.compare)
        print(json.dumps(report.compare_json(rows), indent=2) if args.json else report.format_compare(rows))
        return 0
    runs = report.recent_runs(store, args.limit)
    if not runs:
        raise RLCoreError(f"--experiment: no pipeline runs in experiment {args.experiment!r} at {store.tracking_uri}")
    print(json.dumps(report.runs_json(runs), indent=2) if args.json else report.format_runs(runs))
    return 0


def _count(least: int):
    """An argparse type: a whole number >= `least` (the option's name is in argparse's message)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected {least} or more, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlcore", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="INFO logs, and the traceback behind an error (also accepted after the subcommand)")
    parser.add_argument("--version", action="version", version=f"rlcore {rlcore.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run a training config: rlcore train CONFIG [dotted.key=value ...]")
    train.add_argument("config")
    train.add_argument("overrides", nargs="*")
    train.set_defaults(func=_cmd_train)

    sft = sub.add_parser("sft", help="supervised fine-tuning on your data: rlcore sft CONFIG [dotted.key=value ...]; "
                         "writes trainer.output_dir/model, an HF folder RL configs start from")
    sft.add_argument("config")
    sft.add_argument("overrides", nargs="*")
    sft.set_defaults(func=_cmd_sft)

    plan = sub.add_parser("plan", help="which layouts of a run fit: rlcore plan CONFIG --nodes N --devices-per-node G "
                          "--device-memory 80GiB [dotted.key=value ...] (simulated on fake tensors, no device needed)")
    plan.add_argument("config")
    plan.add_argument("overrides", nargs="*", help="dotted.key=value (before or after the options)")
    plan.add_argument("--nodes", type=int, default=1)
    plan.add_argument("--devices-per-node", type=int, default=8)
    plan.add_argument("--device-memory", required=True, help="memory of one device: 80GiB, 141GiB, 96GB")
    plan.add_argument("--headroom", default="10%", help="share of each device a layout may not use (CUDA context, NCCL, "
                      "allocator fragmentation: not simulated); default 10%%")
    plan.add_argument("--device", default=None, help="device name (H100, A100, ...): also print each role's seconds per step "
                      "at its dense bf16 peak")
    plan.add_argument("--exact", action="store_true", help="simulate every decoder layer instead of extrapolating from two")
    plan.add_argument("--tensor-parallel", type=int, action="append", default=None, metavar="TP",
                      help="plan the trained roles at this tensor-parallel size only (repeatable; default: every size the "
                      "model takes within a node)")
    plan.set_defaults(func=_cmd_plan, overrides_anywhere=True)

    trace = sub.add_parser("trace", help="print one recorded trajectory of a run (trace.jsonl) as a conversation: "
                           "rlcore trace RUN_DIR [--step N] [--sample K] [--validation]")
    trace.add_argument("run_dir", help="the run's trainer.output_dir")
    trace.add_argument("--step", type=int, default=None, help="default: the last step that recorded conversations")
    trace.add_argument("--sample", type=int, default=0, help="which of the step's trainer.trace_samples conversations")
    trace.add_argument("--validation", action="store_true",
                       help="a conversation of the validation at --step (0: before training; val_trace.jsonl), not of training")
    trace.set_defaults(func=_cmd_trace)

    example = sub.add_parser("example", help="the built-in tiny example")
    example_sub = example.add_subparsers(dest="example_command", required=True)
    build = example_sub.add_parser("build", help="build (or reuse) the tiny model and data; prints the model folder")
    build.add_argument("--task", choices=["arith", "tool"], default="arith",
                       help="arith: two-digit additions (default); tool: four-digit additions with a calculator tool "
                       "(rlcore/configs/tiny_tool_grpo.yaml)")
    build.add_argument("--out", default=None)
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--force", action="store_true")
    build.set_defaults(func=_cmd_example_build)

    pipeline = sub.add_parser("pipeline", help="the end-to-end pipeline")
    pipeline_sub = pipeline.add_subparsers(dest="pipeline_command", required=True)
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", default=None, help="a training config (default: the tiny example's embedded one)")
        p.add_argument("--algorithm", choices=names_where(generates=True), default="grpo", help="which tiny-example config")
        p.add_argument("--output-dir", default="runs/pipeline", help="work directory: prepared data, runs, champion cache")
        p.add_argument("--sft-data", default=None, help="first fine-tune the base model on this SFT file (verl's SFT schema): "
                       "RL then starts from, and measures KL against, that warm start (reused while its inputs are the same)")
        p.add_argument("--sft-config", default=None, help="the warm start's SFT config (an `rlcore sft` config; model.path "
                       "is the RL config's, and --sft-data, when given, its data.train_files)")
        p.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
        p.add_argument("--reward", choices=["rule", "model"], default="rule",
                       help="model: classic RLHF; train a reward model on preference pairs, register and gate it "
                            "(its own MLflow model), then train the policy against the champion reward model")
        p.add_argument("--reward-config", default=None, help="with --reward model: the reward model's training config "
                       "(algorithm.name: rm; default for the tiny example: its embedded tiny_rm.yaml)")
        p.add_argument("--reward-override", action="append", default=[], metavar="KEY=VALUE",
                       help="with --reward model: a dotted override of the reward model's config (repeatable)")
        p.add_argument("--ray-address", default=None, metavar="URL",
                       help="run the train and evaluate stages as Ray jobs on this cluster's job server (the head "
                            "node's dashboard, http://HEAD:8265); the work directory and MLflow store must be at the "
                            "same paths there. Checked first: resolving its host, connecting and the job server's "
                            f"answer must each finish within {JOB_SERVER_TIMEOUT_S:g} s. Default: every stage runs in this "
                            "process")
        p.add_argument("--retries", type=_count(0), default=None, metavar="N",
                       help=f"try each stage again up to N times after a transient failure (I/O, the tracking store; "
                            f"default {STAGE_RETRIES}; the registry reads {LOOKUP_RETRIES}); a data or config error, or the "
                            "death of a process of the run (a worker killed, a broken pipe), is never retried")

    run = pipeline_sub.add_parser("run", help="run rl_pipeline once (ephemeral Prefect, SQLite MLflow here) and print a summary")
    common(run)
    run.add_argument("--data", default=None, help="train on this data file instead of the config's")
    run.add_argument("--json", action="store_true", help="print the summary as JSON")
    run.set_defaults(func=_cmd_pipeline_run, overrides_anywhere=True)
    serve = pipeline_sub.add_parser("serve", help="deploy rl_pipeline (cron + data-event trigger) on PREFECT_API_URL and serve it")
    common(serve)
    serve.add_argument("--cron", default="0 3 * * *", help="retraining schedule ('' for none)")
    serve.add_argument("--watch", default=None, help="directory whose new data files trigger a run")
    serve.add_argument("--watch-interval", type=float, default=5.0)
    serve.add_argument("--limit", type=int, default=1, help="concurrent flow runs of this serving process")
    serve.add_argument("--concurrency-limit", type=_count(1), default=None, metavar="N",
                       help="concurrent runs of the deployment on the Prefect server, whoever serves them (runs "
                            "beyond it wait in Scheduled, Prefect's ENQUEUE); default: no limit (--limit per process)")
    serve.add_argument("--heartbeat", type=float, default=30.0, metavar="SECONDS",
                       help="a served run's heartbeat interval (rlcore's liveness events)")
    serve.add_argument("--unresponsive-after", type=float, default=90.0, metavar="SECONDS",
                       help="a run that sent no heartbeat for this long is marked crashed by the Prefect server (and, "
                            "with registry.webhook_url, notified), e.g. when the machine running it died")
    serve.set_defaults(func=_cmd_pipeline_serve, overrides_anywhere=True)
    stage = pipeline_sub.add_parser("stage", help="run one pipeline stage from a file the flow wrote (what a stage's "
                                    "Ray job runs with --ray-address)")
    stage.add_argument("file")
    stage.set_defaults(func=_cmd_pipeline_stage)
    emit = pipeline_sub.add_parser("emit", help="emit rlcore.data.arrived for a data file (triggers the served pipeline)")
    emit.add_argument("path")
    emit.set_defaults(func=_cmd_pipeline_emit)
    runs = sub.add_parser("runs", help="the recent pipeline runs (state, accuracy, version, decision), or two registered "
                          "versions side by side: rlcore runs [--limit N] | rlcore runs --compare V1 V2")
    runs.add_argument("--tracking-uri", default=None,
                      help="MLflow store; default: $MLFLOW_TRACKING_URI, else sqlite:///<working dir>/mlflow.db (as pipeline run)")
    runs.add_argument("--experiment", default="rlcore", help="MLflow experiment (tracking.experiment; default: rlcore)")
    runs.add_argument("--limit", type=_count(1), default=20, help="how many runs, newest first (default: 20)")
    runs.add_argument("--compare", nargs=2, metavar=("V1", "V2"), help="compare two registered versions of --model")
    runs.add_argument("--model", default="rlcore-tiny", help="registered model for --compare (registry.model_name; default: rlcore-tiny)")
    runs.add_argument("--json", action="store_true", help="print JSON instead of a table")
    runs.set_defaults(func=_cmd_runs)
    return parser


VERBOSE_FLAGS = ("-v", "--verbose")
EXIT_REFUSED = 2  # the config, data, a named file or a checkpoint cannot be used: nothing ran
EXIT_STOPPED = 3  # the run stopped itself (health check, non-finite steps); its work so far is saved
EXIT_WORKER_LOST = 4  # a worker died (its node lost, killed) or hung mid-run; its checkpoints are intact


def pop_verbose(argv: list[str]) -> tuple[list[str], bool]:
    """`argv` without -v/--verbose wherever they stand (before a `--`), and whether one was there,
    so `rlcore train cfg.yaml a=1 -v` works like `rlcore -v train cfg.yaml a=1`."""
    end = argv.index("--") if "--" in argv else len(argv)
    kept = [a for a in argv[:end] if a not in VERBOSE_FLAGS] + argv[end:]
    return kept, len(kept) != len(argv)


def user_error_exit(err: BaseException) -> int | None:
    """The exit status for one of rlcore's own errors (its message says it all), None for anything
    else (a bug: its traceback is the useful part). CheckpointError and TrainingStopped are
    rlcore's own too, though they do not derive from RLCoreError. They are looked up among the
    modules already imported (an instance's class is): importing them would import torch, seconds
    before a config typo is reported."""
    stopped = getattr(sys.modules.get("rlcore.trainer.run_state"), "TrainingStopped", None)
    checkpoint_error = getattr(sys.modules.get("rlcore.checkpoint"), "CheckpointError", None)
    ray_backend = sys.modules.get("rlcore.controller.ray_backend")
    lost = tuple(getattr(ray_backend, name) for name in ("WorkerDiedError", "WorkerTimeoutError") if hasattr(ray_backend, name))
    if stopped is not None and isinstance(err, stopped):
        return EXIT_STOPPED
    if lost and isinstance(err, lost):
        return EXIT_WORKER_LOST
    if isinstance(err, RLCoreError) or (checkpoint_error is not None and isinstance(err, checkpoint_error)):
        return EXIT_REFUSED
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed; a subcommand with `overrides_anywhere` (`rlcore plan`, `pipeline run/serve`) also takes its
    dotted.key=value overrides after its options, as its usage shows (argparse gives a `nargs="*"`
    positional the arguments before the first option only: the rest come back unrecognized)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "overrides_anywhere", False) and not any(a.startswith("-") for a in extra):
        args.overrides = [*args.overrides, *extra]  # in command-line order: the overrides after the options come later
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv, verbose = pop_verbose(list(sys.argv[1:] if argv is None else argv))
    args = parse_args(argv)
    verbose = verbose or args.verbose
    configure_logging(verbose)
    sys.excepthook = redacted_excepthook
    # No per-file "Loading weights" bars from transformers (a run loads several models; off a
    # terminal each is a line of carriage returns): rlcore's own progress says where a run is.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        return args.func(args)
    except Exception as err:
        code = user_error_exit(err)
        if code is None:
            raise
        if verbose:
            print(redact_text(traceback.format_exc()), end="", file=sys.stderr)
        what = "training stopped" if code == EXIT_STOPPED else "error"
        # a lost worker: its one-line headline (role, rank, method, node); Ray's own text with -v
        message = str(err).splitlines()[0] if code == EXIT_WORKER_LOST else str(err)
        print(f"rlcore: {what}: {redact_text(message)}", file=sys.stderr)
        for note in getattr(err, "__notes__", ()) if not verbose else ():
            print(f"rlcore: {redact_text(str(note))}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
