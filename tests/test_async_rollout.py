"""`trainer.off_policy=async` (issue 42's in-process core): the bounded buffer of prompt groups,
the gate between generation and weight syncs, the decoupled-PPO weights against a hand
computation, the refusals at load, and a tiny GRPO run that writes the async metrics."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import stop_process_group, tree_progress, wait_for  # tests/ is on sys.path
from timing import scaled
from tiny_runs import SCORE_IN_PROCESS, prompts_per_step

from rlcore import rollout_backends
from rlcore.algos.policy_loss import behaviour_weights, vanilla_policy_loss
from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import config_from_dict, load_config
from rlcore.protocol import RIGHT_PAD, Batch
from rlcore.rollout import BackendTraits, HFRolloutEngine, SamplingParams
from rlcore.rollout.output import TOKEN_VERSIONS
from rlcore.tracking import read_jsonl
from rlcore.trainer.async_rollout import (
    BufferClosed,
    DecodeSwitch,
    EngineGate,
    GroupBuffer,
    PromptGroup,
    interrupted,
    join_generations,
    oldest_version,
)
from rlcore.trainer.run import make_trainer

WAIT = 60.0  # generous: a slow machine is not a failure
ROOT = Path(__file__).resolve().parents[1]


def _group(tag: int, version: int) -> PromptGroup:
    return PromptGroup(Batch(tensors={"x": torch.full((2, 1), tag)}), version)


def _tags(groups: list[PromptGroup]) -> list[int]:
    return [int(g.samples.tensors["x"][0, 0]) for g in groups]


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# ----- the buffer ---------------------------------------------------------------------------------

def test_put_blocks_while_full_and_a_take_lets_it_in():
    buf = GroupBuffer(capacity=2)
    assert buf.put(_group(0, 0)) and buf.put(_group(1, 0))
    t, out = _in_thread(lambda: buf.put(_group(2, 0)))
    t.join(0.2)
    assert t.is_alive() and len(buf) == 2  # the bound holds: the third waits
    assert _tags(buf.take(1, min_version=0)) == [0]
    t.join(WAIT)
    assert out == {"value": True} and len(buf) == 2
    assert _tags(buf.take(2, min_version=0)) == [1, 2]  # first in, first out


def test_take_drops_and_counts_groups_older_than_the_bound_and_keeps_order():
    buf = GroupBuffer(capacity=8)
    for tag, version in enumerate([0, 0, 1, 2, 1, 2]):
        buf.put(_group(tag, version))
    assert _tags(buf.take(3, min_version=1)) == [2, 3, 4]
    assert buf.dropped == 2 and len(buf) == 1
    assert _tags(buf.take(1, min_version=2)) == [5]
    assert buf.dropped == 2


def test_take_waits_for_enough_fresh_groups():
    buf = GroupBuffer(capacity=4)
    buf.put(_group(0, 3))
    t, out = _in_thread(lambda: buf.take(2, min_version=3))
    buf.put(_group(1, 2))  # too old: dropped, the take keeps waiting
    t.join(0.2)
    assert t.is_alive()
    buf.put(_group(2, 3))
    t.join(WAIT)
    assert _tags(out["value"]) == [0, 2] and buf.dropped == 1


def test_close_wakes_a_blocked_put_and_a_blocked_take_without_hanging():
    full = GroupBuffer(capacity=1)
    full.put(_group(0, 0))
    putter, put_out = _in_thread(lambda: full.put(_group(1, 0)))
    empty = GroupBuffer(capacity=1)
    taker, take_out = _in_thread(lambda: empty.take(1, min_version=0))
    full.close()
    empty.close()
    putter.join(WAIT)
    taker.join(WAIT)
    assert put_out == {"value": False}
    assert isinstance(take_out["error"], BufferClosed)


def test_a_producer_failure_reaches_the_trainer_as_the_cause():
    buf = GroupBuffer(capacity=2)
    buf.put(_group(0, 0))
    boom = RuntimeError("engine fell over")
    buf.close(boom)
    with pytest.raises(BufferClosed) as caught:
        buf.take(1, min_version=0)
    assert caught.value.__cause__ is boom  # and nothing left is trained after a failure


def test_a_waiting_weight_sync_goes_before_the_next_generation():
    gate, order = EngineGate(), []
    generating, release = threading.Event(), threading.Event()

    def generate(tag: str, hold: threading.Event | None = None) -> None:
        with gate.generation():
            order.append(tag)
            generating.set()
            if hold is not None:
                hold.wait(WAIT)

    first, _ = _in_thread(lambda: generate("gen1", release))
    assert generating.wait(WAIT)

    def sync() -> None:
        with gate.exclusive():
            order.append("sync")

    syncer, _ = _in_thread(sync)
    while gate._waiting == 0:  # the sync is queued behind gen1 (waits on state, not on time)
        syncer.join(0.01)
    second, _ = _in_thread(lambda: generate("gen2"))
    second.join(0.2)
    assert order == ["gen1"]  # neither runs inside gen1; gen2 does not overtake the waiting sync
    release.set()
    for t in (first, syncer, second):
        t.join(WAIT)
    assert order == ["gen1", "sync", "gen2"]


def test_a_generation_waits_until_it_may_start_and_wake_releases_it():
    gate, allowed = EngineGate(), threading.Event()

    def attempt() -> bool:
        with gate.generation(allowed.is_set) as go:
            return go

    waiting, out = _in_thread(attempt)
    waiting.join(0.2)
    assert waiting.is_alive()  # not ready: the producer is max_staleness steps ahead
    with gate.exclusive():  # a weight sync makes it ready; it re-checks when the sync is done
        allowed.set()
    waiting.join(WAIT)
    assert out == {"value": True}
    allowed.clear()
    stopped, out = _in_thread(attempt)
    gate.wake()  # the run ends
    stopped.join(WAIT)
    assert out == {"value": False}


def test_generations_with_different_prompt_widths_join_left_padded():
    pad = 9

    def gen(prompt: list[list[int]], response: list[list[int]]) -> Batch:
        p, r = torch.tensor(prompt), torch.tensor(response)
        mask = torch.cat([(p != pad).long(), torch.ones_like(r)], dim=1)
        return Batch(tensors={"prompts": p, "responses": r, "input_ids": torch.cat([p, r], 1), "attention_mask": mask,
                              "position_ids": (mask.cumsum(1) - 1).clamp(min=0), "response_mask": torch.ones_like(r)},
                     meta={"uid": np.array(["a"] * len(p), dtype=object)},
                     info={RIGHT_PAD: {"responses": pad, "input_ids": pad, "response_mask": 0, "attention_mask": 0,
                                       "position_ids": "edge"}})

    joined = join_generations([gen([[5, 6]], [[7]]), gen([[9, 1, 2, 3]], [[4, 4]])])
    assert joined.tensors["input_ids"].tolist() == [[9, 9, 5, 6, 7, 9], [9, 1, 2, 3, 4, 4]]
    assert joined.tensors["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]]
    assert joined.tensors["position_ids"].tolist() == [[0, 0, 0, 1, 2, 2], [0, 0, 1, 2, 3, 4]]
    assert joined.tensors["response_mask"].tolist() == [[1, 0], [1, 1]]


# ----- the producer, with a stand-in engine (instant, or failing) -------------------------------

class _Engine:
    """Stands in for the rollout group: n one-token samples per prompt, instantly; counts calls.
    Its ranks report `busy_per_call` seconds of generating per call (one rank: 0)."""

    def __init__(self, n: int, error: Exception | None = None, hold: threading.Semaphore | None = None,
                 busy_per_call: tuple[float, ...] = (0.0,)) -> None:
        self.n, self.error, self.calls, self.hold, self.entered, self.seeds = n, error, 0, hold, 0, []
        self.busy_per_call = busy_per_call

    def generate_seconds(self) -> list[float]:
        return [self.calls * busy for busy in self.busy_per_call]

    def generate_sequences(self, prompts: Batch, sampling) -> Batch:
        self.entered += 1
        if self.hold is not None:  # a generation in flight until the test lets it finish
            assert self.hold.acquire(timeout=WAIT)
        if self.error is not None:
            raise self.error
        self.calls += 1
        self.seeds.append(sampling.seed)
        rows = len(prompts) * self.n
        return Batch(tensors={"prompts": torch.zeros(rows, 2, dtype=torch.long), "responses": torch.ones(rows, 1, dtype=torch.long)},
                     meta={"uid": np.repeat(prompts.meta["uid"], self.n)})


class _Loader:
    def __init__(self) -> None:
        self.drawn = 0

    def next_batch(self) -> Batch:
        self.drawn += 1
        return Batch(tensors={"x": torch.zeros(2, 1)}, meta={"uid": np.array([f"{self.drawn}-a", f"{self.drawn}-b"], dtype=object)})


def _producer(engine: _Engine, loader: _Loader, **trainer):
    from types import SimpleNamespace

    from rlcore.trainer.async_rollout import AsyncRollout

    config = config_from_dict({**BASE, "data": {"train_files": ["t"], "train_batch_size": 2}, "rollout": {"n": engine.n},
                               "actor": {"ppo_mini_batch_size": 2},
                               "trainer": {"off_policy": "async", "total_steps": 10, "save_every": 10, **trainer}})
    return AsyncRollout(config, SimpleNamespace(rollout=engine), loader)


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_producer_runs_max_staleness_steps_ahead_and_no_further():
    from rlcore.trainer.metrics import Timer

    engine, loader = _Engine(n=2), _Loader()
    rollout = _producer(engine, loader, max_staleness=1)
    rollout.start(0)
    try:
        batch, metrics = rollout.next_batch(0, Timer())
        assert list(batch.meta["uid"]) == ["1-a", "1-a", "1-b", "1-b"] and metrics["async/staleness_0"] == 4
        _wait_until(lambda: len(rollout.buffer) == 2, "the second generation in the buffer")
        time.sleep(0.2)  # the buffer has room, but a third generation would be two updates old when trained
        assert engine.calls == loader.drawn == 2
        rollout.update_weights(lambda: None, 1, Timer())  # step 1's update reaches the engine
        _wait_until(lambda: engine.calls == 3, "the third generation once the weights moved")
        batch, metrics = rollout.next_batch(1, Timer())
        assert list(batch.meta["uid"]) == ["2-a", "2-a", "2-b", "2-b"] and metrics["async/staleness_1"] == 4
    finally:
        rollout.close()  # returns although the producer waits for the gate: no hang


def test_chunks_of_a_step_take_the_weights_pushed_between_them():
    """async_chunk_prompts=1: the sync waits for one prompt's generation, not the step's, and the
    step's second group comes from the new weights."""
    from rlcore.trainer.metrics import Timer

    hold = threading.Semaphore(0)
    engine = _Engine(n=2, hold=hold)
    rollout = _producer(engine, _Loader(), async_chunk_prompts=1)
    rollout.start(0)
    try:
        _wait_until(lambda: engine.entered == 1, "the first chunk in flight")
        syncer, _ = _in_thread(lambda: rollout.update_weights(lambda: None, 1, Timer()))
        _wait_until(lambda: rollout.gate._waiting == 1, "the sync queued behind the chunk")
        hold.release(2)  # the first chunk finishes; the sync goes before the second
        syncer.join(WAIT)
        batch, metrics = rollout.next_batch(1, Timer())
        assert list(batch.meta["policy_version"]) == [0, 0, 1, 1]
        assert metrics["async/staleness_1"] == metrics["async/staleness_0"] == 2
        assert engine.seeds[0] != engine.seeds[1]  # each chunk draws its own stream
    finally:
        hold.release(100)
        rollout.close()


