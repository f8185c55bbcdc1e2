"""The rollout output batch every backend returns (the layout the workers downstream expect)."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

import numpy as np
import torch

from rlcore.protocol import Batch
from rlcore.rollout.base import SamplingParams

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")
# rollout output tensor [N, R] beside `responses`: the policy version each token was drawn under
# (an engine that takes new weights between decode steps: `rlcore.rollout.base.WeightSwitch`)
TOKEN_VERSIONS = "token_versions"


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


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists as LEFT-padded `[B, max_len]` ids and attention mask (decoding appends at the right)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask


def rollout_output(
    batch: Batch,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor,
    params: SamplingParams,
    response_attention: torch.Tensor | None = None,
) -> Batch:
    """Each prompt repeated n times next to its samples: prompts, responses, masks, positions.

    `responses`/`response_mask`/`log_probs` are [B*n, R], right-padded, rows grouped by prompt.
    `response_attention` [B*n, R]: the response tokens attended to, when that is more than the
    trained ones (`response_mask`): an agent rollout's tool outputs are context, not loss.
    """
    n = params.n
    prompt_ids = batch.tensors["input_ids"]
    prompt_mask = batch.tensors["attention_mask"]
    device = prompt_ids.device
    responses, response_mask, log_probs = (t.to(device) for t in (responses, response_mask, log_probs))
    attended = (response_mask if response_attention is None else response_attention).to(device)
    tensors = {k: v.repeat_interleave(n, dim=0) for k, v in batch.tensors.items() if k not in PROMPT_KEYS}
    prompts = prompt_ids.repeat_interleave(n, dim=0)
    attention_mask = torch.cat([prompt_mask.repeat_interleave(n, dim=0), attended.to(prompt_mask.dtype)], dim=1)
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
    return Batch(tensors=tensors, meta=meta, info=dict(batch.info))


def response_right_pad(pad_token_id: int) -> dict[str, float | str]:
    """How `rollout_output`'s response-wide tensors extend to the right (`Batch.concat`'s
    `info[RIGHT_PAD]`): pad tokens, masks and log-probs 0, positions as the row's last (what
    `rollout_output` gives a row whose response ended early)."""
    return {"responses": pad_token_id, "input_ids": pad_token_id, "response_mask": 0, "attention_mask": 0,
            "rollout_log_probs": 0.0, "position_ids": "edge", TOKEN_VERSIONS: "edge"}


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
