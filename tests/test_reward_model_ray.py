"""The reward_model role on Ray: its own resource pool, two data-parallel ranks (two Ray actors,
one model each, a process group between them for sharding), scoring a batch exactly as the
in-process group does: the dispatch splits the rows by tokens and puts them back in order."""

from __future__ import annotations

import pytest
import torch
from test_reward_model import _generated, _policy_dir, other_tokenizer, rl_config, save_rm
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

from rlcore.config import role_spec
from rlcore.controller import InProcessWorkerGroup
from rlcore.example.tokenizer import build_tokenizer
from rlcore.workers.reward_model import RewardModelWorker

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.distributed]  # 2 reward-model ranks on gloo


def test_reward_model_pool_with_two_ranks_scores_as_one_process(tmp_path, ray_driver):
    from rlcore.controller.ray_backend import RayWorkerGroup
    from rlcore.controller.ray_placement import ResourcePool

    rm_dir = save_rm(tmp_path / "rm", other_tokenizer())
    config = rl_config(_policy_dir(tmp_path), rm_dir)
    policy_tok = build_tokenizer()
    eos = policy_tok.eos_token_id
    prompts = [f"{a}+{b}=" for a, b in ((12, 34), (57, 68), (9, 9), (40, 41), (13, 77))]
    responses = [policy_tok(f"#### {a + b + k}", add_special_tokens=False)["input_ids"] + [eos]
                 for k, (a, b) in enumerate(((12, 34), (57, 68), (9, 9), (40, 41), (13, 77)))]
    gen = _generated(policy_tok, prompts, responses)

    local = InProcessWorkerGroup(lambda r, ws: RewardModelWorker(role_spec(config, "reward_model"), r, ws), role="reward_model")
    try:
        want = local.compute_rm_score(gen)["rm_scores"]
    finally:
        local.shutdown()

    pool = None
    try:
        pool = ResourcePool("rm", 2, cpus_per_bundle=1.0)
        group = RayWorkerGroup(lambda r, ws: RewardModelWorker(role_spec(config, "reward_model"), r, ws), 2, "reward_model", pool=pool,
                               distributed=True, call_timeout_s=scaled(300), init_timeout_s=scaled(300))
        try:
            got = group.compute_rm_score(gen)
            pids = {ident["pid"] for ident in group.identities()}
        finally:
            group.shutdown()
    finally:
        if pool is not None:
            pool.remove()
    assert len(pids) == 2  # two ranks, two processes
    torch.testing.assert_close(got["rm_scores"], want, rtol=1e-5, atol=1e-5)  # 5 rows over 2 ranks (one padded), order kept
    assert list(got.meta["rm_response_text"]) == [f"#### {a + b + k}" for k, (a, b) in
                                                  enumerate(((12, 34), (57, 68), (9, 9), (40, 41), (13, 77)))]