def test_each_rollout_rank_reports_the_share_of_the_step_it_was_not_generating():
    """Two ranks, one generating through every call (its share of the batch the longest) and one
    finishing at once: the first waited none of the step, the second all of it, each reported
    apart beside the producer's own wait."""
    from rlcore.trainer.metrics import Timer

    engine = _Engine(n=2, busy_per_call=(1e6, 0.0))
    rollout = _producer(engine, _Loader(), max_staleness=0)
    rollout.start(0)
    try:
        rollout.next_batch(0, Timer())
        _wait_until(lambda: engine.calls == 1, "the step's generation returned")
        metrics = rollout.step_metrics(Timer())
        assert metrics["async/rollout_wait_frac_rank_0"] == 0.0  # generating longer than the step lasted: clipped
        assert metrics["async/rollout_wait_frac_rank_1"] == 1.0
        assert 0.0 <= metrics["async/rollout_wait_frac"] <= 1.0
    finally:
        rollout.close()


def test_a_validation_waiting_for_the_generation_in_flight_counts_as_the_trainers_wait():
    """Validation between steps takes the engine alone, after the generation in flight: the trainer
    idles meanwhile, and the next step's `async/trainer_wait_frac` says so (it read ~0 before)."""
    from rlcore.trainer.metrics import Timer

    hold = threading.Semaphore(0)
    engine = _Engine(n=2, hold=hold)
    rollout = _producer(engine, _Loader())
    started = time.perf_counter()
    rollout.start(0)
    try:
        _wait_until(lambda: engine.entered == 1, "the first generation in flight")
        asked = time.perf_counter()
        threading.Timer(0.5, hold.release).start()  # the generation ends half a second from now
        with rollout.exclusive():
            got = time.perf_counter()
        metrics = rollout.step_metrics(Timer())
        ended = time.perf_counter()
        assert got - asked >= 0.4
        assert metrics["async/trainer_wait_frac"] >= 0.9 * (got - asked) / (ended - started)
    finally:
        hold.release(100)
        rollout.close()


