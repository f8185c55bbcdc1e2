"""rlcore.lifecycle without Prefect, MLflow or models: health guard, promotion gate, fingerprints,
data prep, webhook notifications, metric names, lineage, the data-directory watcher."""

from __future__ import annotations

import json
import pickle
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from rlcore.config import ConfigError, load_config
from rlcore.data import DataValidationError, read_rows, write_rows
from rlcore.lifecycle import GatePolicy, HealthBreach, HealthGuard, decide, files_fingerprint, prepare_dataset, rows_fingerprint
from rlcore.lifecycle.events import DirectoryWatcher, data_resource, new_files
from rlcore.lifecycle.lineage import build_lineage, lineage_tags
from rlcore.lifecycle.notify import notify
from rlcore.tracking import MlflowSink, flatten, mlflow_key
from rlcore.trainer.run_state import TrainingStopped


def row(a: int, b: int, source: str = "tiny_arith") -> dict:
    return {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "data_source": source,
            "reward_model": {"ground_truth": str(a + b), "style": "rule"}, "extra_info": {"a": a}}


# ---------------------------------------------------------------------- health guard
def test_health_kl_breach_names_metric_value_limit_step():
    guard = HealthGuard(max_kl=0.1)
    guard(1, {"actor/kl": 0.05})
    with pytest.raises(HealthBreach) as info:
        guard(2, {"actor/kl": 0.25})
    err = info.value
    assert isinstance(err, TrainingStopped)
    assert (err.metric, err.value, err.limit, err.step) == ("actor/kl", 0.25, 0.1, 2)
    assert "actor/kl=0.25" in str(err) and "limit 0.1" in str(err) and "step 2" in str(err)


def test_health_entropy_collapse_and_nan():
    guard = HealthGuard(min_entropy=0.05)
    guard(1, {"actor/entropy": 0.06})
    with pytest.raises(HealthBreach, match="entropy collapse at step 2"):
        guard(2, {"actor/entropy": 0.01})
    with pytest.raises(HealthBreach):
        HealthGuard(min_entropy=0.05)(1, {"actor/entropy": float("nan")})


def test_health_reward_jump_compares_consecutive_steps():
    guard = HealthGuard(max_reward_jump=0.5)
    guard(1, {"reward/mean": 0.1})
    guard(2, {"reward/mean": 0.55})  # +0.45: within the limit
    guard(3, {"reward/mean": 0.2})   # -0.35
    with pytest.raises(HealthBreach) as info:
        guard(4, {"reward/mean": 0.8})  # +0.6
    assert info.value.metric == "reward/mean_jump"
    assert info.value.value == pytest.approx(0.6)
    assert info.value.step == 4


def test_health_missing_metrics_and_disabled_checks_never_stop():
    guard = HealthGuard(max_kl=0.1, min_entropy=0.5, max_reward_jump=0.1)
    guard(1, {"reward/mean": 0.0})  # no KL, no entropy: skipped
    HealthGuard()(1, {"actor/kl": 1e9, "actor/entropy": 0.0, "reward/mean": 1.0})  # all limits None


def test_health_breach_survives_pickling():
    err = HealthBreach("actor/kl", 2.0, 1.0, 7, "KL to the reference above its limit")
    again = pickle.loads(pickle.dumps(err))
    assert (again.metric, again.value, again.limit, again.step) == ("actor/kl", 2.0, 1.0, 7)
    assert str(again) == str(err)


# ---------------------------------------------------------------------- promotion gate
def metrics(acc: float, kl: float = 0.01, length: float = 5.0) -> dict:
    return {"accuracy": acc, "mean_reward": acc, "kl_to_reference": kl, "response_length": length}


def test_gate_promotes_only_past_the_margin():
    policy = GatePolicy(margin=0.02, max_kl=0.5, max_length_ratio=1.5)
    yes = decide(metrics(0.53), metrics(0.50), policy)
    assert yes.promote and yes.check == "promoted"
    no = decide(metrics(0.515), metrics(0.50), policy)
    assert not no.promote and no.check == "margin"
    assert "0.5150" in no.reason and "0.5000" in no.reason and "0.02" in no.reason


def test_gate_budgets_reject_a_better_scoring_candidate():
    policy = GatePolicy(margin=0.0, max_kl=0.2, max_length_ratio=1.5)
    kl = decide(metrics(0.9, kl=0.3), metrics(0.5), policy)
    assert not kl.promote and kl.check == "kl_budget" and "0.3" in kl.reason
    long = decide(metrics(0.9, length=7.6), metrics(0.5, length=5.0), policy)  # 7.6 > 1.5 * 5
    assert not long.promote and long.check == "length_budget"
    ok = decide(metrics(0.9, length=7.4), metrics(0.5, length=5.0), policy)
    assert ok.promote


