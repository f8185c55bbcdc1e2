"""Rollout backends are rows of one table (`rlcore.rollout_backends`): the rest of rlcore asks a
backend's traits (tensor parallel? adapter sync? which tokenizer serves? which engine limit does
preflight check?) instead of comparing `rollout.backend` with names, and a backend registered from
outside rlcore trains by name from the CLI."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
from name_checks import name_checks  # tests/ is on sys.path (pytest rootdir conftest)
from thin_backend import ThinEngine

import rlcore
from rlcore.cli import CONFIG_DIR, main, tiny_example_overrides
from rlcore.config import ConfigError, load_config
from rlcore.rollout import register_backend
from rlcore.rollout_backends import _BACKENDS, backend_names, names_where

PACKAGE = Path(rlcore.__file__).resolve().parent
INSIDE = (PACKAGE / "rollout", PACKAGE / "rollout_backends.py")  # where a backend may be known by its name
NAMES = {"hf", "vllm", "sglang", "trtllm"}  # the built-in rows and the names the next rows would take
ABOUT_A_BACKEND = re.compile(r"backend|engine|serving", re.IGNORECASE)


def backend_name_checks(source: str, filename: str) -> list[str]:
    """Each comparison of something about a rollout backend with a backend's name:
    `config.rollout.backend == "vllm"`, `backend in ("vllm", "auto")`, `rollout.backend != "hf"`."""
    return name_checks(source, filename, NAMES | set(_BACKENDS), ABOUT_A_BACKEND)


def test_no_backend_name_checks_outside_the_rollout_package():
    """A new `rollout.backend == "vllm"` (or `in (...)`, `!=`) outside `rlcore/rollout/` fails here:
    ask `rlcore.rollout_backends.traits_of(name)` instead, or add the trait the question needs."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if not any(path == inside or inside in path.parents for inside in INSIDE):
            found += backend_name_checks(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert found == [], "rollout-backend name checks outside rlcore/rollout/:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    'if config.rollout.backend == "vllm": pass',
    'ok = cfg.rollout.backend in ("vllm", "auto")',
    'label = "vLLM" if rollout.backend != "hf" else "hf"',
    'if backend == "vllm": pass',
    'if "hf" == self.backend: pass',
    'y = engine_name not in {"vllm", "sglang"}',
])
def test_the_scan_finds_each_form_of_check(source):
    assert len(backend_name_checks(source, "x.py")) == 1


@pytest.mark.parametrize("source", [
    'if config.trainer.backend == "ray": pass',  # where workers run, not a rollout backend
    'if backend == "torch": pass',  # a kernel backend
    'if self.rollout.backend == "auto": pass',  # auto is a choice between backends, not one
    'about = {"backend": config.rollout.backend}',
])
def test_the_scan_leaves_other_comparisons_alone(source):
    assert backend_name_checks(source, "x.py") == []


def test_every_row_imports_its_engine_and_the_engine_declares_the_rows_traits():
    for name in ["hf", *(["vllm"] if importlib.util.find_spec("vllm") is not None else [])]:
        row = _BACKENDS[name]
        module, _, cls = row.engine.partition(":")
        engine = getattr(importlib.import_module(module), cls)
        assert engine.traits is row.traits and callable(engine.engine_kwargs)
    assert names_where(tensor_parallel=True) == ["vllm"] and names_where(adapter_sync=True) == ["vllm"]


BASE = ["model.path=m", "data.train_files=[t]"]