def test_a_failing_engine_stops_the_step_with_its_own_error():
    from rlcore.trainer.metrics import Timer

    rollout = _producer(_Engine(n=2, error=ValueError("engine fell over")), _Loader())
    rollout.start(0)
    try:
        with pytest.raises(ValueError, match="engine fell over"):
            rollout.next_batch(0, Timer())
    finally:
        rollout.close()


def test_a_wait_measured_on_another_thread_adds_to_its_phase():
    """`Timer.add`: the step-boundary sync's wait (measured around a job run on the generating
    thread) is reported as `time/weight_sync_wait_s`, summed with a `phase` of the same name."""
    from rlcore.trainer.metrics import Timer

    timer = Timer(device_memory=False)
    with timer.phase("weight_sync_wait"):
        pass
    timer.add("weight_sync_wait", 2.5)
    timer.add("elsewhere", 1.0)
    metrics = timer.metrics()
    assert 2.5 <= metrics["time/weight_sync_wait_s"] < 2.5 + WAIT and metrics["time/elsewhere_s"] == 1.0


# ----- the loss correction ------------------------------------------------------------------------

def test_behaviour_weights_by_hand():
    prox = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)]])
    behav = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.3)]])  # w = 2, 0.5, 3
    assert torch.allclose(behaviour_weights(prox, behav, "decoupled", None), torch.tensor([[2.0, 0.5, 3.0]]))
    assert torch.allclose(behaviour_weights(prox, behav, "decoupled", 2.5), torch.tensor([[2.0, 0.5, 0.0]]))  # dropped
    assert torch.allclose(behaviour_weights(prox, behav, "truncate", 2.5), torch.tensor([[2.0, 0.5, 2.5]]))  # bounded
    assert behaviour_weights(prox, behav, "truncate", None) is None  # as before: no tis_cap, no weights


