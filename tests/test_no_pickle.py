"""No code runs from a file, cache or artifact: nothing rlcore reads back is unpickled.

1. The pipeline's persisted Prefect result (data_prep's cache) is JSON under the pipeline's working
   folder; a payload planted in it (Prefect's pickle serializer, its compressed one around pickle,
   the old record format) never runs: the entry is refused with a warning naming the file, the task
   runs again and its fresh JSON record replaces the planted one.
2. A scan of every module of rlcore/ and flows/ (their syntax trees) fails on any unpickling call,
   pickle-based serializer or result storage that is not rlcore's data-only one; IPC with the
   project's own child processes is excepted by the named allow-list below, each with its reason.
"""

from __future__ import annotations

import ast
import base64
import json
import logging
import os
import pickle
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- the scan
# Calls that unpickle (or otherwise build objects a file chooses) when given what a file holds.
UNPICKLING = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads", "_pickle.Unpickler",
    "cloudpickle.load", "cloudpickle.loads", "dill.load", "dill.loads", "marshal.load", "marshal.loads",
    "shelve.open", "joblib.load", "pandas.read_pickle", "yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load",
    "yaml.full_load_all", "prefect.serializers.PickleSerializer", "prefect.serializers.CompressedSerializer",
    "prefect.serializers.JSONSerializer",  # its record names the decoder and JSON library to import
}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}
PREFECT_DECORATORS = {"prefect.task", "prefect.flow"}


