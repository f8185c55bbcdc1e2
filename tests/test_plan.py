"""`rlcore plan`: the memory planner on small configs (a config.json alone, no weights).

What a user sees: the command prints every role's simulated per-rank peak per layout, the
smallest layout that fits and FLOPs per step per rank; a role that fits nowhere is named with the
smallest hardware that fits it (checked by simulating there and one node fewer); tensor-parallel
layouts are planned with the workers' own plans where the model's shape takes them. The simulation's depth extrapolation equals
simulating every layer. Its prediction is checked against the peak measured on 2 gloo ranks of the
same config (`benchmarks/bench_plan.py`: torch's tracker over the real tensors and the process's
resident memory). The private torch APIs it stands on are pinned by the lock and exercised here:
a change fails with a message naming the API and the torch versions.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config

from rlcore.cli import main as cli_main
from rlcore.config import load_config
from rlcore.flops import ModelFlops
from rlcore.plan import Hardware, parse_fraction, parse_size, process, torch_api
from rlcore.plan.models import ModelFacts, config_dict, read_config, with_layers
from rlcore.plan.roles import role_plans
from rlcore.plan.rollout import RolloutNeeds, plan_rollout
from rlcore.plan.simulate import Layout, simulate

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _model_dir(tmp_path: Path, layers: int = 2, **extra) -> Path:
    """A Qwen2 with grouped-query attention (4 query / 2 key-value heads) and tied embeddings, as a
    folder holding only its config.json."""
    folder = tmp_path / "model"
    Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, **extra).save_pretrained(folder)
    assert [p.name for p in folder.iterdir()] == ["config.json"]
    return folder


def _config_file(tmp_path: Path, model: Path) -> Path:
    path = tmp_path / "grpo.yaml"
    path.write_text(f"""
