"""Device memory budgets (`rlcore.workers.memory`): the `auto` micro-batch size and the
`rollout.sleep: auto` decision as pure functions of given byte numbers, the per-token activation
estimate against the planner's simulation, the config keys (`auto`, numbers, junk, the older
spelling of `rollout.sleep`), and the first step's out-of-memory halving, driven on the CPU by a
stand-in that raises torch's CUDA out-of-memory error (there is no GPU here to run out of)."""

from __future__ import annotations

import gc
import logging
import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config

from rlcore.algos import get_policy_loss
from rlcore.cli import main as cli_main
from rlcore.config import ActorConfig, ConfigError, dump_config, load_config, load_sft_config
from rlcore.protocol import Batch
from rlcore.workers.actor import PolicyObjective
from rlcore.workers.loops import MicroBatching, UpdateSettings, forward_no_grad, run_update
from rlcore.workers.memory import (
    CPU_MICRO_BATCH_TOKENS,
    MAX_AUTO_TOKENS,
    MIN_AUTO_TOKENS,
    ActivationCost,
    MicroBudget,
    per_token_text,
    size_micro_batch,
    sleep_decision,
)
from rlcore.workers.optim import build_optimizer, build_scheduler
from rlcore.workers.policy import PolicyLogProbs
from rlcore.workers.trainable import Trainable

GIB, MIB = 2**30, 2**20
CPU = torch.device("cpu")
KEY = "actor.max_tokens_per_micro_batch"


# ------------------------------------------------------------------ the micro-batch size, from given numbers


def test_bytes_per_token_read_at_their_scale():
    assert [per_token_text(b) for b in (1.5 * MIB, 12.3 * 1024, 640)] == ["1.50 MiB", "12.3 KiB", "640 bytes"]


def test_auto_on_a_cpu_is_the_fixed_default_and_says_why():
    choice = size_micro_batch(KEY, device="cpu", total=64 * GIB, available=60 * GIB, per_token=1.0)
    assert choice.tokens == CPU_MICRO_BATCH_TOKENS == 8192
    assert choice.reason.startswith(f"{KEY}=auto: 8,192 tokens on the CPU (the fixed default")


@pytest.mark.parametrize("available,to_come,fixed,per_token,tokens", [
    # (70 - 6 - 1 - 8 GiB margin) = 55 GiB at 1 MiB per token: 56,320 tokens, a multiple of 256
    (70 * GIB, 6 * GIB, 1 * GIB, 1 * MIB, 56_320),
    (70 * GIB, 6 * GIB, 1 * GIB, 3 * MIB, 18_688),   # 55 GiB / 3 MiB = 18,773 -> down to 256s
    (9 * GIB, 0, 0, 1 * MIB, 1024),                  # 9 - 8 GiB margin = 1 GiB
    (8 * GIB, 1 * GIB, 0, 1 * MIB, MIN_AUTO_TOKENS),  # nothing left after the margin: the minimum, said so
    (80 * GIB, 0, 0, 16, MAX_AUTO_TOKENS),           # a toy model on a large device: capped
])
def test_auto_on_a_device_fills_what_is_free_after_what_is_to_come_and_a_margin(available, to_come, fixed, per_token, tokens):
    choice = size_micro_batch(KEY, device="cuda:0", total=80 * GIB, available=available, to_come=to_come, fixed=fixed,
                              per_token=per_token)
    assert choice.tokens == tokens
    assert choice.reason.startswith(f"{KEY}=auto: {tokens:,} tokens on cuda:0")
    assert f"8.0 GiB margin (10% of 80.0 GiB)) / {per_token_text(per_token)} of activations per token" in choice.reason
    assert ("gradients and optimizer state to come" in choice.reason) == bool(to_come)
    assert ("short of memory" in choice.reason) == (tokens == MIN_AUTO_TOKENS)
    assert ("capped" in choice.reason) == (tokens == MAX_AUTO_TOKENS)