def test_gate_uses_the_configured_metric():
    policy = GatePolicy(metric="mean_reward", margin=0.1)
    cand = {**metrics(0.5), "mean_reward": 0.9}
    assert decide(cand, metrics(0.5), policy).promote


# ---------------------------------------------------------------------- fingerprints and data prep
def test_fingerprint_is_content_not_format(tmp_path):
    rows = [row(i, i + 1) for i in range(5)]
    a = write_rows(rows, tmp_path / "a.parquet")
    b = write_rows(rows, tmp_path / "b.jsonl")
    assert files_fingerprint([a]) == files_fingerprint([b])
    changed = [dict(r) for r in rows]
    changed[3] = row(3, 5)
    assert rows_fingerprint(changed) != rows_fingerprint(rows)
    assert rows_fingerprint(rows[::-1]) != rows_fingerprint(rows)
    assert files_fingerprint([a], {"val_fraction": 0.1}) != files_fingerprint([a], {"val_fraction": 0.2})


def test_prep_error_policy_reports_every_bad_row(tmp_path):
    rows = [row(1, 2), {"prompt": "", "data_source": "x", "reward_model": {"ground_truth": "1"}},
            row(3, 4), {"prompt": "q", "data_source": "x", "reward_model": {"ground_truth": 5}}]
    src = write_rows(rows, tmp_path / "raw.jsonl")
    with pytest.raises(DataValidationError) as info:
        prepare_dataset([src], tmp_path / "out", val_fraction=0.5)
    errs = info.value.errors
    assert [(e.row, e.field) for e in errs] == [(1, "prompt"), (3, "reward_model.ground_truth")]
    assert not (tmp_path / "out" / "train.parquet").exists()  # nothing written on failure


def test_prep_skip_dedupe_no_leak_and_recomputable_fingerprint(tmp_path):
    train = [row(i, 1) for i in range(20)] + [row(0, 1), row(5, 1)]  # two duplicates
    train.append({"prompt": "", "data_source": "x", "reward_model": {"ground_truth": "1"}})  # bad
    val = [row(7, 1), row(100, 1), row(100, 1)]  # row(7,1) is also in train; a duplicate in val
    src = write_rows(train, tmp_path / "train.jsonl")
    vsrc = write_rows(val, tmp_path / "val.parquet")
    out = prepare_dataset([src], tmp_path / "out", [vsrc], on_bad_row="skip")
    assert out.counts == {"rows_read": 26, "bad_rows": 1, "duplicates": 4, "train": 19, "val": 2}
    assert len(out.bad_rows) == 1 and "row 22" in out.bad_rows[0]
    train_rows, val_rows = read_rows(out.train_file), read_rows(out.val_file)
    prompts = {r["prompt"][0]["content"] for r in train_rows}
    assert "7+1=" not in prompts and len(prompts) == 19
    assert [r["prompt"][0]["content"] for r in val_rows] == ["7+1=", "100+1="]
    assert out.train_fingerprint == rows_fingerprint(train_rows)
    assert json.loads((tmp_path / "out" / "prep_report.json").read_text())["fingerprint"] == out.fingerprint


def test_prep_split_is_deterministic_by_content(tmp_path):
    rows = [row(i, 2) for i in range(200)]
    a = prepare_dataset([write_rows(rows, tmp_path / "a.jsonl")], tmp_path / "a", val_fraction=0.2, seed=3)
    b = prepare_dataset([write_rows(rows[::-1], tmp_path / "b.jsonl")], tmp_path / "b", val_fraction=0.2, seed=3)
    val_a = {r["prompt"][0]["content"] for r in read_rows(a.val_file)}
    val_b = {r["prompt"][0]["content"] for r in read_rows(b.val_file)}
    assert val_a == val_b  # same rows held out, whatever their order in the file
    assert 20 <= len(val_a) <= 60
    assert a.counts["train"] + a.counts["val"] == 200


