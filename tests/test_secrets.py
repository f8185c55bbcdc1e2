"""One redaction policy (rlcore.redact) for every output a person or a server can read. Each kind
of secret is planted in each place it can come from (a config key, a URL in the config, a secret
environment variable's value, an API key or token in a tool's result, a reward function's error
and log, an error message) and every output is searched for it: console and stderr, log records,
the run folder (config.yaml, metrics.jsonl, trace.jsonl), `rlcore trace`, MLflow's store (params,
tags, the files themselves), Prefect's deployment and flow-run parameters, logs, states and events
(through its API). The webhook itself still receives the POST with its credentials, from a
served run too. A real HTTP receiver on 127.0.0.1, real MLflow (SQLite), a real training run of
the tiny example, a real `rlcore pipeline serve` against a Prefect server.

Planted keys are assembled at run time (no key-shaped literal in the source for scanners to flag)."""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

from rlcore.cli import CONFIG_DIR, main, tiny_example_overrides
from rlcore.config import dump_config, load_config
from rlcore.lifecycle.notify import notify
from rlcore.redact import (
    REDACTED,
    is_secret_env_name,
    is_secret_key,
    redact_exception,
    redact_secret,
    redact_text,
    redact_tree,
    redact_url,
    redacts_errors,
)

USER, PASSWORD, PATH_SECRET, TOKEN = "hookuser", "s3cr3t-PW", "T0KENPATH9", "tok-abc123"
SECRETS = (USER, PASSWORD, PATH_SECRET, TOKEN)

# One of each key format rlcore.redact recognises, and values for secret environment variables.
_R = "Ab3dE7gH1jK9mN2pQ5sT8vW4yZ6"  # mixed case and digits, as a random key is
KEYS = {
    "openai": "sk-" + "proj-" + _R + "xY0",
    "anthropic": "sk-" + "ant-api03-" + _R + "_Lm-9Qr",
    "github": "gh" + "p_" + _R + "0123456789",
    "github_pat": "github" + "_pat_" + "11AB2CD3E0" + _R,
    "slack": "xo" + "xb-" + "1234567890-" + _R,
    "aws": "AK" + "IA" + "Q3EGRZ7X5N2PLK4M",
    "google": "AI" + "za" + "Sy" + _R + "abcdefgh",
    "huggingface": "hf" + "_" + "AbCdEfGhIjKlMnOpQrStUvWxYzAbCdEfGh",
    "jwt": "ey" + "JhbGciOiJIUzI1NiJ9" + ".ey" + "JzdWIiOiIxMjM0NTY3ODkwIn0" + ".dBjftJeZ4CVPmB92K27uhbUJU1p1r_wW1gFWFOEjXk",
}
BEARER = "Zm9vYmFyYmF6" + "1234567890abcdef"  # after `Bearer `
PEM = "-----BEGIN " + "RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7Vx1\nq2Zp9Lk\n-----END " + "RSA PRIVATE KEY-----"
ENV_SECRETS = {"GRADER_API_KEY": "grader-7f3a9b2c1d", "RLCORE_TEST_SERVICE_TOKEN": "svc-9c1b7e5d3a",
               "MLFLOW_TRACKING_PASSWORD": "mlflow-pw-55aa", "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG"}
PLANTED = (*KEYS.values(), BEARER, "MIIEowIBAAKCAQEA7Vx1", *ENV_SECRETS.values())


