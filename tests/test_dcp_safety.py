"""A distributed (DCP) checkpoint is loaded as data only. torch reads a DCP folder's `.metadata`
with plain `pickle.load` and its non-tensor values with `torch.load(weights_only=False)`: a
planted pickle would run its code on resume. rlcore refuses both with an error naming the file,
before anything runs, and still loads a genuine FSDP2 checkpoint."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from rlcore.workers.checkpointing import (
    UnsafeCheckpointError,
    load_dcp,
    load_training_state,
    read_dcp_metadata,
    save_trained,
)


class Payload:
    """What an attacker plants: unpickling it creates `marker` (a stand-in for any code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def plain_dcp(folder: Path, extra: dict | None = None) -> dict:
    """A DCP save of a plain state dict in this process (no process group)."""
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3), "step": 7, "betas": (0.9, 0.99), **(extra or {})}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return state


def test_payload_works_when_unpickled_plainly(tmp_path):
    """The test's payload is live: plain pickle (what torch does) runs it."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


def test_planted_metadata_is_refused_and_never_runs(tmp_path):
    folder, marker = tmp_path / "actor_dcp", tmp_path / "pwned"
    plain_dcp(folder)
    metadata = read_dcp_metadata(folder / ".metadata")  # genuine: passes
    metadata.planner_data = Payload(marker)  # the same metadata, with a payload riding along
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    target = {"w": torch.zeros(2, 3), "b": torch.zeros(3), "step": 0, "betas": (0.0, 0.0)}
    with pytest.raises(UnsafeCheckpointError) as info:
        load_dcp(target, folder)
    message = str(info.value)
    assert str(folder / ".metadata") in message and "builtins.exec" in message
    assert not marker.exists()
    assert torch.equal(target["w"], torch.zeros(2, 3))  # nothing was loaded either


def test_metadata_that_is_not_metadata_is_refused(tmp_path):
    folder = tmp_path / "actor_dcp"
    plain_dcp(folder)
    (folder / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: holds a dict, not checkpoint metadata"):
        load_dcp({"w": torch.zeros(2, 3)}, folder)
    (folder / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: not a readable checkpoint metadata file"):
        load_dcp({"w": torch.zeros(2, 3)}, folder)


def test_planted_value_in_the_data_file_is_refused_and_never_runs(tmp_path):
    """A non-tensor value is stored as a pickle in the `.distcp` data file; its metadata entry is
    harmless, so only the value's own check can stop it."""
    folder, marker = tmp_path / "actor_dcp", tmp_path / "pwned"
    plain_dcp(folder, {"evil": Payload(marker)})
    assert not marker.exists()
    read_dcp_metadata(folder / ".metadata")  # the metadata itself is clean
    target = {"w": torch.zeros(2, 3), "b": torch.zeros(3), "step": 0, "betas": (0.0, 0.0), "evil": None}
    refused = r"refused to load the value of 'evil' from its data files: it is not plain data \(Unsupported global: GLOBAL exec"
    with pytest.raises(UnsafeCheckpointError, match=refused) as info:
        load_dcp(target, folder)
    assert str(folder) in str(info.value)
    assert not marker.exists()


def test_genuine_plain_checkpoint_loads(tmp_path):
    folder = tmp_path / "actor_dcp"
    saved = plain_dcp(folder)
    target = {"w": torch.zeros(2, 3), "b": torch.zeros(3), "step": 0, "betas": (0.0, 0.0)}
    load_dcp(target, folder)
    assert torch.equal(target["w"], saved["w"]) and torch.equal(target["b"], saved["b"])
    assert target["step"] == 7 and tuple(target["betas"]) == (0.9, 0.99)


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True, pad_token_id=0))


def _sharded_trainable(lr: float = 1e-2):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rlcore.config import OptimConfig
    from rlcore.workers.optim import build_optimizer, build_scheduler
    from rlcore.workers.trainable import Trainable

    model = _tiny_llama()
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    cfg = OptimConfig(lr=lr)
    optimizer = build_optimizer(model, cfg)
    return Trainable(model, optimizer, build_scheduler(optimizer, cfg, 10))


@pytest.mark.slow
def test_genuine_fsdp2_checkpoint_resumes(tmp_path):
    """An FSDP2 model + AdamW state (one gloo rank in this process) saved by rlcore (`actor_dcp/`)
    resumes through the checks with every weight and optimizer moment equal."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trained = _sharded_trainable()
        ids = torch.randint(0, 48, (2, 6), generator=torch.Generator().manual_seed(0))
        trained.model(ids).logits.sum().backward()
        trained.optimizer.step(), trained.scheduler.step()
        save_trained(trained, tmp_path, "actor", rank=0)
        assert (tmp_path / "actor_dcp" / ".metadata").is_file()
        read_dcp_metadata(tmp_path / "actor_dcp" / ".metadata")

        resumed = _sharded_trainable()
        load_training_state(resumed, tmp_path, "actor", torch.device("cpu"))
        for (name, a), (_, b) in zip(trained.model.state_dict().items(), resumed.model.state_dict().items()):
            assert torch.equal(a.full_tensor(), b.full_tensor()), name
        sa, sb = trained.optimizer.state_dict(), resumed.optimizer.state_dict()
        assert sa["param_groups"][0]["lr"] == sb["param_groups"][0]["lr"] and resumed.lr == trained.lr
        for key, moments in sa["state"].items():
            assert torch.equal(moments["exp_avg"].full_tensor(), sb["state"][key]["exp_avg"].full_tensor()), key
    finally:
        dist.destroy_process_group()
