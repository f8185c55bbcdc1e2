"""Secrets in the config (a webhook URL with credentials and a token) never leave the process in
clear: not in the run folder (config.yaml, metrics.jsonl, trace.jsonl), not in MLflow (params,
tags, the store itself), not in log output; the webhook itself still receives the POST with them.
A real HTTP receiver on 127.0.0.1, real MLflow (SQLite) and a real training run of the tiny example."""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from rlcore.cli import CONFIG_DIR, main, tiny_example_overrides
from rlcore.config import dump_config, load_config
from rlcore.lifecycle.notify import notify
from rlcore.redact import is_secret_key, redact_secret, redact_text, redact_tree, redact_url

USER, PASSWORD, PATH_SECRET, TOKEN = "hookuser", "s3cr3t-PW", "T0KENPATH9", "tok-abc123"
SECRETS = (USER, PASSWORD, PATH_SECRET, TOKEN)


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
    return [s for s in SECRETS if s in text]


def files_with_secrets(root: Path) -> dict[str, list[str]]:
    """Every file under `root` (text or binary: SQLite, YAML, JSONL) that contains a secret."""
    found = {}
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits = [s for s in SECRETS if s.encode() in data]
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


# ---------------------------------------------------------------------- the webhook
def test_webhook_posts_with_its_credentials_and_logs_none_of_them(receiver, caplog):
    caplog.set_level(logging.DEBUG)
    assert notify(receiver.secret_url, "finished", {"steps": 1})
    post = receiver.posts[0]
    assert post["path"] == f"/hook/{PATH_SECRET}?token={TOKEN}" and post["body"]["event"] == "finished"
    assert post["authorization"] == "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    # a failing one is logged, redacted (a closed port on loopback, and a URL urllib refuses)
    dead = f"http://{USER}:{PASSWORD}@127.0.0.1:9/hook/{PATH_SECRET}?token={TOKEN}"
    assert notify(dead, "failed", {}, timeout_s=2, retries=0) is False
    assert notify(f"htp://{USER}:{PASSWORD}@x/{PATH_SECRET}?token={TOKEN}", "failed", {}, retries=0) is False
    assert "webhook http://127.0.0.1:9/*** failed" in caplog.text
    assert len([r for r in caplog.records if r.name == "rlcore.lifecycle.notify"]) == 2
    assert leaks(caplog.text) == []


# ---------------------------------------------------------------------- a pipeline's params
def test_pipeline_params_carry_no_secret(receiver, tmp_path):
    from mlflow.tracking import MlflowClient

    from rlcore.lifecycle.stages import start_pipeline

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(CONFIG_DIR / "tiny_grpo.yaml", [
        "model.path=/m", "data.train_files=[/d.parquet]", f"tracking.mlflow_uri={uri}",
        f"registry.webhook_url={receiver.secret_url}"])
    ctx = start_pipeline(cfg, tmp_path, "secret-run", trigger={"data_path": f"https://h/f.parquet?token={TOKEN}"})
    run = MlflowClient(tracking_uri=uri).get_run(ctx["run_id"])
    assert run.data.params["registry.webhook_url"] == f"http://127.0.0.1:{receiver.port}/***"
    assert run.data.tags["trigger.data_path"] == "https://h/f.parquet?token=***"
    assert leaks(json.dumps(run.data.params)) == [] and leaks(json.dumps(run.data.tags)) == []
    assert files_with_secrets(tmp_path) == {}


# ---------------------------------------------------------------------- a whole training run
QUICK = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "rollout.backend=hf",
         "trainer.val_before_train=false", "trainer.total_steps=1", "trainer.trace=true"]


@pytest.mark.slow
def test_training_run_with_a_secret_webhook_leaks_it_nowhere(tiny_example, tmp_path, receiver, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    run_dir = tmp_path / "run"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["train", str(CONFIG_DIR / "tiny_grpo.yaml"), *tiny_example_overrides(tiny_example, str(run_dir)), *QUICK,
            "trainer.loggers=[console,jsonl,mlflow]", f"tracking.mlflow_uri={uri}",
            f"registry.webhook_url={receiver.secret_url}", "--verbose"]
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
    assert leaks(caplog.text) == [] and leaks(out) == [] and leaks(err) == []