@pytest.fixture
def env_secrets(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The secret environment variables set (and a short one, which redacts nothing)."""
    for name, value in ENV_SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TINY_TOKEN", "1")
    return ENV_SECRETS


def planted_in(text: str) -> list[str]:
    """The planted keys and secret values found in `text`."""
    return [s for s in (*SECRETS, *PLANTED) if s in text]


def hostile_text() -> str:
    """A text (a tool's result, an error) holding every kind of secret once."""
    keys = "\n".join(f"{name} key: {key}" for name, key in KEYS.items())
    env = " ".join(ENV_SECRETS.values())
    return (f"{keys}\nAuthorization: Bearer {BEARER}\n{PEM}\nenv: {env}\n"
            f"hook: http://{USER}:{PASSWORD}@h.example/x?token={TOKEN}\npassword={PASSWORD}")


class Receiver:
    """An HTTP endpoint on 127.0.0.1 recording each POST's path, Authorization header and body."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        received = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append({"path": self.path, "authorization": self.headers.get("Authorization"),
                                 "body": json.loads(body)})
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def secret_url(self) -> str:
        return f"http://{USER}:{PASSWORD}@127.0.0.1:{self.port}/hook/{PATH_SECRET}?token={TOKEN}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def leaks(text: str) -> list[str]:
    return planted_in(text)


def files_with_secrets(root: Path) -> dict[str, list[str]]:
    """Every file under `root` (text or binary: SQLite, YAML, JSONL) that contains a secret, but
    the user's own files (`root/user`)."""
    found = {}
    for path in root.rglob("*"):
        if path.is_file() and path.relative_to(root).parts[0] != "user":
            data = path.read_bytes()
            hits = [s for s in (*SECRETS, *PLANTED) if s.encode() in data]
            if hits:
                found[str(path.relative_to(root))] = hits
    return found


# ---------------------------------------------------------------------- the redaction itself
def test_url_credentials_are_redacted_and_the_rest_kept():
    url = f"https://{USER}:{PASSWORD}@hooks.example.com:8443/hook/{PATH_SECRET}?token={TOKEN}&sig=zz#frag"
    assert redact_url(url) == f"https://***@hooks.example.com:8443/hook/{PATH_SECRET}?token=***&sig=***#***"
    # a secret value (the webhook) keeps only scheme and host: its path may be the token itself
    assert redact_secret(url) == "https://hooks.example.com:8443/***"
    assert redact_secret("not-a-url-but-secret") == "***" and redact_secret(None) == "None"
    assert redact_url("https://example.com/hook?opaque-token") == "https://example.com/hook?***"
    for plain in ("sqlite:////tmp/x/mlflow.db", "http://127.0.0.1:5000", "/data/train.parquet", "models:/m/3"):
        assert redact_url(plain) == plain and redact_text(f"at {plain} now") == f"at {plain} now"
    assert redact_text(f"unknown url type: '{url}'") == f"unknown url type: '{redact_url(url)}'"


def test_only_secret_keys_of_the_config_are_secret():
    """The config's own keys: exactly the webhook is a secret (no false alarm on `*_tokens`)."""
    cfg = load_config(CONFIG_DIR / "tiny_grpo.yaml", ["model.path=/m", "data.train_files=[/d.parquet]"])

    def keys(tree: dict[str, Any], prefix: str = "") -> Iterator[str]:
        for k, v in tree.items():
            yield from keys(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]

    assert [k for k in keys(cfg.model_dump(mode="json")) if is_secret_key(k)] == ["registry.webhook_url"]
    assert is_secret_key("tracking.api_token") and is_secret_key("x.password") and not is_secret_key("tok.pad_token")


def test_config_dump_redacts_but_the_config_keeps_the_secret():
    url = f"https://{USER}:{PASSWORD}@h.example/hook/{PATH_SECRET}?token={TOKEN}"
    cfg = load_config(CONFIG_DIR / "tiny_grpo.yaml", [
        "model.path=/m", f"data.train_files=['s3://bucket/train.parquet?X-Amz-Signature={TOKEN}']",
        f"registry.webhook_url={url}"])
    text = dump_config(cfg)
    assert leaks(text) == [] and "webhook_url: https://h.example/***" in text
    assert "s3://bucket/train.parquet?X-Amz-Signature=***" in text
    assert cfg.registry.webhook_url == url  # what the POST uses
    assert redact_tree(cfg.model_dump(mode="json"))["registry"]["webhook_url"] == "https://h.example/***"


def test_every_kind_of_secret_is_redacted_from_text(env_secrets):
    text = hostile_text()
    shown = redact_text(text)
    assert planted_in(shown) == []
    # what is around a secret stays readable: the key's name, the scheme, the host
    for name in KEYS:
        assert f"{name} key: {REDACTED}" in shown
    assert f"Authorization: Bearer {REDACTED}" in shown and f"password={REDACTED}" in shown
    assert f"http://{REDACTED}@h.example/x?token={REDACTED}" in shown and "env: *** *** *** ***" in shown
    for key in (*KEYS.values(), BEARER and f"Bearer {BEARER}", *ENV_SECRETS.values()):
        assert planted_in(redact_text(f"use {key}, then stop")) == [], key
    assert redact_text(f'{{"api_key": "{PASSWORD}", "X-Api-Key": "{PASSWORD}"}}') == '{"api_key": "***", "X-Api-Key": "***"}'
    assert redact_text(PEM.split("-----END")[0]) == REDACTED  # a block cut before its end: the rest of the text
    assert redact_text(f"x {PEM} y") == f"x {REDACTED} y"


def ordinary_texts(n: int = 400) -> list[str]:
    """What logs, traces and configs are full of: numbers, ids, digests, paths, model text."""
    rng = random.Random(0)
    # (a secret-named key before `=` or `:` is an assignment the policy redacts, not ordinary text)
    words = ["step", "reward", "tokens", "token_ids", "keys", "monkey", "sk-learn", "hf_cache", "task-runner",
             "Bearer", "bearer", "Basic", "api", "the", "model", "answer", "=", ":", "#"]
    texts = [
        "12:01:02.345 | INFO    | rlcore.trainer - step 3/20 reward/mean=0.53 actor/pg_loss=-0.0123 time/step_s=1.2",
        "max_tokens=512 eos_token=</s> pad_token: <pad> mask_token=[MASK] num_tokens 12345678",
        "token: 151643", "bad token: <|im_end|>", "Unexpected token: identifier", "first token: Hello",
        "The bearer of bad news; Bearer authentication; Basic arithmetic: 8382+2427=10809",
        "<|im_start|>user\n8382+2427=<|im_end|>\n<|im_start|>assistant\n#### 10809<|im_end|>",
        "/data/sk-learn-experiments-2024/run1/model.safetensors", "/tmp/hf_cache_directory_for_tests_2024/x",
        "/home/u/.cache/rlcore/examples/tiny-0/model/tokenizer.json", "s3://bucket/data/train.parquet",
        "sqlite:////tmp/x/mlflow.db", "http://127.0.0.1:5000/#/experiments/1", "models:/rlcore-tiny@champion",
        "AKIA", "ASIAPACIFICREGIONXYZ", "eyJ", "xoxo-friends", "ghp_short", "hf_model", "sk-1234",
        "a password reset link was sent; the secret garden; the key is in the token bucket",
    ]
    for _ in range(n):
        kind = rng.randrange(6)
        if kind == 0:
            texts.append(str(uuid.UUID(int=rng.getrandbits(128))))
        elif kind == 1:
            texts.append(f"{rng.getrandbits(256):064x}")  # a SHA-256 digest
        elif kind == 2:
            texts.append(repr(rng.uniform(-1e9, 1e9)) + " " + str(rng.getrandbits(60)))
        elif kind == 3:
            texts.append("/" + "/".join(rng.choice(words).strip("=:#") or "x" for _ in range(rng.randint(1, 6))) + ".json")
        else:
            texts.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))))
    return texts