def test_decoupled_objective_matches_a_hand_computation():
    """AReaL's decoupled PPO on three tokens: -w * min(r A, clip(r) A), r = pi / pi_prox, w = pi_prox / pi_behav."""
    prox = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    behav = torch.log(torch.tensor([[0.25, 0.4, 0.3]]))  # w = 2, 0.5, 3 -> capped at 2.5: 2, 0.5, 0
    pi = torch.log(torch.tensor([[0.6, 0.2, 0.45]]))  # r = 1.2, 1.0, 0.5
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    w = behaviour_weights(prox, behav, "decoupled", 2.5)
    loss, _ = vanilla_policy_loss(prox, pi, adv, torch.ones(1, 3), clip_ratio_low=0.2, clip_ratio_high=0.1,
                                  rollout_is_weights=w, loss_agg_mode="token-mean")
    # token 1: A=1, r=1.2 clipped to 1.1 -> -1.1 * w 2 = -2.2; token 2: A=-1, r=1 -> 1 * 0.5 = 0.5;
    # token 3: weight 0 -> 0; token-mean over 3 tokens
    assert loss.item() == pytest.approx((-2.2 + 0.5 + 0.0) / 3, abs=1e-5)


# ----- new weights between decode steps (trainer.async_weight_sync=step) ---------------------------


