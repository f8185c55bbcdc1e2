"""The rollout output batch every backend returns (the layout the workers downstream expect)."""

from __future__ import annotations

import os
import socket

import numpy as np
import torch

from rlcore.protocol import Batch
from rlcore.rollout.base import SamplingParams

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")


def check_left_padded(mask: torch.Tensor) -> None:
    """Reject right-padded prompts: decoding appends after the last column, so it must be real."""
    if mask.ndim != 2:
        raise ValueError(f"attention_mask must be [batch, prompt_len], got shape {tuple(mask.shape)}")
    bad = (mask[:, -1] == 0).nonzero().flatten()
    if bad.numel():
        raise ValueError(
            f"input_ids must be LEFT-padded (last column real for every row); rows {bad[:8].tolist()} "
            "end in padding (or are empty)"
        )


def rollout_output(
    batch: Batch,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor,
    params: SamplingParams,
) -> Batch:
    """Each prompt repeated n times next to its samples: prompts, responses, masks, positions.

    `responses`/`response_mask`/`log_probs` are [B*n, R], right-padded, rows grouped by prompt.
    """
    n = params.n
    prompt_ids = batch.tensors["input_ids"]
    prompt_mask = batch.tensors["attention_mask"]
    device = prompt_ids.device
    responses, response_mask, log_probs = (t.to(device) for t in (responses, response_mask, log_probs))
    tensors = {k: v.repeat_interleave(n, dim=0) for k, v in batch.tensors.items() if k not in PROMPT_KEYS}
    prompts = prompt_ids.repeat_interleave(n, dim=0)
    attention_mask = torch.cat([prompt_mask.repeat_interleave(n, dim=0), response_mask.to(prompt_mask.dtype)], dim=1)
    tensors.update(
        prompts=prompts,
        responses=responses,
        response_mask=response_mask,
        input_ids=torch.cat([prompts, responses], dim=1),
        attention_mask=attention_mask,
        position_ids=(attention_mask.long().cumsum(dim=1) - 1).clamp(min=0),
        rollout_log_probs=log_probs,
    )
    meta = {k: np.repeat(v, n, axis=0) for k, v in batch.meta.items()}
    meta.update(sample_trace_meta(batch, n))
    info = {**batch.info, "temperature": params.logprob_temperature}
    return Batch(tensors=tensors, meta=meta, info=info)


_HOST = socket.gethostname()


def sample_trace_meta(batch: Batch, n: int) -> dict[str, np.ndarray]:
    """Per-sample tracing ids: `request_id` "<uid>/<i>" (the i-th sample of its prompt; the row
    index stands in for a missing uid), and the host and pid of the process that generated it,
    so a slow or failing sample can be followed from prompt to loss."""
    b = len(batch)
    uids = batch.meta["uid"] if "uid" in batch.meta else np.arange(b)
    request_ids = np.array([f"{u}/{i}" for u in uids for i in range(n)], dtype=object)
    return {
        "request_id": request_ids,
        "rollout_host": np.full(b * n, _HOST, dtype=object),
        "rollout_pid": np.full(b * n, os.getpid(), dtype=np.int64),
    }
