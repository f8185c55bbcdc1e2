"""Layouts per role (`actor.layout`, `ref.layout`, `critic.layout`, `reward_model.layout`,
`rollout.layout`): what a config may ask for, refused at load or at preflight naming the key, and
how a layout is applied (plans, tied embeddings), checked in one process: under torch's fake
process group on the meta device (the memory planner's way) and with transformers' configs.
That a layout computes what one process computes is `test_tensor_parallel.py` (gloo ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tiny_models import ARCHS, SIZES
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from rlcore.config import ConfigError, LayoutConfig, dump_config, load_config
from rlcore.workers.parallel.apply import apply_layout
from rlcore.workers.parallel.mesh import device_mesh
from rlcore.workers.parallel.plans import NoTensorParallelPlan, decoder_plan
from rlcore.workers.parallel.shapes import layout_problems, plan_source

BASE = ["model.path=m", "data.train_files=[t.parquet]", "trainer.backend=ray"]
PPO = [*BASE, "algorithm.name=ppo", "algorithm.adv_estimator=gae"]
ROOT = Path(__file__).resolve().parents[1]


def test_a_layout_sets_the_world_and_the_old_keys_keep_working(tmp_path):
    cfg = load_config(None, [*PPO, "actor.layout={data_parallel: 2, tensor_parallel: 2}", "critic.layout={tensor_parallel: 2}",
                             "rollout.layout={data_parallel: 2, tensor_parallel: 2}"])
    assert (cfg.actor.world_size, cfg.actor.ulysses_sequence_parallel_size) == (4, 1)  # what the Ray groups are sized by
    assert cfg.layout_of("actor").ranks_per_shard == 2 and cfg.layout_of("ref") == cfg.layout_of("actor")
    assert (cfg.critic.world_size, cfg.rollout.world_size, cfg.rollout.tensor_parallel_size) == (2, 2, 2)
    # the legacy keys alone: world_size / Ulysses size data-parallel ranks (the critic's Ulysses size the actor's)
    old = load_config(None, [*PPO, "actor.world_size=4", "actor.ulysses_sequence_parallel_size=2", "critic.world_size=2"])
    assert old.layout_of("actor") == LayoutConfig(data_parallel=2, sequence_parallel=2)
    assert old.layout_of("critic") == LayoutConfig(data_parallel=1, sequence_parallel=2)
    assert old.layout_of("rollout") == LayoutConfig() and old.layout_key("actor", "sequence_parallel") == "actor.ulysses_sequence_parallel_size"
    # a dumped config (both keys written) loads again as the same run
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path).model_dump() == cfg.model_dump()


@pytest.mark.parametrize("overrides, message", [
    (["actor.layout={tensor_parallel: 2}", "actor.world_size=4"],
     "actor.world_size=4 disagrees with actor.layout (data_parallel=1 x sequence_parallel=1 x tensor_parallel=2 = 2 ranks)"),
    (["actor.layout={sequence_parallel: 2}", "actor.ulysses_sequence_parallel_size=4"],
     "actor.ulysses_sequence_parallel_size=4 disagrees with actor.layout"),
    (["actor.layout={tensor_parallel: 2}", "actor.lora.rank=4"], "actor.layout.tensor_parallel=2 with actor.lora"),
    (["algorithm.name=ppo", "algorithm.adv_estimator=gae", "critic.layout={tensor_parallel: 2}", "critic.lora.rank=4"],
     "critic.layout.tensor_parallel=2 with critic.lora"),
    (["critic.layout={tensor_parallel: 2}"], "critic.layout is set, but this run has no critic worker group"),
    (["ref.layout={tensor_parallel: 2}"], "ref.layout is set, but this run has no ref worker group"),
    (["ref.layout={tensor_parallel: 2}", "actor.use_kl_loss=true", "actor.lora.rank=4"],
     "with actor.lora the reference is the actor's own base"),
    (["rollout.layout={sequence_parallel: 2}"], "rollout.layout.sequence_parallel=2: rollout engines split"),
    (["rollout.layout={tensor_parallel: 2}", "rollout.backend=hf"], "rollout.layout.tensor_parallel=2 needs rollout.backend=vllm"),
    (["reward_model.path=rm", "reward_model.layout={sequence_parallel: 2}"], "reward_model.layout.sequence_parallel=2"),
    (["actor.layout={sequence_parallel: 2}", "model.use_remove_padding=false"],
     "actor.layout.sequence_parallel=2 needs model.use_remove_padding=true"),
    (["trainer.backend=inprocess", "actor.layout={tensor_parallel: 2}"],
     "actor.layout (data_parallel=1 x sequence_parallel=1 x tensor_parallel=2 = 2 ranks) needs trainer.backend=ray"),
    (["actor.layout={tensor_parallel: 0}"], "actor.layout.tensor_parallel"),
])
def test_layouts_that_cannot_work_are_refused_at_load_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config(None, [*BASE, *overrides])


def _folder(tmp_path, name, config):
    config.save_pretrained(tmp_path / name)
    return tmp_path / name


def test_model_shapes_and_architectures_are_checked_at_preflight_naming_the_key(tmp_path):
    """From each model folder's config.json, before any model loads."""
    odd = _folder(tmp_path, "odd", Qwen2Config(**{**SIZES, "vocab_size": 66, "intermediate_size": 66}, num_attention_heads=6,
                                                   num_key_value_heads=3))
    cfg = load_config(None, [*BASE, f"model.path={odd}", "actor.layout={tensor_parallel: 2}", "actor.use_kl_loss=true",
                             "ref.layout={tensor_parallel: 4}", "rollout.layout={tensor_parallel: 4}"])
    assert layout_problems(cfg) == [
        f"actor.layout.tensor_parallel=2: the model's key/value heads (3) is not divisible by tensor_parallel=2 ({odd})",
        f"ref.layout.tensor_parallel=4: the model's attention heads (6) is not divisible by tensor_parallel=4 ({odd})",
        f"ref.layout.tensor_parallel=4: the model's key/value heads (3) is not divisible by tensor_parallel=4 ({odd})",
        f"ref.layout.tensor_parallel=4: the model's vocabulary (66) is not divisible by tensor_parallel=4 ({odd})",
        f"ref.layout.tensor_parallel=4: the model's intermediate size (66) is not divisible by tensor_parallel=4 ({odd})",
        f"rollout.layout.tensor_parallel=4: the model's 6 attention heads do not divide by it ({odd}; each vLLM rank "
        "serves an equal share of them)"]
    # Ulysses splits what one tensor-parallel rank holds: 4 heads / 2 = 2, then / 4 does not go; the
    # sequence-parallel size is at fault, named once (the reference shares the actor's layout)
    llama = _folder(tmp_path, "llama", ARCHS["llama"][0])
    sp = load_config(None, [*BASE, f"model.path={llama}", "actor.layout={tensor_parallel: 2, sequence_parallel: 4}",
                            "actor.use_kl_loss=true"])
    assert "ref" in sp.trained_roles
    assert layout_problems(sp) == [f"actor.layout.sequence_parallel=4: each of the 2 tensor-parallel ranks holds 2 of the "
                                   f"model's 4 attention heads, and 2 do not divide by 4, with actor.layout.tensor_parallel=2 "
                                   f"({llama}; Ulysses splits a rank's attention heads over its sequence-parallel group)"]
    # without tensor parallelism, under the key the user set (not the legacy one)
    alone = load_config(None, [*BASE, f"model.path={llama}", "actor.layout={sequence_parallel: 8}"])
    assert layout_problems(alone) == [f"actor.layout.sequence_parallel=8: the model's 4 attention heads do not divide by 8 "
                                      f"({llama}; Ulysses splits a rank's attention heads over its sequence-parallel group)"]
    gpt2 = _folder(tmp_path, "gpt2", GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64))
    arch = load_config(None, [*BASE, f"model.path={gpt2}", "actor.layout={tensor_parallel: 2}"])
    assert any("model_type 'gpt2'" in p and "has no tensor-parallel plan" in p for p in layout_problems(arch))
    assert layout_problems(load_config(None, [*BASE, f"model.path={llama}", "actor.layout={tensor_parallel: 2}"])) == []