class _PausingSwitch(DecodeSwitch):
    """The gate's switch, stopping at boundary `at` until a weight sync has been handed over
    (so the sync is requested mid-generation, whatever the machine's speed)."""

    def __init__(self, gate: EngineGate, version, at: int) -> None:
        super().__init__(gate, version)
        self.gate, self.at, self.calls = gate, at, 0
        self.reached = threading.Event()

    def between_steps(self) -> bool:
        self.calls += 1
        if self.calls == self.at:
            self.reached.set()
            assert _wait_for(lambda: self.gate.job_waiting), "the sync was never handed over"
        return super().between_steps()


def _wait_for(condition) -> bool:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_a_sync_requested_mid_generation_is_taken_at_the_next_decode_step_and_versions_switch_there():
    """The real hf engine generating under the gate: a sync handed over at decode step 3 runs
    there, on the generating thread, before the generation ends; the tokens after it carry the
    new version, the group's staleness is its oldest token's, the sample counts as interrupted."""
    from test_rollout_hf import PAD, prompt_batch, tiny_model  # tests/ is on sys.path

    gate, state = EngineGate(), {"version": 4}
    engine = HFRolloutEngine(tiny_model(0), pad_token_id=PAD, eos_token_ids=[])
    engine.weight_switch = switch = _PausingSwitch(gate, lambda: state["version"], at=3)
    new = tiny_model(1).state_dict()
    seen: dict = {}

    def job() -> None:  # what `AsyncRollout.update_weights` hands over: the sync, then the version
        seen["thread"], seen["boundary"] = threading.get_ident(), switch.calls
        engine.update_weights(new.items())
        state["version"] = 5

    def generate() -> None:
        seen["generator"] = threading.get_ident()
        with gate.generation() as go:
            assert go
            seen["out"] = engine.generate(prompt_batch([5, 3]), SamplingParams(n=2, do_sample=False, max_new_tokens=8))

    thread, errors = _in_thread(generate)
    assert switch.reached.wait(WAIT)
    gate.at_step_boundary(job)  # returns once the generation ran the sync
    thread.join(WAIT)
    assert not errors.get("error")
    assert seen["thread"] == seen["generator"] and seen["boundary"] == 3  # not after the generation
    versions = seen["out"][TOKEN_VERSIONS]
    assert (versions[:, :3] == 4).all() and (versions[:, 3:] == 5).all()
    assert interrupted(seen["out"]) == 4 and oldest_version(seen["out"], started=4) == 4
    unchanged = HFRolloutEngine(tiny_model(0), pad_token_id=PAD, eos_token_ids=[]).generate(
        prompt_batch([5, 3]), SamplingParams(n=2, do_sample=False, max_new_tokens=8))
    assert interrupted(unchanged) == 0  # without a switch: no versions, nothing interrupted


def test_a_sync_with_no_generation_in_flight_runs_on_the_calling_thread_and_its_error_reaches_it():
    gate, where = EngineGate(), []
    gate.at_step_boundary(lambda: where.append(threading.get_ident()))
    assert where == [threading.get_ident()]
    assert gate.step_boundary() is False  # nothing handed over any more

    def fail() -> None:
        raise RuntimeError("bucket lost")

    def generate() -> None:
        with gate.generation():
            assert _wait_for(lambda: gate.job_waiting)
            assert gate.step_boundary() is True

    thread, errors = _in_thread(generate)
    with pytest.raises(RuntimeError, match="bucket lost"):
        gate.at_step_boundary(fail)
    thread.join(WAIT)
    assert not errors.get("error")


# ----- refused at load ----------------------------------------------------------------------------

BASE = {"model": {"path": "m"}, "data": {"train_files": ["t"]}}


def _load(**sections) -> None:
    tree = {**BASE, **sections}
    tree["trainer"] = {"off_policy": "async", **sections.get("trainer", {})}
    config_from_dict(tree)


