"""Device-mesh layouts of the trained roles: data parallel (FSDP2) x sequence parallel (Ulysses) x
tensor parallel (DTensor) on one named mesh ("dp", "sp", "tp"), and what moves weights between
layouts. The sharding layer: it imports no model-loading or forward code.

- `shapes`: what a model's config.json must satisfy for a layout (no torch; read at preflight);
- `mesh`: the mesh of a layout, made once per process group;
- `plans`: tensor-parallel plans (transformers' `base_model_tp_plan`, else rlcore's own for the
  Llama/Qwen2/Mistral families) and their application;
- `apply`: `apply_layout`, the one function a worker (or the memory planner) calls;
- `tensors`: local shards, replication over ranks, gradient clipping across meshes;
- `reshard`: weight sync from any actor layout to the rollout ranks, bucket by bucket.
"""