def test_train_names_the_sequence_parallel_size_a_tensor_parallel_ranks_heads_cannot_take(tiny_example, tmp_path, capsys):
    """`rlcore train` on the tiny example (8 attention heads) at sequence parallel 8 x tensor
    parallel 2: each TP rank holds 4 heads, which 8 Ulysses ranks cannot split. One line at
    preflight, before Ray starts, naming the sequence-parallel key and both head counts."""
    from rlcore.cli import main as cli_main

    code = cli_main(["train", str(ROOT / "rlcore/configs/tiny_grpo.yaml"), f"model.path={tiny_example.model_dir}",
                     f"data.train_files=[{tiny_example.train_file}]", f"data.val_files=[{tiny_example.val_file}]",
                     "trainer.backend=ray", f"trainer.output_dir={tmp_path / 'run'}",
                     "actor.layout={sequence_parallel: 8, tensor_parallel: 2}"])
    assert code == 2
    assert capsys.readouterr().err == (
        f"rlcore: error: actor.layout.sequence_parallel=8: each of the 2 tensor-parallel ranks holds 4 of the model's 8 "
        f"attention heads, and 4 do not divide by 8, with actor.layout.tensor_parallel=2 ({tiny_example.model_dir}; Ulysses "
        "splits a rank's attention heads over its sequence-parallel group)\n")


