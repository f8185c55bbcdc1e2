"""Saving and restoring a trained role (`Trainable`: model, optimizer, scheduler) in a checkpoint
folder, under the role's name (`actor`, `critic`).

Files, for name `actor`:

- `actor/`: the model as a Hugging Face folder (safetensors; with the tokenizer for the policy),
  loadable by `from_pretrained` whatever wrote it;
- one process: `actor_optim.pt`, the optimizer and scheduler state;
- FSDP-sharded ranks: `actor_dcp/`, a torch distributed checkpoint of the sharded model and
  optimizer (a run with another number of ranks can load it), and `actor_scheduler.pt`.

With LoRA (`Trainable.adapter`) the frozen base is not saved (the run's `model.path` holds it):
`actor_adapter/` replaces `actor/`, the adapter as peft saves one (`adapter_config.json`,
`adapter_model.safetensors`; `PeftModel.from_pretrained` and vLLM load it), and the optimizer
state and `actor_dcp/` cover the trained parameters only; `rlcore.workers.lora.merge_adapter`
makes the servable merged folder.

A one-process checkpoint also resumes on several ranks (its optimizer state is re-keyed and
sharded). `.pt` files are read with `weights_only=True`: a checkpoint carries tensors and plain
values, never code that unpickling would run. The distributed checkpoint is held to the same
rule (`load_dcp`): torch reads its `.metadata` with plain `pickle.load` and its non-tensor values
with `torch.load(weights_only=False)`, so here the metadata is unpickled with only the classes
DCP metadata is made of, and every other value with `weights_only=True`; anything else is an
`UnsafeCheckpointError` naming the file, raised before any of it runs.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from rlcore.checkpoint import weights_only_reason
from rlcore.errors import RLCoreError
from rlcore.workers.fsdp import is_sharded
from rlcore.workers.tokenizer import copy_tokenizer
from rlcore.workers.trainable import Trainable


def adapter_folder(name: str) -> str:
    """The checkpoint folder of role `name`'s LoRA adapter."""
    return f"{name}_adapter"


def save_trained(trained: Trainable, folder: Path, name: str, rank: int, tokenizer_dir: Path | None = None) -> None:
    """Write `trained` under `name` in `folder`; every rank calls it (sharded saves are collective)."""
    if is_sharded(trained.model):
        _save_sharded(trained, folder, name, rank, tokenizer_dir)
    elif rank == 0:
        if trained.adapter is not None:
            trained.adapter.save(folder / adapter_folder(name), keep=True)
        else:
            _save_pretrained(trained.model, folder / name, tokenizer_dir)
        state = {"optimizer": trained.optimizer.state_dict(), "scheduler": trained.scheduler.state_dict()}
        torch.save(state, folder / f"{name}_optim.pt")


def load_training_state(trained: Trainable, folder: Path, name: str, device: torch.device) -> None:
    """Optimizer and scheduler state (and, from a sharded checkpoint, the model) into a freshly
    set-up `trained` whose model was loaded from `folder / name`."""
    if (folder / f"{name}_dcp").is_dir():
        _load_sharded(trained, folder, name)
    elif is_sharded(trained.model):  # a one-process checkpoint resumed on several ranks
        _load_full_into_sharded(trained, folder / f"{name}_optim.pt")
    else:
        state = torch.load(folder / f"{name}_optim.pt", map_location=device, weights_only=True)
        trained.optimizer.load_state_dict(state["optimizer"])
        trained.scheduler.load_state_dict(state["scheduler"])


def _save_pretrained(model: torch.nn.Module, dst: Path, tokenizer_dir: Path | None, state_dict: dict | None = None) -> None:
    model.save_pretrained(dst, state_dict=state_dict, safe_serialization=True)
    if tokenizer_dir is not None:
        copy_tokenizer(Path(tokenizer_dir), dst)