def _qualified(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """`a.b.c` of a Name/Attribute chain, its first name resolved through the module's imports."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _qualified(node.value, aliases)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def unsafe_constructs(source: str) -> list[tuple[int, str]]:
    """(line, rule) of every construct in `source` that would unpickle what a file, cache or
    artifact holds, or persist a Prefect result a later run would read with a pickle serializer."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[(a.asname or a.name).split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = _qualified(base, aliases)
                if name in UNPICKLING:
                    found.append((node.lineno, f"subclass of {name}"))
        if not isinstance(node, ast.Call):
            continue
        name = _qualified(node.func, aliases) or ""
        if name in UNPICKLING:
            found.append((node.lineno, name))
        elif name == "torch.load" and not _is_const(_keyword(node, "weights_only"), True):
            found.append((node.lineno, "torch.load without weights_only=True"))
        elif name == "numpy.load" and not _is_const(_keyword(node, "allow_pickle"), False):
            found.append((node.lineno, "numpy.load without allow_pickle=False"))
        elif name in ("yaml.load", "yaml.load_all"):
            loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            loader_name = (_qualified(loader, aliases) or "").rsplit(".", 1)[-1] if loader is not None else ""
            if loader_name not in SAFE_YAML_LOADERS:
                found.append((node.lineno, f"{name} without a safe Loader"))
        elif name == "torch.distributed.checkpoint.load" or (name.endswith(".load") and name.split(".")[0] == "dcp"):
            reader = _keyword(node, "storage_reader")
            if not (isinstance(reader, ast.Call) and (_qualified(reader.func, aliases) or "").endswith("SafeFileSystemReader")):
                found.append((node.lineno, "torch.distributed.checkpoint.load without SafeFileSystemReader"))
        elif isinstance(node.func, ast.Attribute) and node.func.attr == "recv" and not node.args:
            found.append((node.lineno, "Connection.recv (unpickles what the other end sent)"))
        if _keyword(node, "python_model") is not None:
            found.append((node.lineno, "MLflow python_model (cloudpickled into the artifact)"))
        found += _prefect_result_problems(node, name, aliases)
    return found


def _prefect_result_problems(call: ast.Call, name: str, aliases: dict[str, str]) -> list[tuple[int, str]]:
    """A Prefect task/flow (or `with_options`) that persists or caches results must name rlcore's
    data-only serializer; a result storage must be `result_storage_for(...)` (rlcore.flows.results)."""
    found = []
    serializer = _keyword(call, "result_serializer")
    data_only = isinstance(serializer, ast.Name) and serializer.id == "DATA_ONLY_JSON"
    if serializer is not None and not data_only:
        found.append((call.lineno, "result_serializer other than DATA_ONLY_JSON"))
    storage = _keyword(call, "result_storage")
    if storage is not None and not (isinstance(storage, ast.Call) and (_qualified(storage.func, aliases) or "").endswith(
            "result_storage_for")):
        found.append((call.lineno, "result_storage other than result_storage_for(...)"))
    if name in PREFECT_DECORATORS and not data_only:
        policy = _keyword(call, "cache_policy")
        no_cache = policy is None or _is_const(policy, None) or _qualified(policy, aliases) == "prefect.cache_policies.NO_CACHE"
        caches = _keyword(call, "cache_key_fn") is not None or not no_cache
        if _is_const(_keyword(call, "persist_result"), True) or caches:
            found.append((call.lineno, f"{name} persisting or caching results without result_serializer=DATA_ONLY_JSON"))
    return found


# Where the scan's rules are broken on purpose: IPC with processes this project started itself,
# and the one restricted unpickler. Each entry: (file, rule) -> why it is not a file, cache or artifact.
ALLOWED = {
    ("rlcore/controller/subprocess_group.py", "pickle.loads"):
        "replies and requests over the pipe between the trainer and the rollout worker process it started "
        "(trainer.overlap_with=process); nothing is read from a file",
    ("rlcore/rewards/manager.py", "Connection.recv (unpickles what the other end sent)"):
        "results from the reward/tool worker processes this pool started, over their inherited socket",
    ("rlcore/rewards/_worker.py", "Connection.recv (unpickles what the other end sent)"):
        "requests from the driver process that started this worker, over the inherited socket",
    ("rlcore/workers/checkpointing.py", "subclass of pickle.Unpickler"):
        "DCP .metadata files: its find_class admits only the data classes DCP metadata is made of, and "
        "refuses everything else before it runs (tests/test_dcp_safety.py plants payloads)",
}


def _scanned_files() -> list[Path]:
    return sorted([*(ROOT / "rlcore").rglob("*.py"), *(ROOT / "flows").rglob("*.py")])


def test_no_module_unpickles_what_a_file_cache_or_artifact_holds():
    found: dict[tuple[str, str], list[int]] = {}
    for path in _scanned_files():
        rel = str(path.relative_to(ROOT))
        for line, rule in unsafe_constructs(path.read_text(encoding="utf-8")):
            found.setdefault((rel, rule), []).append(line)
    unexpected = {f"{rel}:{lines[0]}: {rule}" for (rel, rule), lines in found.items() if (rel, rule) not in ALLOWED}
    assert not unexpected, ("unpickling on a path a file, cache or artifact can reach (use JSON/safetensors, "
                            "torch.load(weights_only=True), or add IPC with a child process of ours to ALLOWED with "
                            f"its reason): {sorted(unexpected)}")
    stale = set(ALLOWED) - set(found)
    assert not stale, f"allow-list entries that match nothing any more (remove them): {sorted(stale)}"


@pytest.mark.parametrize("snippet, rule", [
    ("import pickle\npickle.loads(b)", "pickle.loads"),
    ("from pickle import load as l\nl(f)", "pickle.load"),
    ("import cloudpickle\ncloudpickle.loads(b)", "cloudpickle.loads"),
    ("import torch\ntorch.load(p)", "torch.load without weights_only=True"),
    ("import torch\ntorch.load(p, weights_only=False)", "torch.load without weights_only=True"),
    ("import numpy as np\nnp.load(p, allow_pickle=True)", "numpy.load without allow_pickle=False"),
    ("import yaml\nyaml.load(s, Loader=yaml.Loader)", "yaml.load without a safe Loader"),
    ("import torch.distributed.checkpoint as dcp\ndcp.load(state, checkpoint_id=p)",
     "torch.distributed.checkpoint.load without SafeFileSystemReader"),
    ("import pickle\nclass U(pickle.Unpickler): pass", "subclass of pickle.Unpickler"),
    ("from prefect.serializers import PickleSerializer\nPickleSerializer()", "prefect.serializers.PickleSerializer"),
    ("from prefect import task\n@task(persist_result=True)\ndef t(): pass",
     "prefect.task persisting or caching results without result_serializer=DATA_ONLY_JSON"),
    ("from prefect import task\n@task(cache_key_fn=k, result_serializer='json')\ndef t(): pass",
     "result_serializer other than DATA_ONLY_JSON"),
    ("t.with_options(result_storage=LocalFileSystem(basepath=p))", "result_storage other than result_storage_for(...)"),
    ("conn.recv()", "Connection.recv (unpickles what the other end sent)"),
    ("mlflow.pyfunc.log_model('m', python_model=Model())", "MLflow python_model (cloudpickled into the artifact)"),
])
def test_the_scan_catches_each_kind(snippet, rule):
    assert rule in [r for _, r in unsafe_constructs(snippet)]


@pytest.mark.parametrize("snippet", [
    "import torch\ntorch.load(p, map_location='cpu', weights_only=True)",
    "import yaml\nyaml.safe_load(s)\nyaml.load(s, Loader=yaml.SafeLoader)",
    "import json\njson.loads(s)",
    "from prefect import task\n@task(cache_policy=None)\ndef t(): pass",
    "from prefect import task\nfrom prefect.cache_policies import NO_CACHE\n@task(cache_policy=NO_CACHE)\ndef t(): pass",
    "from prefect import task\n@task(cache_key_fn=k, persist_result=True, result_serializer=DATA_ONLY_JSON)\ndef t(): pass",
    "t.with_options(result_storage=result_storage_for(workdir))",
])
def test_the_scan_passes_data_only_reads(snippet):
    assert unsafe_constructs(snippet) == []


# --------------------------------------------------------------------------- the pipeline's result cache
class _Payload:
    """Unpickling this runs code: it creates the file named in it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _planted_records(original: dict, marker: Path) -> dict[str, dict]:
    """Result records a writer of the result storage could plant, each carrying the payload."""
    import lzma

    meta = dict(original["metadata"])
    blob = base64.encodebytes(pickle.dumps(_Payload(marker))).decode()
    compressed = base64.encodebytes(lzma.compress(base64.encodebytes(pickle.dumps(_Payload(marker))))).decode()
    return {
        "pickle serializer": {"metadata": {**meta, "serializer": {"type": "pickle", "picklelib": "pickle"}}, "result": blob},
        "compressed pickle": {"metadata": {**meta, "serializer": {"type": "compressed", "compressionlib": "lzma",
                                                                   "serializer": {"type": "pickle", "picklelib": "pickle"}}},
                              "result": compressed},
        "old record format": {"serializer": {"type": "pickle", "picklelib": "pickle"}, "data": blob},
    }


def _misshapen_records(original: dict, tmp_path: Path) -> dict[str, dict]:
    """Records in rlcore's own JSON format whose result is not what data_prep returns."""
    first = json.loads(original["result"])
    elsewhere = tmp_path / "planted.parquet"
    elsewhere.write_bytes(b"not the prepared data")

    def record(result: object) -> dict:
        return {**original, "result": json.dumps(result)}

    return {
        "fields missing": record({"train_file": str(elsewhere)}),
        "an unknown field": record({**first, "train_file": str(elsewhere), "run_this": "rm -rf /"}),
        "a mistyped field": record({**first, "fingerprint": 12345}),
        "a list, not an object": record([first]),
        "files that are gone": record({**first, "train_file": str(tmp_path / "gone.parquet")}),
    }


@pytest.mark.slow
@pytest.mark.prefect
def test_a_payload_planted_in_the_data_prep_cache_never_runs(tiny_example, tmp_path, monkeypatch):
    from conftest import prefect_env  # tests/ is on sys.path (pytest rootdir conftest)

    for key, value in prefect_env(tmp_path / "prefect").items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    from prefect._internal.result_records import ResultRecord

    from rlcore.example.overrides import example_overrides
    from rlcore.flows.data_prep import data_prep

    workdir = tmp_path / "pipeline"
    overrides = [*example_overrides(), f"tracking.mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    first = data_prep(overrides=overrides, workdir=str(workdir))
    [record_file] = (workdir / "task-results").iterdir()  # the pipeline's own folder, not ~/.prefect/storage
    original = json.loads(record_file.read_text())
    assert original["metadata"]["serializer"] == {"type": "rlcore-json"} and json.loads(original["result"]) == first
    assert not (tmp_path / "prefect" / "storage").exists() or not any((tmp_path / "prefect" / "storage").iterdir())

    marker = tmp_path / "code-ran"
    for what, planted in _planted_records(original, marker).items():
        content = json.dumps(planted).encode()
        ResultRecord.deserialize(content)  # the payload is live: Prefect's own reader runs it
        assert marker.exists(), what
        marker.unlink()

        record_file.write_bytes(content)
        warned = _Collect()
        logger = logging.getLogger("rlcore.flows.results")  # Prefect's logging set-up replaces the root's handlers
        logger.addHandler(warned)
        try:
            again = data_prep(overrides=overrides, workdir=str(workdir))
        finally:
            logger.removeHandler(warned)
        assert not marker.exists(), f"{what}: the planted payload ran"
        assert again == first, what  # recomputed, not the planted value
        warnings = [r.getMessage() for r in warned.records if r.levelno == logging.WARNING]
        assert any(str(record_file) in w and "refused the cached task result" in w for w in warnings), (what, warnings)
        rewritten = json.loads(record_file.read_text())
        assert rewritten["metadata"]["serializer"] == {"type": "rlcore-json"}, what  # the fresh record replaced it

    record_file.write_text(json.dumps(original))  # a good record is used as it is: no warning, not rewritten
    written = record_file.stat().st_mtime_ns
    warned = _Collect()
    logging.getLogger("rlcore.flows.results").addHandler(warned)
    try:
        assert data_prep(overrides=overrides, workdir=str(workdir)) == first
    finally:
        logging.getLogger("rlcore.flows.results").removeHandler(warned)
    assert not warned.records and record_file.stat().st_mtime_ns == written

    for what, misshapen in _misshapen_records(original, tmp_path).items():
        record_file.write_text(json.dumps(misshapen))
        warned = _Collect()
        logger = logging.getLogger("rlcore.flows.results")
        logger.addHandler(warned)
        try:
            again = data_prep(overrides=overrides, workdir=str(workdir))
        finally:
            logger.removeHandler(warned)
        assert again == first, what  # recomputed, not the misshapen value
        warnings = [r.getMessage() for r in warned.records if r.levelno == logging.WARNING]
        assert any(str(record_file) in w and "refused the cached task result" in w for w in warnings), (what, warnings)
        assert json.loads(json.loads(record_file.read_text())["result"]) == first, what  # replaced by the fresh one
    assert os.environ.get("PREFECT_API_URL") is None


GOOD_PREPARED = {"train_file": "TRAIN", "val_file": "VAL", "fingerprint": "f" * 64, "counts": {"train": 9, "val": 1},
                 "bad_rows": [], "input_fingerprint": "i" * 64}


@pytest.mark.parametrize(("change", "why"), [
    ({"fingerprint": None}, "fingerprint"),
    ({"counts": {"train": "9"}}, "counts.train"),
    ({"counts": {"train": 9.5}}, "counts.train"),
    ({"bad_rows": "row 3"}, "bad_rows"),
    ({"extra": 1}, "'extra'"),
    ({"train_file": ["a"]}, "train_file"),
])
def test_a_cached_result_must_be_what_its_task_returns(tmp_path, change, why):
    from rlcore.flows.results import result_refusal

    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    train.touch()
    val.touch()
    good = {**GOOD_PREPARED, "train_file": str(train), "val_file": str(val)}
    assert result_refusal("rlcore-data-prep-abc-def", good) is None
    refusal = result_refusal("rlcore-data-prep-abc-def", {**good, **change})
    assert refusal is not None and why in refusal, refusal
    missing = {k: v for k, v in good.items() if k != "val_file"}
    assert "val_file" in (result_refusal("rlcore-data-prep-abc-def", missing) or "")
    assert "gone" in (result_refusal("rlcore-data-prep-abc-def", {**good, "val_file": str(tmp_path / "x")}) or "")
    assert "no rlcore task" in (result_refusal("someone-elses-key", good) or "")
    assert "JSON list" in (result_refusal("rlcore-data-prep-abc-def", [good]) or "")