def test_ordinary_text_is_returned_byte_for_byte(env_secrets):
    """No false alarm on what logs and traces are made of; a short secret value (TINY_TOKEN=1)
    redacts nothing."""
    changed = [t for t in ordinary_texts() if redact_text(t) != t]
    assert changed == []


def test_secret_environment_variables_are_known_by_name():
    secret = ["HF_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD", "DATABRICKS_TOKEN",
              "RLCORE_WEBHOOK_URL", "GITHUB_TOKEN", "ANTHROPIC_API_KEY", "CLIENT_SECRET", "DB_PASSWORD", "SLACK_WEBHOOK"]
    plain = ["PATH", "HOME", "TOKENIZERS_PARALLELISM", "HF_HOME", "GOOGLE_APPLICATION_CREDENTIALS", "OMP_NUM_THREADS",
             "PREFECT_API_URL", "AWS_ACCESS_KEY_ID", "SECRETS_DIR", "MAX_TOKENS", "RLCORE_FLOW_SECRETS"]
    assert [n for n in secret if not is_secret_env_name(n)] == [] and [n for n in plain if is_secret_env_name(n)] == []


def test_webhook_url_from_the_environment(monkeypatch):
    from rlcore.config import WEBHOOK_ENV

    base = ["model.path=/m", "data.train_files=[/d.parquet]"]
    monkeypatch.setenv(WEBHOOK_ENV, "https://hooks.example/T0/B0/xyz")
    assert load_config(CONFIG_DIR / "tiny_grpo.yaml", base).registry.webhook_url == "https://hooks.example/T0/B0/xyz"
    given = load_config(CONFIG_DIR / "tiny_grpo.yaml", [*base, "registry.webhook_url=https://other.example/h"])
    assert given.registry.webhook_url == "https://other.example/h"  # the config's own wins


