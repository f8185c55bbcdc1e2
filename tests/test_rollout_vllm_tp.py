"""Tensor-parallel vLLM rollout (`rollout.layout.tensor_parallel`): the rollout worker starts a
vLLM engine of two ranks (vLLM's own processes, each pinned to its share of the worker's cores),
which generates what rlcore's one-process hf backend generates (greedy responses equal, log-probs
to 1e-4), before and after a weight sync in buckets that cut through layers: every engine rank
gets the full tensors and takes its own slice (vLLM's loaders slice; see `bench_parallel.py
--loaders` for pre-sliced shards). Skipped where vLLM is not installed."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from test_rollout_vllm import prompt_batch, tiny_model  # noqa: E402  tests/ is on sys.path

from rlcore.config import config_from_dict, role_spec  # noqa: E402
from rlcore.rollout import SamplingParams  # noqa: E402
from rlcore.rollout import vllm as vllm_backend  # noqa: E402
from rlcore.workers.rollout import RolloutWorker  # noqa: E402

# The whole file is `slow`: its module imports vLLM (seconds per xdist worker), which `./dev fast`
# then does not import at all (tests/conftest.py, pytest_ignore_collect).
pytestmark = pytest.mark.slow

EXAMPLE_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def test_the_binding_gives_each_engine_rank_its_share_of_the_workers_cores(monkeypatch):
    monkeypatch.setattr(vllm_backend, "_USER_THREADS_BIND", None)
    monkeypatch.setattr(vllm_backend.os, "sched_getaffinity", lambda pid: {4, 5, 6, 7, 8}, raising=False)
    assert vllm_backend.tensor_parallel_binding(2) == "4,5,6|7,8"
    assert vllm_backend.tensor_parallel_binding(5) == "4|5|6|7|8"
    assert vllm_backend.tensor_parallel_binding(8) == "nobind"  # fewer cores than ranks: nothing pinned
    monkeypatch.setattr(vllm_backend, "_USER_THREADS_BIND", "0-3|4-7")
    assert vllm_backend.tensor_parallel_binding(2) == "0-3|4-7"  # an explicit setting wins


def _worker(folder, backend: str, layout: dict | None = None) -> RolloutWorker:
    tree = {"model": {"path": str(folder)}, "data": {"train_files": ["unused.parquet"]},
            "trainer": {"device": "cpu", "backend": "inprocess"},
            "rollout": {"backend": backend, "max_new_tokens": 10,
                        "vllm": {"kv_cache_gib": 0.125, "max_model_len": 128, "max_num_seqs": 16}}}
    if layout:
        tree["rollout"]["layout"] = layout
    worker = RolloutWorker(role_spec(config_from_dict(tree), "rollout"))
    worker.setup()
    return worker


@pytest.mark.slow
@pytest.mark.vllm
def test_a_tensor_parallel_engine_generates_and_syncs_as_one_process(tmp_path, tiny_example):
    folder = tmp_path / "a"
    tiny_model(0).save_pretrained(folder)
    for name in EXAMPLE_TOKENIZER:  # a tokenizer for the worker's pad and end tokens (ids 0 and 2)
        if (tiny_example.model_dir / name).is_file():
            shutil.copy(tiny_example.model_dir / name, folder / name)
    new_weights = list(tiny_model(1).named_parameters())
    batch = prompt_batch([5, 9, 2, 7])
    batch.meta["uid"] = np.array([f"p{i}" for i in range(4)], dtype=object)
    greedy = SamplingParams(n=1, do_sample=False, max_new_tokens=10)

    def run(worker: RolloutWorker) -> list:
        try:
            before = worker.generate_sequences(batch, greedy)
            for i in range(0, len(new_weights), 3):  # buckets that split attention and MLP groups
                worker.update_weights([(n, p.detach()) for n, p in new_weights[i:i + 3]])
            return [before, worker.generate_sequences(batch, greedy)]
        finally:
            worker.shutdown()

    want = run(_worker(folder, "hf"))
    tp = _worker(folder, "vllm", {"tensor_parallel": 2})
    assert tp.engine.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
    got = run(tp)
    assert want[0]["responses"].tolist() != want[1]["responses"].tolist()  # the sync changed the model
    for g, w in zip(got, want):
        assert g["responses"].tolist() == w["responses"].tolist()
        torch.testing.assert_close(g["rollout_log_probs"], w["rollout_log_probs"], atol=1e-4, rtol=0)