def _save_sharded(trained: Trainable, folder: Path, name: str, rank: int, tokenizer_dir: Path | None) -> None:
    """HF safetensors of the full model, or the LoRA adapter (rank 0), plus a distributed checkpoint
    of the shards (of the trained parameters only, with LoRA)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    if trained.adapter is not None:
        trained.adapter.save(folder / adapter_folder(name), keep=rank == 0)
    else:
        full = get_model_state_dict(trained.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        for alias in _tied_aliases(trained.model):  # as save_pretrained of an unsharded model writes it
            full.pop(alias, None)
        if rank == 0:
            _save_pretrained(trained.model, folder / name, tokenizer_dir, state_dict=full)
        del full
    if rank == 0:
        torch.save({"scheduler": trained.scheduler.state_dict()}, folder / f"{name}_scheduler.pt")
    model_sd, optim_sd = get_state_dict(trained.model, trained.optimizer, options=_dcp_options(trained))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / f"{name}_dcp"))


def _load_sharded(trained: Trainable, folder: Path, name: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = _dcp_options(trained)
    model_sd, optim_sd = get_state_dict(trained.model, trained.optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    load_dcp(state, folder / f"{name}_dcp")
    set_state_dict(trained.model, trained.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    sched = torch.load(folder / f"{name}_scheduler.pt", map_location="cpu", weights_only=True)
    trained.scheduler.load_state_dict(sched["scheduler"])


def _dcp_options(trained: Trainable) -> Any:
    """A distributed checkpoint holds the trained parameters only when the base is frozen (LoRA):
    loading it then leaves the frozen base as loaded (not strict; `load_dcp` still fails on any
    trained parameter the checkpoint lacks, as it reads every key asked for)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = trained.adapter is not None
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _load_full_into_sharded(trained: Trainable, path: Path) -> None:
    """A plain optimizer state (keyed by parameter position) into a sharded optimizer: re-key it by
    parameter name, the form `set_optimizer_state_dict` shards from."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = torch.load(path, map_location="cpu", weights_only=True)
    osd = state["optimizer"]
    names = [n for n, p in trained.model.named_parameters() if p.requires_grad]
    by_name = {
        "state": {names[i]: v for i, v in osd["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]],
    }
    set_optimizer_state_dict(trained.model, trained.optimizer, by_name, options=StateDictOptions(full_state_dict=True))
    trained.scheduler.load_state_dict(state["scheduler"])


def _tied_aliases(model: torch.nn.Module) -> list[str]:
    """Later names of parameters shared under several names (tied embeddings: lm_head.weight)."""
    first: dict[int, str] = {}
    aliases = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases.append(name)
        else:
            first[id(p)] = name
    return aliases


# ---------------------------------------------------------------------- safe DCP reads
class UnsafeCheckpointError(RLCoreError, RuntimeError):
    """A checkpoint file holds something other than data (loading it could run code), or is not
    the file it claims to be; the message names the file."""


DCP_METADATA = "torch.distributed.checkpoint.metadata"
# What a DCP `.metadata` pickle refers to (torch 2.13, FSDP2 model + optimizer; found by listing
# the globals of real ones), besides torch's dtypes. Each is a plain data class, an enum, or a
# lookup (`_get_layout`: layout by name): none runs code of the file's choosing.
DCP_METADATA_GLOBALS = frozenset({
    (DCP_METADATA, "Metadata"), (DCP_METADATA, "MetadataIndex"), (DCP_METADATA, "StorageMeta"),
    (DCP_METADATA, "TensorStorageMetadata"), (DCP_METADATA, "BytesStorageMetadata"),
    (DCP_METADATA, "ChunkStorageMetadata"), (DCP_METADATA, "TensorProperties"), (DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})


class _Refused(pickle.UnpicklingError):
    """The pickle asks for something checkpoint metadata never contains."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Refused(f"it refers to {module}.{name}, which is not part of checkpoint metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("it has a persistent id, which checkpoint metadata never has")


def read_dcp_metadata(path: Path) -> Metadata:
    """A DCP `.metadata` file, unpickled with only the classes DCP metadata is made of."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as err:
        raise UnsafeCheckpointError(f"{path}: refused to load this checkpoint metadata: {err}. A checkpoint holds "
                                    "data only; this file was not written by torch.distributed.checkpoint") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError, ValueError) as err:
        raise UnsafeCheckpointError(f"{path}: not a readable checkpoint metadata file ({type(err).__name__}: {err})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not checkpoint metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with the metadata read by `read_dcp_metadata` instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_dcp_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with non-tensor values (optimizer hyperparameters, steps) checked by
    `torch.load(weights_only=True)` before torch's own `weights_only=False` load sees them."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(io.BytesIO(value.getvalue()), weights_only=True)
        except pickle.UnpicklingError as err:
            why = weights_only_reason(err)
            raise UnsafeCheckpointError(f"{self.folder}: refused to load the value of {read_item.dest_index.fqn!r} "
                                        f"from its data files: it is not plain data ({why})") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def check_dcp_metadata(folder: Path) -> None:
    """Every `.metadata` file of a distributed checkpoint folder passes `read_dcp_metadata`."""
    files = sorted(folder.glob("*.metadata"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .metadata file: not a complete distributed checkpoint")
    for path in files:
        read_dcp_metadata(path)


def load_dcp(state: dict[str, Any], folder: Path) -> None:
    """`dcp.load` of `folder` into `state`, refusing anything but data (see the module's doc)."""
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    check_dcp_metadata(folder)  # a clear error before DCP starts (it would wrap this one)
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(folder),
                 no_dist=not dist.is_initialized())
    except CheckpointException as err:  # DCP gathers each rank's error into one
        for exc, _trace in err.failures.values():
            if isinstance(exc, UnsafeCheckpointError):
                raise exc from None
        raise