model: {{path: {model}, dtype: bfloat16, gradient_checkpointing: true}}
data: {{train_files: [unused.parquet], max_prompt_length: 32, train_batch_size: 4}}
actor: {{ppo_mini_batch_size: 4, max_tokens_per_micro_batch: 256, use_kl_loss: true}}
rollout: {{n: 4, max_new_tokens: 32, backend: vllm}}
""")
    return path


def _plan(capsys, *args: str) -> tuple[int, str]:
    code = cli_main(["plan", *args])
    return code, capsys.readouterr().out


@pytest.mark.slow
def test_plan_prints_each_roles_peaks_smallest_layout_and_flops(tmp_path, capsys):
    model = _model_dir(tmp_path)
    config_path = _config_file(tmp_path, model)
    config_path.write_text(config_path.read_text().replace("n: 4,", "n: 3,"))
    # as the usage shows it: the overrides after the options
    code, out = _plan(capsys, str(config_path), "--nodes", "1", "--devices-per-node", "2", "--device-memory", "1GiB", "rollout.n=4")
    assert code == 0, out
    for section in ("actor (Qwen2ForCausalLM", "ref (Qwen2ForCausalLM", "rollout (vLLM, bfloat16"):
        assert section in out
    assert "actor: fits, smallest 1 device" in out and "ref: fits, smallest 1 device" in out
    assert "rollout: fits, smallest TP 1" in out
    # every simulated layout is a row with its peak; FSDP over both devices with and without Ulysses, and
    # tensor parallelism over both (the workers' plan: q/k/v/gate/up column-wise, o/down row-wise, the
    # vocabulary-parallel embedding and head)
    actor_rows = re.findall(r"^  (FSDP 2(?: \(DP 1 x SP 2\))?|1 device|TP 2)\s+(\d+)\s+([\d.,]+) ([MG])iB\s+([\d.,]+) ([MG])iB",
                            out.split("ref (")[0], re.M)
    assert {row[0] for row in actor_rows} == {"1 device", "FSDP 2", "FSDP 2 (DP 1 x SP 2)", "TP 2"}
    params = {row[0]: float(row[4].replace(",", "")) * (1024 if row[5] == "G" else 1) for row in actor_rows}
    assert params["TP 2"] < 0.6 * params["1 device"]  # each rank holds its half of every split matrix
    # each column says what it is: the simulated tensor peak and its parts, and the modelled process RSS, whose
    # value is the tensor peak through rlcore.plan.process's measured constants
    header = next(line for line in out.splitlines() if line.lstrip().startswith("layout"))
    assert all(name in header for name in ("tensor peak", "grad shard", "grads in flight", "process RSS"))
    assert "process RSS: a CPU rank's resident memory, modelled (not simulated)" in out
    row = next(line for line in out.split("ref (")[0].splitlines() if line.startswith("  1 device"))
    sizes = [(float(v.replace(",", "")) * (1024 if u == "G" else 1), 0.05 * (1024 if u == "G" else 1))
             for v, u in re.findall(r"([\d.,]+) ([MG])iB", row)]  # (MiB, the rounding of its printing)
    (tensor_mib, tensor_error), (rss_mib, rss_error) = sizes[0], sizes[7]
    facts = ModelFacts.of(read_config(model, "model.path"), "lm", "model.path")
    fixed = process.BASELINE + process.STEP_FIXED + process.LOADING * facts.parameters * 4  # float32 master weights
    assert abs(rss_mib - (fixed / MIB + process.RETENTION * tensor_mib)) <= rss_error + process.RETENTION * tensor_error, row
    assert "actor.layout.tensor_parallel=" in out  # the smallest layout as the config keys that give it
    # FLOPs per step per rank: rlcore.flops for the step's 16 sequences of 64 tokens, on the row's devices
    # (one epoch of one mini-batch, on-policy: the update's own forward gives the old log-probs, no extra pass)
    assert load_config(config_path).old_log_probs_from_update
    flops = ModelFlops.from_hf_config(config_dict(read_config(model, "model.path")))
    actor_step = flops.training(16 * 64, 16 * 32, 16 * 64 * 65 / 2)
    assert f"{actor_step / 2:.3g}" in out.split("ref (")[0]


@pytest.mark.slow
def test_a_role_that_fits_nowhere_is_named_with_the_smallest_hardware_that_fits(tmp_path, capsys):
    model = _model_dir(tmp_path)
    config_path = _config_file(tmp_path, model)
    config_path.write_text(config_path.read_text().replace("use_kl_loss: true", "use_kl_loss: false"))  # the actor alone
    config = load_config(config_path)
    actor = next(p for p in role_plans(config) if p.role == "actor")
    model_config = read_config(model, "model.path")
    # a device a little smaller than the actor's lowest peak on both devices (with or without Ulysses):
    # sharded over more it fits
    on_two = min(simulate(actor, model_config, layout, uniform=True).total for layout in (Layout(2), Layout(1, 2)))
    memory = int(on_two / 0.9 * 0.97)
    code, out = _plan(capsys, str(config_path), "--nodes", "1", "--devices-per-node", "2", "--device-memory", str(memory),
                      "--tensor-parallel", "1")  # FSDP x SP only: fewer simulations
    assert code == 0
    assert "actor: DOES NOT FIT on this hardware" in out
    found = re.search(r"actor fits nowhere on 2 devices .*?Smallest hardware that fits it: (\d+) nodes x 2 devices .*?\(FSDP (\d+)"
                      r"(?: \(DP (\d+) x SP (\d+)\))?: ", out)
    assert found, out
    nodes, devices = int(found.group(1)), int(found.group(2))
    sp = int(found.group(4) or 1)
    usable = Hardware(1, 2, memory).usable
    assert devices == 2 * nodes
    assert simulate(actor, model_config, Layout(devices // sp, sp), uniform=True).total <= usable
    if nodes > 2:  # one node fewer does not fit (at any sequence-parallel size the model's heads allow)
        fewer = 2 * (nodes - 1)
        assert all(simulate(actor, model_config, Layout(fewer // s, s), uniform=True).total > usable for s in (1, 2))


@pytest.mark.slow
def test_depth_extrapolation_equals_simulating_every_layer(tmp_path):
    model = _model_dir(tmp_path, layers=6)
    config = load_config(_config_file(tmp_path, model))
    model_config = read_config(model, "model.path")
    actor = role_plans(config)[0]
    extrapolated = simulate(actor, model_config, Layout(2), uniform=True)
    exact = simulate(actor, model_config, Layout(2), uniform=True, exact=True)
    assert extrapolated.depths == (3, 4) and exact.depths == (6,)
    assert abs(extrapolated.total - exact.total) <= 0.01 * exact.total, (extrapolated, exact)


def test_layers_that_differ_are_simulated_at_full_depth(tmp_path):
    model = _model_dir(tmp_path, layers=4, layer_types=["full_attention", "sliding_attention"] * 2, use_sliding_window=True,
                       sliding_window=512)
    model_config = read_config(model, "model.path")
    assert not ModelFacts.of(model_config, "lm", "model.path").uniform
    assert ModelFacts.of(with_layers(model_config, 1), "lm", "model.path").uniform
    config = load_config(_config_file(tmp_path, model))
    ref = next(p for p in role_plans(config) if p.role == "ref")
    assert simulate(ref, model_config, Layout(2), uniform=False).depths == (4,)


def test_rollout_picks_the_smallest_tensor_parallel_size_whose_weights_and_kv_cache_fit(tmp_path):
    model = _model_dir(tmp_path)
    config = load_config(_config_file(tmp_path, model), ["rollout.vllm.gpu_memory_utilization=0.5", "rollout.vllm.block_size=16"])
    model_config = read_config(model, "model.path")
    needs = RolloutNeeds.of(config, model_config, ModelFacts.of(model_config, "lm", "model.path"))
    # one 64-token sequence: 4 blocks of 16 tokens x 2 (k, v) x 2 layers x 2 kv heads x 16 dims x 2 bytes
    assert plan_rollout(needs, 1, Hardware(1, 2, 2**30)).kv_per_sequence == 64 * 2 * 2 * 2 * 16 * 2
    weights_tp1 = plan_rollout(needs, 1, Hardware(1, 2, 2**30)).weights
    assert weights_tp1 == (needs.sharded_params + needs.whole_params) * 2
    # half the device holds TP 2's weights and a sequence, not TP 1's
    tp2 = plan_rollout(needs, 2, Hardware(1, 2, 2**30))
    memory = int(2 * (tp2.weights + 2 * tp2.kv_per_sequence))
    hardware = Hardware(1, 2, memory)
    plans = [plan_rollout(needs, t, hardware) for t in needs.tp_sizes(hardware)]
    assert [p.tp for p in plans] == [1, 2]
    assert [p.fits for p in plans] == [False, True]
    assert plans[1].weights < weights_tp1 and plans[1].concurrent >= 1


@pytest.mark.slow  # simulates 3 layers of the 70B actor at FSDP 4 x TP 4; fast: test_layers_that_differ_are_simulated_at_full_depth
def test_under_tensor_parallelism_the_gradient_shard_is_one_per_device_and_the_transient_is_apart():
    """The 70B actor (rlcore/configs/plan_llama3_70b_grpo.yaml, 3 of its layers) at FSDP 4 x TP 4: its
    peak falls in the backward, while FSDP reduces the root's (embedding and head) gradients. The
    'grad shard' column is the rank's 1/16 share (float32 master gradients: as large as the parameter
    shard); the unsharded gradients being reduced are 'grads in flight', which FSDP does not divide
    (so the planner's prediction for fewer devices does not scale them either)."""
    from rlcore.plan.simulate import simulate_depth

    config = load_config(ROOT / "rlcore" / "configs" / "plan_llama3_70b_grpo.yaml")
    actor = role_plans(config)[0]
    model_config = with_layers(read_config(ROOT / config.model.path, "model.path"), 3)
    peak = simulate_depth(actor, model_config, Layout(4, 1, 4), 3)
    parameters = ModelFacts.of(model_config, "lm", "model.path").parameters
    assert abs(peak.kinds["params"] - parameters * 4 / 16) <= 0.01 * peak.kinds["params"], peak
    assert abs(peak.kinds["grads"] - peak.kinds["params"]) <= 4096, peak  # the params also hold the rotary buffer
    assert peak.kinds["grads in flight"] > 2**30, peak  # the root's gathered gradients: GiBs, not a 1/16 share
    # the planner predicts other device counts by scaling the shards alone: FSDP 2 x TP 4 (8 devices) from this
    on_eight = simulate_depth(actor, model_config, Layout(2, 1, 4), 3)
    predicted = peak.total - peak.sharded + peak.sharded * 16 / 8
    assert abs(predicted - on_eight.total) <= 0.02 * on_eight.total, (predicted, on_eight)

def test_tensor_parallel_sizes_are_the_ones_the_workers_take(tmp_path, capsys):
    """Qwen2 with 4 query / 2 key-value heads on 8-device nodes: TP 1 and 2 (4 would split 2 key-value
    heads), Ulysses on top where a TP rank's heads allow; an architecture without a TP plan gets none;
    a size that does not divide a node is refused naming the flag."""
    from transformers import GPT2Config

    from rlcore.plan.planner import RoleResult, parallel_shapes

    config_path = _config_file(tmp_path, _model_dir(tmp_path))
    actor = role_plans(load_config(config_path))[0]
    model_config = read_config(tmp_path / "model", "model.path")
    result = RoleResult(actor, ModelFacts.of(model_config, "lm", "model.path"), 0.0)
    shapes = parallel_shapes(result, model_config, Hardware(1, 8, 2**30))
    assert {tp for _, tp in shapes} == {1, 2} and (2, 2) in shapes and (4, 1) in shapes and (4, 2) not in shapes
    assert parallel_shapes(result, model_config, Hardware(1, 8, 2**30), tensor_parallel=[2]) == [(1, 2), (2, 2)]
    gpt2 = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512)
    assert {tp for _, tp in parallel_shapes(result, gpt2, Hardware(1, 8, 2**30))} == {1}
    code = cli_main(["plan", str(config_path), "--device-memory", "80GiB", "--tensor-parallel", "3"])
    assert code == 2 and "--tensor-parallel 3: a tensor-parallel group lies within a node" in capsys.readouterr().err