@pytest.mark.parametrize(("sections", "message"), [
    ({"algorithm": {"name": "dpo"}}, r"trainer\.off_policy='async' is not supported by the 'dpo'"),
    ({"rollout": {"sleep": "always"}}, r"rollout\.sleep=always with trainer\.off_policy=async"),
    ({"rollout": {"free_memory_when_idle": True}}, r"rollout\.sleep=always with trainer\.off_policy=async"),
    ({"algorithm": {"adv_estimator": "remax"}}, r"algorithm\.adv_estimator='remax' with trainer\.off_policy=async"),
    ({"trainer": {"backend": "ray"}, "ray": {"colocate": [["actor", "rollout"]]}},
     r"ray\.colocate: \['actor', 'rollout'\] with trainer\.off_policy=async: .* every call of actor would wait"),
    ({"trainer": {"backend": "ray"}, "ray": {"colocate": [["rollout", "reward"]]}}, r"ray\.colocate: .* every call of reward"),
    ({"trainer": {"backend": "ray"}, "ray": {"pools": {"default": {"gpus_per_bundle": 1}}}},
     r"ray\.roles\.rollout=default \(unset: the default pool\) with trainer\.off_policy=async: pool 'default' has GPUs "
     r"and also holds actor"),
    ({"trainer": {"backend": "ray"}, "ray": {"pools": {"default": {"gpus_per_bundle": 1}, "gen": {}},
                                            "roles": {"rollout": "default", "actor": "gen"}},
      "actor": {"use_kl_loss": True}},
     r"ray\.roles\.rollout=default with trainer\.off_policy=async: pool 'default' has GPUs and also holds ref"),
    ({"trainer": {"backend": "ray", "async_weight_sync": "step"}},
     r"trainer\.async_weight_sync=step with trainer\.backend=ray"),
    ({"trainer": {"overlap_with": "process"}}, r"trainer\.overlap_with=process with trainer\.off_policy=async"),
    ({"trainer": {"max_staleness": -1}}, r"max_staleness"),
    ({"trainer": {"async_weight_sync": "step"}, "rollout": {"backend": "no_decode_steps"}},
     r"trainer\.async_weight_sync=step with rollout\.backend=no_decode_steps: only the hf or vllm engine"),
    ({"trainer": {"async_weight_sync": "step"}, "rollout": {"backend": "vllm", "lora_sync": "adapter"},
      "actor": {"lora": {"rank": 8}}}, r"trainer\.async_weight_sync=step with rollout\.lora_sync=adapter"),
    ({"trainer": {"async_weight_sync": "decode"}}, r"async_weight_sync"),
    ({"trainer": {"async_weight_sync": "step"}, "rollout": {"agent": {"interaction": "m:f"}}},
     r"trainer\.async_weight_sync=step with rollout\.agent"),
])
def test_async_is_refused_at_load_naming_the_key(sections, message, monkeypatch):
    # a backend whose engine takes new weights between generate calls only
    monkeypatch.setitem(rollout_backends._BACKENDS, "no_decode_steps",
                        rollout_backends.Backend("rlcore.rollout.hf:HFRolloutEngine", BackendTraits(label="no steps")))
    with pytest.raises(ValueError, match=message):
        _load(**sections)


@pytest.mark.parametrize("ray", [
    {},  # every role in the pool 'default': on a CPU the rollout's own processes still overlap
    {"pools": {"default": {"gpus_per_bundle": 1}, "gen": {}}, "roles": {"rollout": "gen", "reward": "gen"}},
    {"colocate": [["actor", "ref"]]},
])
def test_async_on_ray_loads_with_the_rollout_in_processes_and_on_gpus_of_its_own(ray):
    _load(trainer={"backend": "ray"}, ray=ray)


def test_max_staleness_without_async_is_refused():
    with pytest.raises(ValueError, match=r"max_staleness is set, but trainer\.off_policy='one_step' does not read it"):
        config_from_dict({**BASE, "trainer": {"off_policy": "one_step", "max_staleness": 2}})
    with pytest.raises(ValueError, match=r"async_chunk_prompts is set, but trainer\.off_policy='sync' does not read it"):
        config_from_dict({**BASE, "trainer": {"async_chunk_prompts": 2}})
    with pytest.raises(ValueError, match=r"async_weight_sync is set, but trainer\.off_policy='sync' does not read it"):
        config_from_dict({**BASE, "trainer": {"async_weight_sync": "step"}})


# ----- a tiny run ---------------------------------------------------------------------------------

PROMPTS, N = 4, 4