def test_the_whole_log_line_of_a_device_choice():
    choice = size_micro_batch(KEY, device="cuda:0", total=140 * GIB, available=130 * GIB, to_come=6 * GIB, fixed=GIB // 2,
                              per_token=1.5 * MIB)
    assert choice.reason == (f"{KEY}=auto: 74,752 tokens on cuda:0: (130.0 GiB free - 6.0 GiB gradients and optimizer state "
                             "to come - 512.0 MiB head chunk - 14.0 GiB margin (10% of 140.0 GiB)) / 1.50 MiB of activations "
                             "per token")


# ------------------------------------------------------------------ the sleep decision, from given numbers


@pytest.mark.parametrize("peak,engine,sleeps", [
    (60 * GIB, 1 * GIB, False),    # 60 + 1 + 14 = 75 of 140: awake
    (125 * GIB, 1 * GIB, False),   # 125 + 1 + 14 = 140: exactly fits
    (125 * GIB, 2 * GIB, True),    # one GiB over
    (60 * GIB, 70 * GIB, True),    # vLLM's default: half the card for weights and KV cache
])
def test_the_engine_stays_awake_only_when_the_update_the_engine_and_a_margin_fit(peak, engine, sleeps):
    decision = sleep_decision(total=140 * GIB, engine_bytes=engine, update_peak=peak, source="measured in step 1")
    assert decision.sleep is sleeps
    assert decision.reason.startswith("rollout.sleep=auto: the engine " + ("sleeps" if sleeps else "stays awake"))
    assert f"the update's peak {peak / GIB:.1f} GiB (measured in step 1) + the engine's {engine / GIB:.1f} GiB" in decision.reason


# ------------------------------------------------------------------ the per-token estimate: the planner's numbers


def test_the_activation_formula_counts_the_tensors_of_a_decoder_layer():
    qwen = ActivationCost.of(Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                         num_key_value_heads=2, vocab_size=151936).to_dict(), compute_bytes=2, checkpointing=False)
    # bf16: 2 x (7 x 896 + 2 x 128 + 4 x 4864) + 4 x (2 x 896 + 14); the planner's simulation measured 59,200 per layer
    assert qwen.layer() == 59_192
    assert qwen.per_token() == 25 * 59_192 + 32 * 896
    assert qwen.fixed() == 2 * 1024 * 151936 * 4  # one chunk of float32 logits and their gradient
    checkpointed = ActivationCost.of(Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                                 num_attention_heads=14, num_key_value_heads=2).to_dict(),
                                     compute_bytes=2, checkpointing=True, sequence_parallel=2)
    assert checkpointed.per_token() == (24 * 2 * 896 + 59_192 + 32 * 896) / 2
    assert checkpointed.per_token(trains=False) == (59_192 + 32 * 896) / 2


@pytest.mark.slow  # two fake-tensor simulations of a tiny model, ~10 s
def test_the_formula_matches_the_planners_simulation_per_layer_and_bounds_a_micro_batch(tmp_path):
    """bf16 compute over float32 weights (the GPU case): the planner's per-rank peak less what FSDP
    shards (parameters, gradients, AdamW state) is a micro-batch's activations; two depths give
    one layer's share, which the formula's per-layer count must match, and the formula's whole
    estimate for the micro-batch must cover the simulated activations without overshooting by half."""
    from rlcore.plan.models import read_config
    from rlcore.plan.roles import role_plans
    from rlcore.plan.simulate import Layout, simulate_depth

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    tokens = 8192

    def activations(layers: int) -> int:
        folder = tmp_path / f"m{layers}"
        Qwen2Config(num_hidden_layers=layers, max_position_embeddings=4096, tie_word_embeddings=True, **shape).save_pretrained(folder)
        config = load_config(None, [f"model.path={folder}", "data.train_files=[x]", "actor.mixed_precision=bf16",
                                    "data.max_prompt_length=128", "rollout.max_new_tokens=128", "data.train_batch_size=64",
                                    "actor.ppo_mini_batch_size=64", "rollout.n=1", f"{KEY}={tokens}"])
        actor = next(r for r in role_plans(config) if r.role == "actor")
        peak = simulate_depth(actor, read_config(str(folder), "model.path"), Layout(1), layers)
        return peak.total - peak.sharded

    two, four = activations(2), activations(4)
    cost = ActivationCost.of(Qwen2Config(num_hidden_layers=4, **shape).to_dict(), compute_bytes=2, checkpointing=False)
    assert cost.layer() == pytest.approx((four - two) / 2 / tokens, rel=0.02)  # 2,576 counted, 2,584 simulated
    assert four <= cost.per_token() * tokens + cost.fixed() <= 1.5 * four


