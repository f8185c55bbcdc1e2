"""A registered version is an MLflow model and an HF folder at once: `mlflow.pyfunc.load_model(
"models:/<name>@champion")` generates the same greedy text as rlcore's own rollout on that model,
while the downloaded version is still the HF folder transformers loads unchanged (real SQLite
registry, the tiny example's real safetensors, no network)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

pytestmark = pytest.mark.slow


@pytest.fixture
def mlflow_uri(tmp_path):
    """A fresh store, set as MLflow's global tracking and registry URI for the test only."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    previous = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    yield uri
    mlflow.set_tracking_uri(previous[0])
    mlflow.set_registry_uri(previous[1])


def _greedy_texts(model_dir: str, val_file: str, count: int, max_new_tokens: int) -> tuple[list[str], list[str]]:
    """(user prompts, responses) of rlcore's hf rollout, greedy, on the first `count` val rows."""
    from rlcore.data import PromptLoader, RLDataset, read_rows
    from rlcore.rollout import SamplingParams, make_rollout_engine
    from rlcore.workers.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    prompts = [row["prompt"][-1]["content"] for row in read_rows(val_file)[:count]]
    batch = next(iter(PromptLoader(RLDataset([val_file], tok, 32), batch_size=count, seed=0, shuffle=False)))
    engine = make_rollout_engine("hf", path=model_dir, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    out = engine.generate(batch, SamplingParams(n=1, do_sample=False, max_new_tokens=max_new_tokens))
    return prompts, tok.batch_decode(out["responses"], skip_special_tokens=True)


def test_champion_loads_as_pyfunc_and_as_hf_folder(mlflow_uri, tiny_example, tmp_path):
    import mlflow
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlcore.lifecycle.mlflow_store import MlflowStore, ModelRegistry, log_model_folder

    store = MlflowStore(mlflow_uri, experiment="models")
    run = store.start_run("train")
    log_model_folder(store, run, tiny_example.model_dir, "model")
    registry = ModelRegistry(store, "tiny-pyfunc")
    registry.set_alias("champion", registry.register(run, "model").version)

    model = mlflow.pyfunc.load_model("models:/tiny-pyfunc@champion")
    prompts, expected = _greedy_texts(tiny_example.model_dir, tiny_example.val_file, 6, max_new_tokens=8)
    got = model.predict(prompts, params={"max_new_tokens": 8})
    assert got == expected and all(text.strip() for text in got)
    assert model.predict(prompts[0], params={"max_new_tokens": 8}) == expected[:1]  # one prompt as a plain string
    assert model.metadata.get_params_schema().to_dict()[0]["name"] == "max_new_tokens"

    local = registry.download("champion", tmp_path / "dl")
    assert (local / "MLmodel").is_file() and (local / "code" / "hf_pyfunc.py").is_file()
    requirements = (local / "requirements.txt").read_text().split()
    assert any(r.startswith("torch==") for r in requirements) and any(r.startswith("transformers==") for r in requirements)
    # The same folder is the HF model, files at its root, weights unchanged.
    hf = AutoModelForCausalLM.from_pretrained(local, local_files_only=True)
    original = load_file(str(Path(tiny_example.model_dir) / "model.safetensors"))
    for name, tensor in original.items():
        torch.testing.assert_close(hf.state_dict()[name], tensor, rtol=0, atol=0)


def test_pyfunc_loads_without_rlcore_on_the_path(tiny_example, tmp_path):
    """The model's code is its own copy of hf_pyfunc: a process that cannot import rlcore loads
    the saved folder and generates."""
    import json
    import os
    import subprocess
    import sys

    from rlcore.lifecycle.hf_pyfunc import save_hf_pyfunc

    folder = save_hf_pyfunc(tiny_example.model_dir, tmp_path / "model")
    script = ("import json, sys, mlflow\n"
              "sys.modules['rlcore'] = None  # importing rlcore fails from here on\n"
              f"print(json.dumps(mlflow.pyfunc.load_model({str(folder)!r}).predict(['12+34='], params={{'max_new_tokens': 8}})))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert done.returncode == 0, done.stderr[-3000:]
    [text] = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(text, str) and text.strip()