def _async_overrides(example, out: Path, steps: int, *extra: str) -> list[str]:
    return tiny_example_overrides(example, str(out)) + [
        f"data.train_batch_size={PROMPTS}", "actor.ppo_mini_batch_size=4", f"rollout.n={N}", "data.val_batch_size=64",
        f"trainer.total_steps={steps}", "trainer.save_every=2", "trainer.val_every=100", "trainer.loggers=[jsonl]",
        "trainer.val_before_train=false", "trainer.off_policy=async", "trainer.max_staleness=1",
        "actor.behaviour_correction=decoupled", "actor.tis_cap=5", SCORE_IN_PROCESS, *extra]


def _async_config(example, out: Path, steps: int, *extra: str):
    return load_config(CONFIG_DIR / "tiny_grpo.yaml", _async_overrides(example, out, steps, *extra))



def _staleness_per_step(run: Path) -> list[dict[str, float]]:
    """Each step's samples per policy-version lag (`async/staleness_<lag>`)."""
    return [{k: v for k, v in r.items() if k.startswith("async/staleness_")}
            for r in read_jsonl(run / "metrics.jsonl") if r["step"] > 0]


def _logged_steps(run: Path) -> set[int]:
    path = run / "metrics.jsonl"
    return {r["step"] for r in read_jsonl(path)} if path.exists() else set()