def test_bad_hardware_arguments_are_refused_naming_the_flag(tmp_path, capsys):
    config_path = _config_file(tmp_path, _model_dir(tmp_path))
    assert parse_size("80GiB") == 80 * 2**30 and parse_size("96 GB") == 96 * 10**9 and parse_fraction("10%") == 0.1
    code = cli_main(["plan", str(config_path), "--device-memory", "80 gigs"])
    assert code == 2 and "--device-memory: '80 gigs' is not a size" in capsys.readouterr().err
    code = cli_main(["plan", str(config_path), "--device-memory", "80GiB", "--headroom", "150%"])
    assert code == 2 and "--headroom: '150%' must lie in [0, 1)" in capsys.readouterr().err
    code = cli_main(["plan", str(config_path), "model.path=/nowhere", "--device-memory", "80GiB"])
    assert code == 2 and "model.path: /nowhere has no config.json" in capsys.readouterr().err


# ----- the private torch APIs ---------------------------------------------------------------------


def test_private_torch_apis_are_pinned_and_work_as_the_planner_uses_them():
    pinned = re.search(r"^torch==(\S+)$", (ROOT / "requirements" / "lock.txt").read_text(), re.M)
    assert pinned and pinned.group(1) == torch_api.TESTED_TORCH, (
        f"requirements/lock.txt pins torch {pinned and pinned.group(1)}, but rlcore/plan/torch_api.py was checked with "
        f"{torch_api.TESTED_TORCH}: run this test file on the new torch and update TESTED_TORCH")
    torch_api.check()  # TorchAPIChanged, naming the API and both versions, if torch moved one