# ---------------------------------------------------------------------- notifications
class _Hook(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hook.received.append((self.path, self.headers["Content-Type"], json.loads(body)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def webhook():
    _Hook.received = []
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hooks/rl", _Hook.received
    finally:
        server.shutdown()
        server.server_close()


def test_webhook_receives_event_and_summary(webhook):
    url, received = webhook
    assert notify(url, "rejected", {"version": "3", "reason": "margin", "evaluation": {"candidate": {"accuracy": 0.4}}})
    path, ctype, body = received[0]
    assert path == "/hooks/rl" and ctype == "application/json"
    assert body["event"] == "rejected" and body["source"] == "rlcore"
    assert body["version"] == "3" and body["evaluation"]["candidate"]["accuracy"] == 0.4


def test_webhook_failures_never_raise():
    assert notify(None, "promoted", {}) is False
    assert notify("http://127.0.0.1:9/none", "failed", {"error": "x"}, timeout_s=1, retries=0) is False
    with pytest.raises(ValueError, match="unknown notification event"):
        notify(None, "exploded", {})


# ---------------------------------------------------------------------- MLflow names, params
def test_mlflow_key_sanitises():
    assert mlflow_key("val/pass@8") == "val/pass_at_8"
    assert mlflow_key("time/step_s") == "time/step_s"
    assert mlflow_key("a[b]=c%") == "a_b__c_"


def test_mlflow_sink_logs_numbers_only_with_steps():
    class FakeClient:
        def __init__(self):
            self.calls = []

        def log_batch(self, run_id, metrics=(), params=()):
            self.calls.append((run_id, [(m.key, m.value, m.step) for m in metrics]))

    client = FakeClient()
    sink = MlflowSink("r1", client=client)
    sink.log(5, {"val/pass@4": 0.5, "reward/mean": 1, "note": "text", "bad": float("inf"), "flag": True})
    assert client.calls == [("r1", [("reward/mean", 1.0, 5), ("val/pass_at_4", 0.5, 5)])]


def test_flatten_gives_dotted_params():
    flat = flatten({"actor": {"optim": {"lr": 1e-6, "betas": [0.9, 0.99]}}, "trainer": {"seed": 0}, "x": {}})
    assert flat == {"actor.optim.lr": "1e-06", "actor.optim.betas": "[0.9, 0.99]", "trainer.seed": "0", "x": "{}"}


# ---------------------------------------------------------------------- lineage
def test_lineage_names_reward_functions_and_dataset():
    lineage = build_lineage(config={"a": 1}, dataset_fingerprint="f" * 64, data_sources=["tiny_arith", "math"],
                            parent_model="/models/base")
    rewards = lineage["reward_functions"]
    assert rewards["tiny_arith"]["name"] == "rlcore.rewards.gsm8k:compute_score"
    assert rewards["math"]["name"] == "rlcore.rewards.math_boxed:compute_score"
    assert len(rewards["tiny_arith"]["version"]) == 12
    again = build_lineage(config={"a": 1}, dataset_fingerprint="f" * 64, data_sources=["tiny_arith"], parent_model="p")
    assert again["reward_functions"]["tiny_arith"] == rewards["tiny_arith"]
    tags = lineage_tags({**lineage, "config": {"algorithm": {"name": "grpo"}}})
    assert set(tags) == {"rlcore.kind", "rlcore.parent_model", "rlcore.dataset_fingerprint", "rlcore.algorithm",
                         "rlcore.reward", "rlcore.code"}
    assert tags["rlcore.kind"] == "policy"
    assert tags["rlcore.dataset_fingerprint"] == "f" * 64
    assert tags["rlcore.parent_model"] == "/models/base" and tags["rlcore.algorithm"] == "grpo"
    assert tags["rlcore.reward"].split(",") == sorted({f"{r['name']}@{r['version']}" for r in rewards.values()})
    assert "torch" in lineage["packages"]  # packages stay in the full record (lineage.json)
    assert all(isinstance(v, str) and len(v) < 5000 for v in tags.values())


def test_versions_name_the_reward_they_optimised_and_reward_models_describe_themselves():
    """A policy trained against a reward model names that version as its reward (and the rule
    scorer only when it weighs in); a reward model's version has tags of its own, no reward."""
    from rlcore.lifecycle.lineage import reward_model_tags, reward_record

    rm = {"name": "tiny-rm", "version": "3", "uri": "models:/tiny-rm/3"}
    config = {"algorithm": {"name": "ppo"}, "reward_model": {"weight": 1.0, "rule_weight": 0.0}}
    lineage = build_lineage(config=config, dataset_fingerprint="f" * 64, data_sources=["tiny_arith"], parent_model="/base",
                            extra={"reward_model": rm})
    rules = {lineage["reward_functions"]["tiny_arith"]["name"] + "@" + lineage["reward_functions"]["tiny_arith"]["version"]}
    lineage["reward"] = reward_record(config, lineage["reward_functions"], rm)
    tags = lineage_tags(lineage)
    assert tags["rlcore.reward"] == "models:/tiny-rm/3" and tags["rlcore.reward_model"] == "models:/tiny-rm/3"
    assert lineage["reward"]["rule"] == {"weight": 0.0, "functions": lineage["reward_functions"]}
    mixed = {**config, "reward_model": {"weight": 2.0, "rule_weight": 0.5}}
    lineage["reward"] = reward_record(mixed, lineage["reward_functions"], rm)
    assert lineage_tags(lineage)["rlcore.reward"] == f"2 x models:/tiny-rm/3 + 0.5 x {rules.pop()}"

    rm_lineage = build_lineage(config={"algorithm": {"name": "rm"}}, dataset_fingerprint="p" * 64, data_sources=[],
                               parent_model="/base", extra={"evaluation": {"candidate": {"pairwise_accuracy": 0.975}}})
    rm_tags = reward_model_tags(rm_lineage)
    assert rm_tags["rlcore.kind"] == "reward_model" and "rlcore.reward" not in rm_tags
    assert rm_tags["rlcore.preference_data"] == "p" * 64 and rm_tags["rlcore.pairwise_accuracy"] == "0.9750"
    assert rm_tags["rlcore.parent_model"] == "/base" and rm_tags["rlcore.algorithm"] == "rm"


# ---------------------------------------------------------------------- data events
def test_new_files_skips_hidden_partial_and_seen(tmp_path):
    (tmp_path / "a.parquet").write_text("x")
    (tmp_path / ".b.parquet").write_text("x")
    (tmp_path / "c.parquet.part").write_text("x")
    seen: set[str] = set()
    assert [p.name for p in new_files(tmp_path, seen)] == ["a.parquet"]
    assert new_files(tmp_path, seen) == []
    (tmp_path / "d.jsonl").write_text("x")
    assert [p.name for p in new_files(tmp_path, seen)] == ["d.jsonl"]


def test_watcher_announces_only_new_arrivals(tmp_path):
    (tmp_path / "old.parquet").write_text("x")
    got = []
    watcher = DirectoryWatcher(tmp_path, on_file=got.append, interval_s=60)
    (tmp_path / "new.parquet").write_text("x")
    assert [p.name for p in watcher.poll()] == ["new.parquet"]
    assert [p.name for p in got] == ["new.parquet"]
    assert watcher.poll() == []
    res = data_resource(tmp_path / "new.parquet")
    assert res["prefect.resource.id"].startswith("rlcore.data.")
    assert res["rlcore.data.path"] == str((tmp_path / "new.parquet").resolve())


# ---------------------------------------------------------------------- config sections
def test_lifecycle_config_sections_default_and_name_bad_keys():
    base = ["model.path=/m", "data.train_files=[/t.parquet]"]
    cfg = load_config(None, base + ["health.max_kl=0.3", "registry.promotion_margin=0.05"])
    assert cfg.health.max_kl == 0.3 and cfg.health.min_entropy == 0.01
    assert cfg.registry.promotion_margin == 0.05 and cfg.registry.model_name == "rlcore-tiny"
    assert cfg.tracking.mlflow_uri is None
    with pytest.raises(ConfigError, match=r"health\.max_kll: unknown key"):
        load_config(None, base + ["health.max_kll=1"])
    with pytest.raises(ConfigError, match=r"registry\.metric"):
        load_config(None, base + ["registry.metric=bleu"])


# ---------------------------------------------------------------------- Ray job logs
class _JobServerWhoseTailClosesEarly:
    """A stand-in for Ray's JobSubmissionClient (the real one is exercised in test_ray_cluster):
    its log tail closes before the driver's last lines reach it, as Ray's websocket sometimes
    does when a job fails, while the stored log holds them."""

    def __init__(self, log: str, streamed: str) -> None:
        self.log, self.streamed = log, streamed

    async def tail_job_logs(self, job_id):
        yield self.streamed

    def get_job_logs(self, job_id) -> str:
        return self.log

    def get_job_info(self, job_id):
        from ray.job_submission import JobStatus

        return type("JobDetails", (), {"status": JobStatus.FAILED})()


def test_a_job_log_line_the_tail_missed_still_reaches_the_stage_log():
    pytest.importorskip("ray")
    from rlcore.lifecycle.ray_job import RESULT_MARK, follow_job

    log = f"step 1\nstep 2\n{RESULT_MARK}{{}}\nrlcore: error: worker role='actor' rank=1 died\n"
    seen: list[str] = []
    info = follow_job(_JobServerWhoseTailClosesEarly(log, streamed="step 1\nstep 2\nrlc"), "job", seen.append)
    assert info.status.value == "FAILED"
    assert seen == ["step 1", "step 2", "rlcore: error: worker role='actor' rank=1 died"]  # each line once, whole
