"""Saving and restoring a trained role (`Trainable`: model, optimizer, scheduler) in a checkpoint
folder, under the role's name (`actor`, `critic`).

Files, for name `actor`:

- `actor/`: the model as a Hugging Face folder (safetensors; with the tokenizer for the policy),
  loadable by `from_pretrained` whatever wrote it;
- one process: `actor_optim.pt`, the optimizer and scheduler state;
- FSDP-sharded ranks: `actor_dcp/`, a torch distributed checkpoint of the sharded model and
  optimizer (a run with another number of ranks can load it), and `actor_scheduler.pt`.

A one-process checkpoint also resumes on several ranks (its optimizer state is re-keyed and
sharded). `.pt` files are read with `weights_only=True`: a checkpoint carries tensors and plain
values, never code that unpickling would run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from rlcore.workers.fsdp import is_sharded
from rlcore.workers.trainable import Trainable

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


def save_trained(trained: Trainable, folder: Path, name: str, rank: int, tokenizer_dir: Path | None = None) -> None:
    """Write `trained` under `name` in `folder`; every rank calls it (sharded saves are collective)."""
    if is_sharded(trained.model):
        _save_sharded(trained, folder, name, rank, tokenizer_dir)
    elif rank == 0:
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


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files of `src` into the model folder `dst` (existing files are kept)."""
    for file in TOKENIZER_FILES:
        if (src / file).is_file() and not (dst / file).exists():
            shutil.copy2(src / file, dst / file)


def _save_pretrained(model: torch.nn.Module, dst: Path, tokenizer_dir: Path | None, state_dict: dict | None = None) -> None:
    model.save_pretrained(dst, state_dict=state_dict, safe_serialization=True)
    if tokenizer_dir is not None:
        copy_tokenizer(Path(tokenizer_dir), dst)


def _save_sharded(trained: Trainable, folder: Path, name: str, rank: int, tokenizer_dir: Path | None) -> None:
    """HF safetensors of the full model (rank 0) plus a distributed checkpoint of the shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    full = get_model_state_dict(trained.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for alias in _tied_aliases(trained.model):  # as save_pretrained of an unsharded model writes it
        full.pop(alias, None)
    if rank == 0:
        _save_pretrained(trained.model, folder / name, tokenizer_dir, state_dict=full)
        torch.save({"scheduler": trained.scheduler.state_dict()}, folder / f"{name}_scheduler.pt")
    del full
    model_sd, optim_sd = get_state_dict(trained.model, trained.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / f"{name}_dcp"))


def _load_sharded(trained: Trainable, folder: Path, name: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(trained.model, trained.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(folder / f"{name}_dcp"), no_dist=not dist.is_initialized())
    set_state_dict(trained.model, trained.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched = torch.load(folder / f"{name}_scheduler.pt", map_location="cpu", weights_only=True)
    trained.scheduler.load_state_dict(sched["scheduler"])


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