def test_a_moved_private_api_fails_loudly_naming_it(monkeypatch):
    import torch.distributed._tools.fsdp2_mem_tracker as tracker_module

    monkeypatch.delattr(tracker_module, "FSDPMemTracker")
    with pytest.raises(torch_api.TorchAPIChanged, match=r"torch .* changed a private API the planner uses \(torch.distributed."
                       r"_tools \(FSDPMemTracker, MemTracker\).*checked with torch 2\.13\.0 \(requirements/lock.txt\)"):
        torch_api.load()

    class Renamed:  # a tracker whose peak has a kind the planner does not know
        def get_tracker_snapshot(self, kind):
            return {torch.device("cpu"): {"Total": 1, "Gradient Bucket": 1}}

    with pytest.raises(torch_api.TorchAPIChanged, match="unknown kind 'Gradient Bucket'"):
        torch_api.peak_by_kind(Renamed())


# ----- against measured peaks ---------------------------------------------------------------------


def _bench():
    spec = importlib.util.spec_from_file_location("bench_plan", ROOT / "benchmarks" / "bench_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", ["actor-sp2", "actor-tp2"])
def test_prediction_is_within_20_percent_of_the_peak_measured_on_two_gloo_ranks(tmp_path, case):
    """The actor's update on 2 gloo ranks, FSDP2 over one Ulysses group, or one tensor-parallel group
    (the workers' TP plan): the planner's peak against torch's tracker over the real step's tensors
    and against the process's resident memory (see benchmarks/bench_plan.py, which also runs bf16
    with gradient checkpointing, the critic, the reference, FSDP x TP and 4 ranks)."""
    bench = _bench()
    result = bench.compare(case, bench.write_model(tmp_path / "model"))
    assert 0.8 <= result["vs_tracked"] <= 1.2, result
    assert 0.8 <= result["vs_rss"] <= 1.2, result