NO_VALIDATION = "data.val_files=[]"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_tiny_async_grpo_run_trains_within_the_staleness_bound_and_a_sigkilled_run_resumes_exactly(tiny_example, tmp_path):
    """An uninterrupted run (in process) against a real `rlcore train` SIGKILLed while it trained
    the step after its step-2 checkpoint (the producer had drawn and generated prompts past that
    checkpoint), then resumed by the same command: the same prompts in the same steps, none
    trained twice or lost, the same samples per policy version in every step. One generate call
    per step (no `async_chunk_prompts`): the step after a checkpoint generates on the weights it
    trains from, the step after that while its predecessor trains, so each step's staleness is the
    same in every run."""
    steps = 5  # checkpoints at 2, 4 and 5
    make_trainer(_async_config(tiny_example, tmp_path / "straight", steps, NO_VALIDATION)).fit()
    records = [r for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert r["async/staleness_0"] + r["async/staleness_1"] == PROMPTS * N  # every sample within the bound
        assert 0 <= r["rollout/staleness_max"] <= 1
        assert 0 <= r["async/trainer_wait_frac"] <= 1 and 0 <= r["async/rollout_wait_frac"] <= 1
        assert 0 <= r["async/rollout_wait_frac_rank_0"] <= 1 and "async/rollout_wait_frac_rank_1" not in r
        assert r["async/buffer_depth"] >= 0
        assert math.isfinite(r["actor/pg_loss"])
    assert sum(r["async/dropped_groups"] for r in records) == 0  # the producer never runs further ahead than the bound
    # step 1 and the steps after the checkpoints at 2 and 4 generate on the weights they train from;
    # steps 2 and 4 were generated while the step before trained
    assert [r["async/staleness_0"] for r in records] == [PROMPTS * N, 0, PROMPTS * N, 0, PROMPTS * N]
    straight = prompts_per_step(tmp_path / "straight")
    assert [len(u) for u in straight] == [PROMPTS] * steps  # whole groups: n samples of each prompt
    assert len(set().union(*straight)) == steps * PROMPTS  # no prompt trained twice

    # the same run as a user runs it, SIGKILLed once step 3 is logged (the producer drew step 4's
    # prompts past the step-2 checkpoint), then the same command again
    run = tmp_path / "killed"
    args = [sys.executable, "-m", "rlcore.cli", "train", str(CONFIG_DIR / "tiny_grpo.yaml"),
            *_async_overrides(tiny_example, run, steps, NO_VALIDATION)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(tmp_path / "killed.stderr", "w") as err:
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        wait_for("step 3 of the run to be logged", lambda: 3 in _logged_steps(run), 300, procs=[proc], interval=0.02,
                 progress=tree_progress(run))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        stop_process_group(proc)
    assert proc.returncode == -signal.SIGKILL
    saved = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert saved == ["step_00000002"], f"killed after another checkpoint was saved: {saved}"
    resumed = subprocess.run(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             timeout=scaled(900))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint step 2" in resumed.stderr
    assert prompts_per_step(run) == straight
    assert _staleness_per_step(run) == _staleness_per_step(tmp_path / "straight")


@pytest.mark.slow
def test_a_tiny_async_run_taking_weights_between_decode_steps_trains_and_counts_interrupted_generations(
        tiny_example, tmp_path):
    """The sync runs on the rollout's own thread (a call back into its group there must not wait
    for itself) and the run ends; every sample stays within the bound by its oldest token."""
    make_trainer(_async_config(tiny_example, tmp_path / "run", 3, "trainer.async_weight_sync=step",
                                "trainer.async_chunk_prompts=2")).fit()
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["async/staleness_0"] + r["async/staleness_1"] == PROMPTS * N
        assert 0 <= r["async/interrupted_generations"] <= PROMPTS * N
        assert r["time/weight_sync_wait_s"] >= 0 and math.isfinite(r["actor/pg_loss"])


@pytest.mark.slow
def test_agent_rollouts_under_async_generate_whole_episodes_each_stamped_with_its_policy_version(tmp_path):
    """`rollout.agent` (the tool example's calculator) with `trainer.off_policy=async`: the rollout
    thread runs every turn of a prompt's n episodes in one generate call, tool calls included, so
    the weights (which change between generate calls) are one policy version per episode; step 2's
    episodes were generated while step 1 trained, on the starting weights."""
    from rlcore.example.tool_build import build_tool_example, tool_example_overrides

    out = tmp_path / "run"
    config = load_config(CONFIG_DIR / "tiny_tool_grpo.yaml", [
        *tool_example_overrides(build_tool_example(seed=0), str(out)), NO_VALIDATION, f"data.train_batch_size={PROMPTS}",
        "actor.ppo_mini_batch_size=4", f"rollout.n={N}", "rollout.agent.tool_workers=1", "trainer.total_steps=2",
        "trainer.loggers=[jsonl]", "trainer.val_before_train=false", "trainer.off_policy=async", "trainer.max_staleness=1",
        "actor.behaviour_correction=decoupled", "actor.tis_cap=5", SCORE_IN_PROCESS])
    make_trainer(config).fit()
    records = [r for r in read_jsonl(out / "metrics.jsonl") if r["step"] > 0]
    assert [(r["async/staleness_0"], r["async/staleness_1"]) for r in records] == [(PROMPTS * N, 0), (0, PROMPTS * N)]
    assert all(math.isfinite(r["actor/pg_loss"]) and "agent/turns_mean" in r for r in records)
    samples = [rec["samples"] for rec in read_jsonl(out / "trace.jsonl")]
    for step in samples:
        by_prompt: dict[str, list[dict]] = {}
        for s in step:
            by_prompt.setdefault(s["uid"], []).append(s)
        assert sorted(len(g) for g in by_prompt.values()) == [N] * PROMPTS  # whole groups
        assert {s["policy_version"] for s in step} == {0}
        assert all(s["finish"] for s in step)  # every episode ended (answer, a limit), none cut off
    # episodes that called the calculator went on after its result, in the same generation
    kinds = [[t["kind"] for t in s["turns"]] for step in samples for s in step]
    assert any(k[:4] == ["assistant", "tool", "rendered", "assistant"] for k in kinds), kinds


VLLM_RUN = ("rollout.backend=vllm", "rollout.vllm.kv_cache_gib=0.125", "rollout.vllm.max_model_len=128")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("weight_sync", ["generation", "step"])
def test_a_tiny_async_run_on_the_vllm_engine_trains_within_the_bound(tiny_example, tmp_path, weight_sync):
    """The vLLM engine generating on the async rollout's thread while the trainer pushes weights into
    it (between generate calls, or between decode steps of the generation in flight)."""
    pytest.importorskip("vllm")
    make_trainer(_async_config(tiny_example, tmp_path / "run", 3, *VLLM_RUN,
                               f"trainer.async_weight_sync={weight_sync}")).fit()
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["async/staleness_0"] + r["async/staleness_1"] == PROMPTS * N  # every sample within the bound
        assert math.isfinite(r["actor/pg_loss"])
        if weight_sync == "step":  # by its oldest token
            assert 0 <= r["async/interrupted_generations"] <= PROMPTS * N
    assert records[0]["rollout/logprob_diff_max"] < 1e-3  # step 1: engine and actor on one policy
    assert len(set().union(*prompts_per_step(tmp_path / "run"))) == 3 * PROMPTS  # no prompt trained twice