# ---------------------------------------------------------------------- logs and error messages
def test_log_records_are_redacted_whoever_logs_them(env_secrets):
    """rlcore's loggers, Prefect's and any library's: messages, arguments and tracebacks."""
    import io

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    loggers = [logging.getLogger(n) for n in ("rlcore.trainer", "prefect.flow_runs", "urllib3.connectionpool")]
    levels = [lg.level for lg in loggers]  # put back after: a later test of this process reads them (run_state.announce)
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        for lg in loggers:
            lg.warning("calling with %s", hostile_text())
            try:
                raise RuntimeError(f"refused: {KEYS['openai']} {ENV_SECRETS['GRADER_API_KEY']}")
            except RuntimeError:
                lg.exception("the call failed")
        record = logging.getLogger("rlcore.trainer").makeRecord("rlcore.trainer", logging.INFO, __file__, 1,
                                                                "step %d of %d", (3, 20), None)
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
    out = stream.getvalue()
    assert planted_in(out) == [] and out.count("RuntimeError: refused: *** ***") == 3
    assert record.msg == "step %d of %d" and record.args == (3, 20)  # a record without a secret: as made


def test_error_messages_hold_no_secret(env_secrets, capsys):
    bad = f"/nonexistent/{KEYS['github']}/{ENV_SECRETS['RLCORE_TEST_SERVICE_TOKEN']}.yaml"
    assert main(["train", bad]) == 2
    err = capsys.readouterr().err
    assert err == "rlcore: error: config file not found: /nonexistent/***/***.yaml\n"
    assert main(["train", bad, "-v"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and planted_in(err) == []
    # an error of any type keeps its type, its message loses the secret
    oserror = redact_exception(FileNotFoundError(2, "No such file or directory", bad))
    assert isinstance(oserror, FileNotFoundError) and planted_in(str(oserror)) == []


def test_every_prefect_task_and_flow_redacts_its_errors():
    """Prefect stores a failed task's or flow's message (its state) where the API serves it."""
    import importlib
    import pkgutil

    import prefect

    import rlcore.flows

    found, bare = [], []
    for info in pkgutil.iter_modules(rlcore.flows.__path__):
        module = importlib.import_module(f"rlcore.flows.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, (prefect.Task, prefect.Flow)) and obj.fn.__module__ == module.__name__:
                found.append(name)
                if not getattr(obj.fn, "rlcore_redacts_errors", False):
                    bare.append(f"{module.__name__}.{name}")
    assert len(found) >= 10 and bare == []

    @redacts_errors
    def fails(path: str) -> None:
        raise FileNotFoundError(f"no such file {path}")

    with pytest.raises(FileNotFoundError, match=r"^no such file /x/\*\*\*$"):  # the same type: retries and exit codes hold
        fails(f"/x/{KEYS['github']}")


# ---------------------------------------------------------------------- trace.jsonl and `rlcore trace`
def hostile_sample() -> dict[str, Any]:
    """A sample record as the trainer collects it, secrets in every text a tool call touches."""
    secret = hostile_text()
    return {"uid": "u0", "request_id": "r0", "reward": 1.0, "response_length": 3, "finish": "answer",
            "prompt": [{"role": "user", "content": f"look up {KEYS['aws']}"}],
            "turns": [{"kind": "assistant", "turn": 1, "tokens": 5, "text": f"calling with {KEYS['anthropic']}"},
                      {"kind": "tool", "tool": "search", "arguments": {"q": KEYS["slack"], "api_key": PASSWORD},
                       "ok": True, "latency_s": 0.1, "result": secret},
                      {"kind": "tool", "tool": "search", "arguments": {"q": "y"}, "ok": False, "latency_s": 0.1,
                       "error": f"HTTP 401: {secret}", "result": ""}]}


def test_trace_and_rlcore_trace_hold_no_secret(env_secrets, tmp_path, capsys):
    from rlcore.trainer.tracing import step_record

    run = tmp_path / "run"
    run.mkdir()
    samples = [hostile_sample(), {**hostile_sample(), "request_id": "r1"}]  # one recorded whole, one its ids and errors
    record = step_record(1, "on", {"phases": {}, "samples": samples}, {}, {}, conversations=1)
    (run / "trace.jsonl").write_text(json.dumps(record) + "\n")
    assert planted_in((run / "trace.jsonl").read_text()) == []
    assert main(["trace", str(run)]) == 0
    out = capsys.readouterr().out
    assert planted_in(out) == [] and "[tool search] openai key: ***" in out and "error: HTTP 401: openai key: ***" in out

    # a trace written before this policy (its texts in clear) is shown redacted all the same
    old = tmp_path / "old"
    old.mkdir()
    (old / "trace.jsonl").write_text(json.dumps({"step": 1, "samples": [{**hostile_sample(), "conversation": True}]}) + "\n")
    assert main(["trace", str(old)]) == 0
    out = capsys.readouterr().out
    assert planted_in(out) == [] and "[tool search] openai key: ***" in out


# ---------------------------------------------------------------------- the webhook
def test_webhook_posts_with_its_credentials_and_logs_none_of_them(receiver, caplog, env_secrets):
    caplog.set_level(logging.DEBUG)
    assert notify(receiver.secret_url, "failed", {"steps": 1, "error": hostile_text()})
    post = receiver.posts[0]
    assert post["path"] == f"/hook/{PATH_SECRET}?token={TOKEN}" and post["body"]["event"] == "failed"
    assert post["authorization"] == "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    # what the notification reports (an error's message) is redacted like any other output
    assert planted_in(json.dumps(post["body"])) == [] and "openai key: ***" in post["body"]["error"]
    # a failing one is logged, redacted (a closed port on loopback, and a URL urllib refuses)
    dead = f"http://{USER}:{PASSWORD}@127.0.0.1:9/hook/{PATH_SECRET}?token={TOKEN}"
    assert notify(dead, "failed", {}, timeout_s=2, retries=0) is False
    assert notify(f"htp://{USER}:{PASSWORD}@x/{PATH_SECRET}?token={TOKEN}", "failed", {}, retries=0) is False
    assert "webhook http://127.0.0.1:9/*** failed" in caplog.text
    assert len([r for r in caplog.records if r.name == "rlcore.lifecycle.notify"]) == 2
    assert leaks(caplog.text) == []


# ---------------------------------------------------------------------- a pipeline's params
@pytest.mark.slow  # an MLflow store and a pipeline's start (~3 CPU s); fast: test_every_prefect_task_and_flow_redacts_its_errors
def test_pipeline_params_carry_no_secret(receiver, tmp_path, env_secrets):
    from mlflow.tracking import MlflowClient

    from rlcore.lifecycle.mlflow_store import MlflowStore, ModelRegistry
    from rlcore.lifecycle.pipeline_run import start_pipeline

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(CONFIG_DIR / "tiny_grpo.yaml", [
        "model.path=/m", "data.train_files=[/d.parquet]", f"tracking.mlflow_uri={uri}",
        f"registry.webhook_url={receiver.secret_url}"])
    ctx = start_pipeline(cfg, tmp_path, "secret-run", trigger={"data_path": f"https://h/f.parquet?token={TOKEN}"})
    # a stage's failure, a lineage record and a model version's tags and description, all holding secrets
    store = MlflowStore(uri)
    store.set_tags(ctx["run_id"], {"failure": hostile_text()})
    store.log_json(ctx["run_id"], {"config": {"registry": {"webhook_url": receiver.secret_url}}, "note": hostile_text()},
                   "lineage.json")
    registry = ModelRegistry(store, "secret-model")
    version = registry.register(ctx["run_id"], tags={"reason": hostile_text()}, description=hostile_text())
    registry.set_tags(version.version, {"decision": hostile_text()})
    registry.describe(version.version, hostile_text())
    assert planted_in(json.dumps(registry.get(version.version).__dict__, default=str)) == []
    run = MlflowClient(tracking_uri=uri).get_run(ctx["run_id"])
    assert "openai key: ***" in run.data.tags["failure"]
    assert run.data.params["registry.webhook_url"] == f"http://127.0.0.1:{receiver.port}/***"
    assert run.data.tags["trigger.data_path"] == "https://h/f.parquet?token=***"
    assert leaks(json.dumps(run.data.params)) == [] and leaks(json.dumps(run.data.tags)) == []
    assert files_with_secrets(tmp_path) == {}


# ---------------------------------------------------------------------- Prefect's parameters
def test_flow_parameters_are_stored_redacted_and_the_flow_gets_the_values(receiver, monkeypatch):
    from rlcore.lifecycle.flow_secrets import SECRETS_ENV, SealedSecretError, sealed, unseal

    monkeypatch.delenv(SECRETS_ENV, raising=False)
    inputs = {"overrides": [f"registry.webhook_url={receiver.secret_url}", "trainer.total_steps=2",
                            f"tracking.mlflow_uri=https://{USER}:{PASSWORD}@mlflow.example/"],
              "config_path": "/c/tiny.yaml", "example": True, "sft": {"overrides": [f"x.api_key={PASSWORD}"]},
              "ray_address": f"http://{USER}:{PASSWORD}@head:8265", "data_path": None}
    with sealed(inputs) as stored:
        assert planted_in(json.dumps(stored)) == []
        assert stored["overrides"] == [f"registry.webhook_url=http://127.0.0.1:{receiver.port}/***", "trainer.total_steps=2",
                                       "tracking.mlflow_uri=https://***@mlflow.example/"]
        assert stored["ray_address"] == "http://***@head:8265" and stored["sft"] == {"overrides": ["x.api_key=***"]}
        assert unseal(stored) == inputs  # in the flow (this process, or one it starts)
    with pytest.raises(SealedSecretError, match=r"^overrides\[0\]: 'registry.webhook_url=http://127.0.0.1:\d+/\*\*\*' is a "):
        unseal(stored)  # a process that was not given them refuses, naming the parameter
    assert os.environ.get(SECRETS_ENV) is None


# ---------------------------------------------------------------------- a whole training run
QUICK = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "rollout.backend=hf",
         "trainer.val_before_train=false", "trainer.total_steps=1", "trainer.trace=true"]


# A user's reward function that, on its first call in each worker, logs and raises with an API
# key of each format and the values of secret environment variables (a grader service's reply).
REWARD = """
import logging, os
KEYS = {keys!r}
calls = 0

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls += 1
    if calls == 1:
        said = " ".join(KEYS.values()) + " " + os.environ["GRADER_API_KEY"]
        logging.getLogger("grader").warning("grader call with %s", said)
        raise RuntimeError("grader refused " + said + " (Authorization: Bearer {bearer})")
    return 0.0
"""


@pytest.mark.slow
def test_training_run_with_secrets_everywhere_leaks_them_nowhere(tiny_example, tmp_path, receiver, caplog, capfd,
                                                                 env_secrets):
    """Secrets in the config (the webhook: key, URL userinfo, path and query), in the environment,
    and in what a reward function logs and raises: none reaches the console, the log, the run
    folder, MLflow's store or `rlcore trace`; the webhook still gets its POST with them."""
    caplog.set_level(logging.DEBUG)
    run_dir = tmp_path / "run"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    reward = tmp_path / "user" / "grader.py"  # the user's file holds them, of course: searched apart from the outputs
    reward.parent.mkdir()
    reward.write_text(REWARD.format(keys=KEYS, bearer=BEARER))
    args = ["train", str(CONFIG_DIR / "tiny_grpo.yaml"), *tiny_example_overrides(tiny_example, str(run_dir)), *QUICK,
            "trainer.loggers=[console,jsonl,mlflow]", f"tracking.mlflow_uri={uri}", f"reward.function={reward}:compute_score",
            "reward.max_error_fraction=1", f"registry.webhook_url={receiver.secret_url}", "--verbose"]
    assert main(args) == 0

    # the webhook got the POST, with the credentials (header) and the token (query)
    assert [p["body"]["event"] for p in receiver.posts] == ["finished"]
    assert receiver.posts[0]["path"] == f"/hook/{PATH_SECRET}?token={TOKEN}"
    assert receiver.posts[0]["authorization"] == "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()

    # ...and nothing else has them: the run folder, MLflow's store, the log and the console
    for name in ("config.yaml", "metrics.jsonl", "trace.jsonl", "mlflow_run_id"):
        assert (run_dir / name).is_file(), name
    assert f"webhook_url: http://127.0.0.1:{receiver.port}/***" in (run_dir / "config.yaml").read_text()
    assert files_with_secrets(tmp_path) == {}
    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=uri).get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert run.data.params["registry.webhook_url"] == f"http://127.0.0.1:{receiver.port}/***"
    out, err = capfd.readouterr()
    assert "preflight" in caplog.text  # the run's log was captured (INFO and up, --verbose)
    # the reward's error reached the log, redacted (and its workers' own log lines, on stderr)
    assert "RuntimeError: grader refused *** *** *** *** *** *** *** *** *** *** (Authorization: Bearer ***)" in caplog.text
    assert "grader call with ***" in err
    assert leaks(caplog.text) == [] and leaks(out) == [] and leaks(err) == []
    assert main(["trace", str(run_dir)]) == 0
    assert "step 1, conversation 1 of" in (shown := capfd.readouterr().out) and leaks(shown) == []


# ---------------------------------------------------------------------- a served pipeline
def prefect_outputs(api: str, deployment_id: str, flow_run_id: str) -> dict[str, str]:
    """Everything Prefect's API serves about the deployment and its run, as text."""
    from conftest import PREFECT_HTTP  # tests/ is on sys.path (pytest rootdir conftest)

    def post(path: str, body: dict[str, Any]) -> str:
        got = PREFECT_HTTP.post(f"{api}{path}", json=body, timeout=scaled(10))
        assert got.ok, got.text
        return got.text

    about_run = {"flow_runs": {"id": {"any_": [flow_run_id]}}}
    return {
        "deployment": PREFECT_HTTP.get(f"{api}/deployments/{deployment_id}", timeout=scaled(10)).text,
        "deployments": post("/deployments/filter", {}),
        "flow run": PREFECT_HTTP.get(f"{api}/flow_runs/{flow_run_id}", timeout=scaled(10)).text,
        "flow runs": post("/flow_runs/filter", {}),
        "flow run states": PREFECT_HTTP.get(f"{api}/flow_run_states/", params={"flow_run_id": flow_run_id}, timeout=scaled(10)).text,
        "task runs": post("/task_runs/filter", about_run),
        "logs": post("/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200}),
        "automations": post("/automations/filter", {}),
        "blocks": post("/block_documents/filter", {}),
        "events": post("/events/filter", {"filter": {"any_resource": {"id": [f"prefect.flow-run.{flow_run_id}"]}},
                                          "limit": 50}),
        "variables": post("/variables/filter", {}),
    }


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.pipeline
def test_served_pipeline_keeps_secrets_out_of_prefect(prefect_api, receiver, tiny_example, tmp_path):
    """`rlcore pipeline serve` with a secret webhook (an override) and a data file whose path holds
    an API key and a secret environment variable's value: a run from the deployment fails in
    data_prep naming that file, and notifies `failed` to the webhook (its URL, credentials and
    token as given). Prefect's deployment, flow run, task runs, states, logs, events, automations
    and blocks, and the serving process's output, hold none of the secrets."""
    from conftest import PREFECT_HTTP, stop_process_group, tree_progress, wait_for

    api, env = prefect_api
    work, log = tmp_path / "work", tmp_path / "serve.log"
    work.mkdir()
    secret_file = f"/nonexistent/{KEYS['anthropic']}/{ENV_SECRETS['RLCORE_TEST_SERVICE_TOKEN']}.parquet"
    env = dict(env, **ENV_SECRETS, PREFECT_API_URL=api, PREFECT_RUNNER_POLL_FREQUENCY="2", OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MLFLOW_TRACKING_URI", None)
    with open(log, "w") as out:
        serve = subprocess.Popen([sys.executable, "-m", "rlcore.cli", "pipeline", "serve", "--cron", "",
                                  f"registry.webhook_url={receiver.secret_url}", f"data.train_files=[{secret_file}]"],
                                 cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def deployed() -> dict[str, Any] | None:
            got = PREFECT_HTTP.get(f"{api}/deployments/name/rl_pipeline/rl-pipeline", timeout=scaled(5))
            return got.json() if got.ok else None

        dep = wait_for("the deployment", deployed, 180, procs=[serve])
        created = PREFECT_HTTP.post(f"{api}/deployments/{dep['id']}/create_flow_run", json={"parameters": {}}, timeout=scaled(10))
        assert created.ok, created.text
        run_id = created.json()["id"]

        def ended() -> str | None:
            state = (PREFECT_HTTP.get(f"{api}/flow_runs/{run_id}", timeout=scaled(5)).json().get("state") or {}).get("type")
            return state if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

        assert wait_for("the run to end", ended, 400, procs=[serve], interval=2, progress=tree_progress(work, log)) == "FAILED"
        wait_for("the failed notification", lambda: receiver.posts, 60, procs=[serve])
        wait_for("the run's process to exit", lambda: not psutil.Process(serve.pid).children(recursive=True), 60,
                 procs=[serve])
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=scaled(60)) == 0, log.read_text()[-3000:]
    finally:
        stop_process_group(serve)

    # the flow run read the webhook from the serving process, and POSTed with it as given
    [post] = receiver.posts
    assert post["path"] == f"/hook/{PATH_SECRET}?token={TOKEN}" and post["body"]["event"] == "failed"
    assert post["authorization"] == "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    assert "/nonexistent/***/***.parquet" in post["body"]["error"] and planted_in(json.dumps(post["body"])) == []

    outputs = {**prefect_outputs(api, dep["id"], run_id), "serve output": log.read_text()}
    assert {where: planted_in(text) for where, text in outputs.items() if planted_in(text)} == {}
    # ...what they show instead: the redacted forms
    run = json.loads(outputs["flow run"])
    assert run["parameters"]["overrides"] == [f"registry.webhook_url=http://127.0.0.1:{receiver.port}/***",
                                              "data.train_files=[/nonexistent/***/***.parquet]"]
    [failed] = [s for s in json.loads(outputs["flow run states"]) if s["type"] == "FAILED"]
    assert "/nonexistent/***/***.parquet" in failed["message"]
    assert "/nonexistent/***/***.parquet" in outputs["task runs"] and "/nonexistent/***/***.parquet" in outputs["logs"]


def test_a_url_in_prose_keeps_its_sentence_punctuation_and_redacting_twice_changes_nothing():
    for text in ("see https://u:p@h/x?token=abc: then", "at http://a:b@h:1/?t=1.", "(http://u:p@h/?k=v), next"):
        once = redact_text(text)
        assert once == redact_text(once) and "p@" not in once and once[-1] == text[-1], once


def test_a_web_apps_route_in_a_fragment_is_kept_but_its_secret_parameters_are_not():
    link = "http://127.0.0.1:5000/#/models/rlcore-tiny/versions/1?workflowType=machine_learning"
    assert redact_url(link) == link  # MLflow's UI link opens the model-training view
    assert redact_url("http://h/#/x?token=abc&a=1") == "http://h/#/x?token=***&a=1"
    assert redact_url("http://h/cb#access_token=abc") == "http://h/cb#***"  # an OAuth redirect's token
