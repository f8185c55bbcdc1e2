"""`rlcore train` notifies `registry.webhook_url` like the pipeline does: a JSON POST when the run
finishes, when it stops itself (health_stop) and when it fails. A real HTTP receiver on 127.0.0.1
and real training runs of the tiny example."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from tiny_runs import SCORE_IN_PROCESS  # tests/ is on sys.path

from rlcore.algos import register_policy_loss, vanilla_policy_loss
from rlcore.cli import CONFIG_DIR, main, tiny_example_overrides

pytestmark = pytest.mark.slow

QUICK = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "rollout.backend=hf",
         "data.val_files=[]", "trainer.val_before_train=false", "trainer.loggers=[jsonl]", "trainer.total_steps=1"]


class Receiver:
    """An HTTP endpoint on 127.0.0.1 that records the JSON body of every POST it gets."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        received = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append({"content_type": self.headers["Content-Type"], **json.loads(body)})
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def train_args(example, out: Path, url: str, *extra: str) -> list[str]:
    return ["train", str(CONFIG_DIR / "tiny_grpo.yaml"), *tiny_example_overrides(example, str(out)), *QUICK,
            SCORE_IN_PROCESS, f"registry.webhook_url={url}", *extra]


def test_finished_run_posts_finished_with_its_checkpoint(tiny_example, tmp_path, receiver):
    assert main(train_args(tiny_example, tmp_path / "run", receiver.url)) == 0
    assert [p["event"] for p in receiver.posts] == ["finished"]
    post = receiver.posts[0]
    assert post["source"] == "rlcore" and post["content_type"] == "application/json"
    assert post["command"] == "train" and post["algorithm"] == "grpo"
    assert post["run_dir"] == str((tmp_path / "run").resolve())
    assert post["steps_run"] == post["total_steps"] == 1
    assert Path(post["checkpoint"]).name == "step_00000001" and (Path(post["checkpoint"]) / "actor").is_dir()
    assert 0.0 <= post["metrics"]["reward/mean"] <= 1.0


def test_failed_run_posts_failed_with_the_error(tiny_example, tmp_path, receiver):
    missing = tmp_path / "no-such-model"
    # refused before any model loads (rlcore.trainer.preflight): a message and exit status 2
    assert main(train_args(tiny_example, tmp_path / "run", receiver.url, f"model.path={missing}")) == 2
    assert [p["event"] for p in receiver.posts] == ["failed"]
    assert "no-such-model" in receiver.posts[0]["error"]
    assert receiver.posts[0]["checkpoint"] is None


def _nan_policy_loss(old_log_prob, log_prob, advantages, response_mask, **kw):
    loss, metrics = vanilla_policy_loss(old_log_prob, log_prob, advantages, response_mask, **kw)
    return loss * float("nan"), metrics


def test_run_that_stops_itself_posts_health_stop(tiny_example, tmp_path, receiver):
    register_policy_loss("test_webhook_nan", overwrite=True)(_nan_policy_loss)
    assert main(train_args(tiny_example, tmp_path / "run", receiver.url, "actor.policy_loss=test_webhook_nan",
                           "actor.max_consecutive_bad_steps=1")) == 3  # the run stopped itself
    assert [p["event"] for p in receiver.posts] == ["health_stop"]
    assert "actor.max_consecutive_bad_steps=1" in receiver.posts[0]["reason"]