def test_rollout_backend_is_checked_against_the_registry_at_load():
    with pytest.raises(ConfigError, match=r"rollout.backend: .*unknown rollout backend 'sglang'; known: auto, hf, vllm"):
        load_config(None, [*BASE, "rollout.backend=sglang"])
    with pytest.raises(ConfigError, match=r"rollout.backend: .*cannot import 'no_such_module:Engine'"):
        load_config(None, [*BASE, "rollout.backend=no_such_module:Engine"])
    register_backend("thin", "thin_backend:ThinEngine")
    try:
        assert "thin" in backend_names()
        assert load_config(None, [*BASE, "rollout.backend=thin"]).rollout.backend == "thin"
        # its traits come from the class (the hf engine's): no tensor parallel, no adapter sync
        with pytest.raises(ConfigError, match=r"rollout.layout.tensor_parallel=2 needs rollout.backend=vllm: the thin "
                                              r"backend generates with one whole model per rank"):
            load_config(None, [*BASE, "rollout.backend=thin", "rollout.layout={tensor_parallel: 2}"])
        with pytest.raises(ConfigError, match=r"rollout.lora_sync=adapter needs rollout.backend=vllm"):
            load_config(None, [*BASE, "rollout.backend=thin", "actor.lora.rank=8", "rollout.lora_sync=adapter"])
    finally:
        del _BACKENDS["thin"]


def test_an_unknown_backend_is_one_line_from_the_cli(capsys):
    assert main(["train", str(CONFIG_DIR / "tiny_grpo.yaml"), "model.path=m", "data.train_files=[t]",
                 "rollout.backend=sglang"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlcore: error: ") and "rollout.backend" in err and "known: auto, hf, vllm" in err
    assert "Traceback" not in err


QUICK = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "rollout.max_new_tokens=4",
         "data.val_files=[]", "trainer.val_before_train=false", "trainer.loggers=[jsonl]", "trainer.total_steps=1",
         "trainer.save_every=1", "reward.num_workers=0", "trainer.trace=false"]


@pytest.mark.slow
def test_a_backend_from_outside_rlcore_trains_by_name_from_the_cli(tiny_example, tmp_path):
    """`rlcore train ... rollout.backend=thin_backend:ThinEngine`: the run's rollouts come from the
    wrapper (its counter), and the run finishes with its checkpoint."""
    before = ThinEngine.calls
    out = tmp_path / "run"
    assert main(["train", str(CONFIG_DIR / "tiny_grpo.yaml"), *tiny_example_overrides(tiny_example, str(out)), *QUICK,
                 "rollout.backend=thin_backend:ThinEngine"]) == 0
    assert ThinEngine.calls - before == 1  # one step: one rollout of 4 prompts x 2 samples
    assert ThinEngine.responses >= 8
    assert (out / "checkpoints" / "step_00000001").is_dir()


def test_preflight_and_the_tokenizer_check_ask_the_traits(tiny_example):
    """vLLM's context limit is checked for agent trajectories where the backend declares it (vllm,
    and auto where vLLM is installed), not for hf or a backend with hf's traits; the serving side the
    tokenizer check compares with is the backend's own loader (vLLM's) or AutoTokenizer."""
    from rlcore.trainer.preflight import agent_length_problems
    from rlcore.trainer.tokenizer_check import _serving

    def problems(backend: str) -> list[str]:
        return agent_length_problems(load_config(None, [
            f"model.path={tiny_example.model_dir}", "data.train_files=[t]", f"rollout.backend={backend}",
            "rollout.agent.interaction=m:F", "rollout.vllm.max_model_len=64", "rollout.agent.max_total_tokens=48"]))

    assert problems("hf") == [] and problems("thin_backend:ThinEngine") == []
    assert _serving(str(tiny_example.model_dir), "thin_backend:ThinEngine")[0] == "AutoTokenizer"
    if importlib.util.find_spec("vllm") is not None:
        assert problems("vllm") == problems("auto") == [
            "rollout.agent.max_total_tokens: data.max_prompt_length (64) + rollout.agent.max_total_tokens (48) = 112 "
            "tokens exceeds rollout.vllm.max_model_len (64)"]
        name, tokenizer = _serving(str(tiny_example.model_dir), "vllm")
        assert name == "vLLM's tokenizer" and type(tokenizer).__module__.startswith("vllm")