def test_plans_come_from_transformers_else_from_rlcore_else_the_architecture_is_refused():
    for config in (LlamaConfig(), Qwen2Config(), MistralConfig()):
        assert plan_source(config.to_dict()) == "transformers"
    model = ARCHS["llama"][1](ARCHS["llama"][0])
    assert decoder_plan(model)[1] == "transformers"
    model.config.base_model_tp_plan = None  # a config without one (older transformers, a custom class)
    plan, source = decoder_plan(model)
    assert source == "rlcore" and plan["layers.*.self_attn.q_proj"] == "colwise" and plan["layers.*.mlp.down_proj"] == "rowwise"
    from transformers import GPT2LMHeadModel

    with pytest.raises(NoTensorParallelPlan, match=r"actor.layout.tensor_parallel=2: GPT2LMHeadModel \(model_type 'gpt2'\) has no "):
        decoder_plan(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64)), "actor.layout.tensor_parallel=2")


@pytest.fixture
def fake_world():
    """torch's fake process group of 4 ranks in this process (collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield 4
    finally:
        dist.destroy_process_group()


def test_apply_layout_on_the_meta_device_under_a_fake_process_group_keeps_embeddings_tied(fake_world):
    """What the memory planner does: a model on the meta device split 2 x 2 (FSDP2 x TP) with
    no data anywhere; each rank's shard is a quarter of a split matrix, a tied head stays the
    embedding, norms are FSDP-sharded only."""
    config, lm, _ = ARCHS["qwen2-gqa"]
    with torch.device("meta"):
        model = lm(config)
    layout = LayoutConfig(data_parallel=2, tensor_parallel=2)
    model = apply_layout(model, layout, torch.device("cpu"), tp_key="actor.layout.tensor_parallel", sp_key="-",
                         mesh=device_mesh(layout, "cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.device.type == "meta" and tuple(q.to_local().shape) == (8, 32) and q.device_mesh.mesh_dim_names == ("dp_sp", "tp")
    norm = model.model.norm.weight
    assert tuple(norm.to_local().shape) == (16,) and norm.device_mesh.mesh_dim_names == ("dp_sp",)