def test_garbage_collected_during_a_simulation_does_not_count_as_the_steps_memory(tmp_path):
    """A cycle of someone else's that the collector frees while the planner simulates runs its
    `__del__` under the fake mode, where what it allocates would count as the step's memory (a test
    process after vLLM's engines measured a layer 3% too big): the simulation collects first and
    lets nothing be collected inside it, so a process littering cycles measures what a clean one does."""
    from rlcore.plan.models import read_config
    from rlcore.plan.roles import role_plans
    from rlcore.plan.simulate import Layout, simulate_depth

    folder = tmp_path / "m"
    Qwen2Config(num_hidden_layers=2, vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(folder)
    config = load_config(None, [f"model.path={folder}", "data.train_files=[x]", "data.max_prompt_length=32",
                                "rollout.max_new_tokens=32", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
                                "rollout.n=1", f"{KEY}=512"])
    actor = next(r for r in role_plans(config) if r.role == "actor")

    def peak() -> int:
        return simulate_depth(actor, read_config(str(folder), "model.path"), Layout(1), 2).total

    finalised: list[torch.Tensor] = []

    class Litter:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the collector frees it

        def __del__(self) -> None:
            finalised.append(torch.zeros(MIB))  # 4 MiB kept

    def drop_litter(module: torch.nn.Module, args: object) -> None:
        Litter()

    clean = peak()
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # a collection at nearly every allocation of a tracked object
    litter = torch.nn.modules.module.register_module_forward_pre_hook(drop_litter)
    try:
        littered = peak()
    finally:
        litter.remove()
        gc.set_threshold(*threshold)
    gc.collect()
    assert finalised, "the litter was never collected: the test shows nothing"
    assert littered == clean


# ------------------------------------------------------------------ the config keys


@pytest.mark.parametrize("override,value", [
    ([], "auto"),
    ([f"{KEY}=auto"], "auto"),
    ([f"{KEY}=4096"], 4096),
    ([f"{KEY}=4096.0"], 4096),
])
def test_the_actors_budget_takes_auto_and_numbers(override, value):
    assert load_config(None, ["model.path=m", "data.train_files=[t]", *override]).actor.max_tokens_per_micro_batch == value


@pytest.mark.parametrize("key", [KEY, "critic.max_tokens_per_micro_batch", "reward_model.max_tokens_per_micro_batch"])
@pytest.mark.parametrize("junk", ["lots", "0", "-5", "true", "2.5", "[8192]", "{a: 1}", "'" + "9" * 5000 + "x'"])
def test_junk_is_refused_in_one_line_naming_the_key(key, junk):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=m", "data.train_files=[t]", f"{key}={junk}"])
    message = str(err.value)
    assert message.startswith(f"invalid config: {key}: expected a number of tokens (at least 1) or auto, got ")
    assert "\n" not in message and len(message) < 200


def test_sft_takes_auto_and_keeps_its_default(tmp_path):
    assert load_sft_config(None, ["model.path=m", "data.train_files=[t]"]).actor.max_tokens_per_micro_batch == 4096
    assert load_sft_config(None, ["model.path=m", "data.train_files=[t]", "trainer.max_tokens_per_micro_batch=auto"]
                           ).actor.max_tokens_per_micro_batch == "auto"


def test_the_cli_refuses_a_junk_budget_with_one_line_and_exit_2(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("model: {path: m}\ndata: {train_files: [t]}\nactor: {max_tokens_per_micro_batch: lots}\n")
    assert cli_main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rlcore: error: invalid config: {KEY}: expected a number of tokens (at least 1) or auto, got 'lots'"]


def test_the_older_spelling_of_rollout_sleep_is_read_with_a_note(caplog):
    base = ["model.path=m", "data.train_files=[t]"]
    with caplog.at_level(logging.WARNING, logger="rlcore.config"):
        assert load_config(None, [*base, "rollout.free_memory_when_idle=true"]).rollout.sleep == "always"
        assert load_config(None, [*base, "rollout.free_memory_when_idle=false"]).rollout.sleep == "never"
    assert [r.getMessage() for r in caplog.records] == [
        "rollout.free_memory_when_idle=true is the older spelling of rollout.sleep: read as rollout.sleep=always",
        "rollout.free_memory_when_idle=false is the older spelling of rollout.sleep: read as rollout.sleep=never"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlcore.config"):  # a dumped config of an older run: its default, no note
        assert load_config(None, [*base, "rollout.free_memory_when_idle=null"]).rollout.sleep == "auto"
    assert not caplog.records
    dumped = dump_config(load_config(None, [*base, "rollout.free_memory_when_idle=true"]))
    assert "sleep: always" in dumped and "free_memory_when_idle" not in dumped
    for extra, says in ((["rollout.sleep=never"], "free_memory_when_idle and sleep are the same setting"),
                        ([], "free_memory_when_idle (the older spelling of rollout.sleep): expected true or false")):
        with pytest.raises(ConfigError, match=r"^invalid config: rollout: " + says.replace("(", r"\(").replace(")", r"\)")):
            load_config(None, [*base, "rollout.free_memory_when_idle=" + ("true" if extra else "sometimes"), *extra])


@pytest.mark.slow  # imports vLLM (seconds) for one table row; fast: test_rollout_backend_traits.py imports it once
def test_vllm_sleeps_at_level_2_only_when_every_sync_sends_every_weight():
    """The sleep level the vLLM backend asks its engine for (its `engine_kwargs`, what the rollout worker passes)."""
    engine = pytest.importorskip("rlcore.rollout.vllm", reason="vllm is not installed").VLLMRolloutEngine
    base = ["model.path=m", "data.train_files=[t]", "rollout.backend=vllm"]

    def level(overrides: list[str]) -> int:
        config = load_config(None, [*base, *overrides])
        return engine.engine_kwargs(config.rollout, seed=0, lora_sync=config.lora_sync,
                                    lora_rank=config.actor.lora.rank)["sleep_level"]

    assert level([]) == 2
    assert level(["actor.lora.rank=8"]) == 1  # merged LoRA layers only
    assert level(["actor.lora.rank=8", "rollout.lora_sync=adapter"]) == 1


# ------------------------------------------------------------------ the first step's out-of-memory halving

VOCAB = 48


def _policy() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True, pad_token_id=0))


def _batch(n: int = 8, p: int = 6, r: int = 5) -> Batch:
    g = torch.Generator().manual_seed(0)
    prompts, responses = torch.randint(3, VOCAB, (n, p), generator=g), torch.randint(3, VOCAB, (n, r), generator=g)
    rmask = (torch.arange(r)[None, :] < torch.tensor([5, 5, 1, 2, 4, 5, 3, 1])[:n, None]).long()
    attn = torch.cat([torch.ones(n, p, dtype=torch.long), rmask], 1)
    return Batch(tensors={"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                          "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
                          "response_mask": rmask.float(), "advantages": torch.randn(n, 1, generator=g).expand(n, r).contiguous(),
                          "old_log_probs": -torch.rand(n, r, generator=g) - 2.0})


LOG_PROBS = PolicyLogProbs(temperature=1.0, chunk_tokens=1024, backend="torch")
CONFIG = ActorConfig(optim={"lr": 1e-2})


class _GpuOutOfMemoryOnce:
    """A stand-in for a GPU running out of memory (there is none here): the policy loss of the
    `fail_on`-th micro-batch forward raises torch's CUDA out-of-memory error, once each."""

    def __init__(self, objective: PolicyObjective, fail_on: tuple[int, ...]) -> None:
        self.objective, self.fail_on, self.calls, self.token_counts = objective, fail_on, 0, []

    def __call__(self, mini, counts):
        inner = self.objective(mini, counts)

        def micro_loss(mb):
            self.calls += 1
            self.token_counts.append(int(mb["attention_mask"].sum()))
            if self.calls in self.fail_on:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (stand-in)")
            return inner(mb)
        return micro_loss


def _update(budget: MicroBudget | None, fail_on: tuple[int, ...], tokens: int = 1024):
    model = _policy()
    optimizer = build_optimizer(model, CONFIG.optim)
    trained = Trainable(model, optimizer, build_scheduler(optimizer, CONFIG.optim, 10))
    objective = _GpuOutOfMemoryOnce(PolicyObjective(CONFIG, get_policy_loss("vanilla"), LOG_PROBS, model), fail_on)
    settings = UpdateSettings(1, 4, MicroBatching(64, True, tokens, budget=budget), grad_clip=1.0)
    result = run_update(trained, _batch(), objective, settings, mini_batch_rows=4, device=CPU)
    return result, model, objective


def _auto_budget(tokens: int = 1024) -> MicroBudget:
    budget = MicroBudget(KEY)
    budget.tokens = tokens
    return budget


def test_an_oom_in_the_first_step_halves_an_auto_budget_once_and_the_step_is_the_one_without_it(caplog):
    clean, clean_model, _ = _update(_auto_budget(), fail_on=())
    budget = _auto_budget()
    with caplog.at_level(logging.WARNING, logger="rlcore.workers.memory"):
        result, model, objective = _update(budget, fail_on=(1,))  # the first micro-batch of the first mini-batch
    assert budget.tokens == 512 and budget.halved and budget.settled
    assert [r.getMessage() for r in caplog.records] == [
        f"{KEY}=auto: out of device memory in the first step at 1,024 tokens per micro-batch; halved to 512 and running "
        "this pass's micro-batches again (a number fixes it)"]
    # nothing of the failed attempt counted: the same loss, statistics and weights as a step without it
    assert result.loss == pytest.approx(clean.loss, rel=1e-6) and result.skipped_steps == 0
    assert result.metrics == pytest.approx(clean.metrics, rel=1e-5)
    for (name, a), b in zip(model.state_dict().items(), clean_model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    assert objective.calls == 3  # the failed forward, its retry, and the second mini-batch's (one micro-batch each)


def test_a_second_oom_in_the_first_step_is_raised():
    budget = _auto_budget()
    with pytest.raises(torch.cuda.OutOfMemoryError, match="stand-in"):
        _update(budget, fail_on=(1, 2))
    assert budget.tokens == 512 and budget.halved


def test_an_oom_after_the_first_step_or_with_a_fixed_budget_is_raised():
    settled = _auto_budget()
    settled.first_step_done()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _update(settled, fail_on=(1,))
    assert settled.tokens == 1024
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _update(None, fail_on=(1,))  # a number: kept as given


def test_an_oom_in_a_forward_only_roles_first_pass_halves_and_rewrites_every_row():
    model, batch = _policy(), _batch()
    budget = MicroBudget(f"{KEY} (ref)", forward_only=True)
    budget.tokens = 1024
    calls = []

    def forward(mb):
        calls.append(len(mb))
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        return {"lp": LOG_PROBS(model, mb)[0]}

    out = forward_no_grad(model, batch, forward, MicroBatching(64, True, 1024, budget=budget), CPU)
    torch.testing.assert_close(out["lp"], LOG_PROBS(model, batch)[0].detach(), atol=1e-5, rtol=1e-5)
    assert budget.tokens == 512 and budget.settled  # the reference's first step is this forward
    assert not math.isnan(float(out["lp"].sum()))


def test_a_worker_sizes_auto_once_and_on_the_cpu_keeps_the_default(tmp_path, caplog):
    from rlcore.config import role_spec
    from rlcore.workers.memory import resolve_budget, role_budget

    config = load_config(None, [f"model.path={Path(tmp_path)}", "data.train_files=[t]", "trainer.device=cpu"])
    budget = role_budget(role_spec(config, "actor"))
    assert budget is not None and budget.key == KEY and not budget.forward_only
    ref = role_budget(role_spec(config, "ref"))
    assert ref is not None and ref.key == f"{KEY} (ref)" and ref.forward_only
    assert role_budget(role_spec(load_config(None, ["model.path=m", "data.train_files=[t]", f"{KEY}=4096"]), "actor")) is None
    with caplog.at_level(logging.INFO, logger="rlcore.workers.memory"):
        for _ in range(3):
            resolve_budget(budget, role_spec(config, "actor"), CPU, _policy())
    assert budget.tokens == CPU_MICRO_BATCH_TOKENS
    assert len([r for r in caplog.records if r.getMessage().startswith(f"{KEY}=auto: 8,192 tokens on the CPU")]) == 1


# ------------------------------------------------------------------ `rlcore plan` decides as the run does


def test_plan_sizes_an_auto_budget_for_the_hardware_with_the_same_function(tmp_path):
    from rlcore.plan import Hardware
    from rlcore.plan.models import ModelFacts, config_dict, read_config
    from rlcore.plan.planner import size_auto_micro_batch
    from rlcore.plan.report import render_role
    from rlcore.plan.roles import role_plans
    from rlcore.plan.simulate import static_bytes

    folder = tmp_path / "model"
    Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512).save_pretrained(folder)
    config = load_config(None, [f"model.path={folder}", "data.train_files=[x]", "model.dtype=bfloat16", "rollout.n=4",
                                "data.max_prompt_length=64", "rollout.max_new_tokens=64", "data.train_batch_size=64",
                                "actor.ppo_mini_batch_size=64"])
    actor = next(r for r in role_plans(config) if r.role == "actor")
    assert actor.micro_auto and actor.micro_key == KEY
    model_config = read_config(folder, "model.path")
    parameters = ModelFacts.of(model_config, "lm", "model.path").parameters
    hardware = Hardware(1, 1, 2 * GIB)
    sized = size_auto_micro_batch(actor, model_config, parameters, hardware)
    cost = ActivationCost.of(config_dict(model_config), compute_bytes=2, checkpointing=False)
    expected = size_micro_batch(KEY, device="devices of 2.0 GiB", total=2 * GIB, per_token=cost.per_token(), fixed=cost.fixed(),
                                available=2 * GIB - static_bytes(actor, parameters, 1))
    assert sized.micro.rows == expected.tokens // 128 and sized.micro.length == 128
    line = (f"{KEY}=auto: {expected.tokens:,} tokens on devices of 2.0 GiB: (2.0 GiB free beside its parameters, gradients "
            f"and AdamW state - 4.0 MiB head chunk - 204.8 MiB margin (10% of 2.0 GiB)) / {per_token_text(cost.per_token())} of "
            "activations per token")
    assert sized.micro_note == line
    assert f"  {sized.micro_note}" in render_role(_Result(sized), None)  # type: ignore[arg-type]


class _Result:
    """What `render_role` reads of a planned role (no simulation run)."""

    def __init__(self, role) -> None:
        self.role, self.tried, self.smallest, self.nowhere, self.skipped = role, [], None, None, "not simulated here"
        self.facts = type("Facts", (), {"architecture": "Qwen2ForCausalLM", "parameters": 1_000_000})()


@pytest.mark.parametrize("sleep,engine_gib,asleep,why", [
    ("auto", 1, False, "rollout.sleep=auto: the engine stays awake through the update: the update's peak 40.0 GiB (planned)"),
    ("auto", 40, True, "rollout.sleep=auto: the engine sleeps through the update: the update's peak 40.0 GiB (planned)"),
    ("always", 1, True, "rollout.sleep=always"),
    ("never", 40, False, "rollout.sleep=never"),
])
def test_plan_shows_the_colocated_run_with_the_engine_as_rollout_sleep_leaves_it(sleep, engine_gib, asleep, why):
    from types import SimpleNamespace

    from rlcore.plan import Hardware
    from rlcore.plan.planner import PlanReport, colocated
    from rlcore.plan.report import render_colocated
    from rlcore.plan.simulate import Layout, Peak

    hardware = Hardware(1, 8, 80 * GIB)
    actor = SimpleNamespace(role=SimpleNamespace(role="actor"), tried=[
        SimpleNamespace(layout=Layout(8), peak=Peak(40 * GIB, {"params": 2 * GIB}))])
    rollout = SimpleNamespace(smallest=SimpleNamespace(total=engine_gib * GIB, tp=1))
    config = load_config(None, ["model.path=m", "data.train_files=[t]", f"rollout.sleep={sleep}"])
    result = colocated(config, [actor], rollout, hardware)  # type: ignore[arg-type]
    assert result is not None and result.rollout_sleeps is asleep and result.why.startswith(why)
    assert dict(result.phases)["actor"] == (40 if asleep else 40 + engine_gib) * GIB
    report = PlanReport(hardware, config, [], None, False, result)
    lines = render_colocated(report)
    assert lines[0].startswith(f"all roles on all 8 devices at once (one Ray pool; the rollout {'asleep' if asleep else 'awake'}")
    assert lines[1] == f"  {result.why}"


def test_a_role_leaves_room_for_what_every_trained_model_of_its_process_still_allocates():
    """`pending_bytes`: the gradients and AdamW moments not made yet of the trained models its
    workers registered (so the actor's `auto` budget leaves room for the critic's first step)."""
    from rlcore.workers.memory import bytes_to_come, pending_bytes, track_trained

    before = pending_bytes(CPU)  # other tests' workers in this process, if any are still alive
    actor, critic = torch.nn.Linear(10, 10), torch.nn.Linear(10, 4)  # 440 and 176 bytes of float32 parameters
    actor_opt = torch.optim.AdamW(actor.parameters())
    track_trained(actor, actor_opt)
    track_trained(critic, torch.optim.AdamW(critic.parameters()))
    assert bytes_to_come(actor, actor_opt, CPU) == 3 * 440  # gradients and two moments to come
    assert bytes_to_come(actor, None, CPU) == 3 * 440       # no optimizer yet: its moments still come
    assert pending_bytes(CPU) - before == 3 * 440 + 3 * 176
    actor(torch.ones(1, 10)).sum().backward()
    actor_opt.step()  # its first step: gradients and state now exist, nothing more to come
    assert pending_bytes(CPU) - before == 3 * 176
    assert pending_bytes(CPU, also=(actor, actor_opt)) - before == 3 * 176  # counted once
    frozen = torch.nn.Linear(10, 10).requires_grad_(False)
    assert pending_bytes(CPU, also=(frozen, None)) - before == 3 * 176  # a forward-only model allocates nothing
    del critic
    gc.collect()
    assert pending_bytes(CPU) - before == 0  # a model gone is forgotten


def test_the_sleep_decision_weighs_the_update_at_the_largest_micro_batch_a_later_step_may_pack():
    """Step 1's responses may be short: the peak it measured is grown to the micro-batch the
    budget and the config's length limits allow, before the engine is kept awake beside it."""
    from rlcore.trainer.rollout_parts import update_peak_bytes
    from rlcore.workers.loops import UpdateResult
    from rlcore.workers.memory import largest_micro_batch

    config = load_config(None, ["model.path=m", "data.train_files=[t]", "data.max_prompt_length=32", "rollout.max_new_tokens=96"])
    from rlcore.config import role_spec

    longest = role_spec(config, "actor").longest_sequence
    assert longest == 128
    assert largest_micro_batch(longest, dynamic=True, max_tokens=8192, rows_per_micro=64, mini_rows=16) == 16 * 128
    assert largest_micro_batch(longest, dynamic=True, max_tokens=1024, rows_per_micro=64, mini_rows=16) == 1024
    assert largest_micro_batch(longest, dynamic=False, max_tokens=8192, rows_per_micro=4, mini_rows=16) == 4 * 128
    result = UpdateResult(loss=0.0, grad_norm=0.0, skipped_steps=0, metrics={}, device_peak=10 * GIB, largest_micro_tokens=1000)
    metrics = result.peak_metrics("actor", most_tokens=3000, per_token=MIB)
    assert metrics == {"memory/actor_update_device_peak_gib": 10.0, "memory/actor_update_device_bound_gib": 10.0 + 2000 / 1024}
    assert UpdateResult(loss=0.0, grad_norm=0.0, skipped_steps=0, metrics={}).peak_metrics("actor", 3000, MIB) == {}  # CPU
    critic = {"memory/critic_update_device_peak_gib": 4.0, "memory/critic_update_device_bound_gib": 30.0}
    assert update_peak_bytes({**metrics, **critic}) == 30 * GIB  # the largest bound of any role
    assert update_peak_bytes({"memory/actor_update_device_peak_gib": 12.0}) == 12 * GIB
    assert update_peak_bytes({"actor/pg_loss": 1.0}) is None
