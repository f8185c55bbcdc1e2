"""Which scorer grades which sample: built-ins by `data_source`, or a user function by spec.

A reward function has verl's signature and is always called with keywords:
`fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)`. It returns a number,
or a dict with a "score" key whose other numeric fields are kept as extra metrics.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import os
import sys
from collections.abc import Callable
from typing import Any

from rlcore.errors import RLCoreError

from . import gsm8k, math_boxed

RewardFn = Callable[..., Any]


class SpecError(RLCoreError, ValueError):
    """A `module:function` / `file.py:function` spec that cannot be loaded: the message names the
    spec and what is wrong with it (no such file or module, the file fails to run, no such function)."""


class RewardFunctionError(SpecError):
    """`reward.function` cannot be used (see `SpecError`)."""

# data_source -> scorer(solution_str, ground_truth). `tiny_arith` and `tiny_tool_arith` are the built-in examples.
_BUILTIN: dict[str, Callable[[str, Any], float]] = {}
for _name in ("openai/gsm8k", "gsm8k", "tiny_arith", "tiny_tool_arith"):
    _BUILTIN[_name] = gsm8k.compute_score  # strict: the model must write `#### <answer>`
for _name in (
    "math",
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "hendrycks/competition_math",
    "HuggingFaceH4/MATH-500",
    "math500",
):
    _BUILTIN[_name] = math_boxed.compute_score


def builtin_data_sources() -> list[str]:
    return sorted(_BUILTIN)


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
) -> float:
    """Score one response with the built-in scorer for its `data_source`."""
    scorer = _BUILTIN.get(data_source)
    if scorer is None:
        raise NotImplementedError(
            f"no built-in reward for data_source={data_source!r} (built-in: {', '.join(builtin_data_sources())}); "
            "give a reward function as 'module:function' or 'path/to/file.py:function'"
        )
    return float(scorer(solution_str, ground_truth))


def _load_module_from_file(path: str, spec: str, what: str, error: type[SpecError]):
    abs_path = os.path.abspath(path)
    if not os.path.isfile(abs_path):
        raise error(f"{what} spec {spec!r}: file {abs_path} does not exist")
    digest = hashlib.sha1(abs_path.encode()).hexdigest()[:10]
    mod_name = f"_rlcore_reward_{os.path.splitext(os.path.basename(abs_path))[0]}_{digest}"
    mspec = importlib.util.spec_from_file_location(mod_name, abs_path)
    if mspec is None or mspec.loader is None:
        raise error(f"{what} spec {spec!r}: cannot load {abs_path} as a Python module")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[mod_name] = module  # so dataclasses/pickle inside the user file can find it
    try:
        mspec.loader.exec_module(module)
    except SystemExit as e:  # user code's sys.exit() at import is an error, not the caller's exit
        sys.modules.pop(mod_name, None)
        raise error(f"{what} spec {spec!r}: executing {abs_path} called sys.exit({e.code!r})") from None
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise error(f"{what} spec {spec!r}: executing {abs_path} failed: {type(e).__name__}: {e}") from e
    return module


def _load_module(name: str, spec: str, what: str, error: type[SpecError]):
    if not all(part.isidentifier() for part in name.split(".")):
        raise error(f"{what} spec {spec!r}: {name!r} is neither a module name nor a .py path")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        raise error(f"{what} spec {spec!r}: cannot import module {name!r} ({e})") from e
    except SystemExit as e:
        raise error(f"{what} spec {spec!r}: importing {name!r} called sys.exit({e.code!r})") from None
    except Exception as e:
        raise error(f"{what} spec {spec!r}: importing {name!r} failed: {type(e).__name__}: {e}") from e


def is_path_spec(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where


def resolve_spec(spec: str | None) -> str | None:
    """The spec with a file path made absolute (worker processes may not share our cwd)."""
    if spec is None or ":" not in spec:
        return spec
    where, _, name = spec.rpartition(":")
    return f"{os.path.abspath(where)}:{name}" if is_path_spec(where) else spec


def load_function(spec: str, what: str = "function", error: type[SpecError] = SpecError) -> Callable[..., Any]:
    """The callable a "pkg.module:name" or "path/to/file.py:name" spec names (a function, or a
    class: an interaction factory). Raises `error` naming the spec (as "<what> spec ...")."""
    if not isinstance(spec, str) or not spec.strip():
        raise error(f"{what} spec {spec!r}: expected 'module:function' or 'path/to/file.py:function'")
    where, sep, name = spec.strip().rpartition(":")
    if not sep or not where:
        raise error(f"{what} spec {spec!r}: missing ':function'; expected 'module:function' or 'path/to/file.py:function'")
    if not name.isidentifier():
        raise error(f"{what} spec {spec!r}: {name!r} is not a valid function name")
    module = _load_module_from_file(where, spec, what, error) if is_path_spec(where) else _load_module(where, spec, what, error)
    fn = getattr(module, name, None)
    if fn is None:
        raise error(f"{what} spec {spec!r}: {where} has no attribute {name!r}")
    if not callable(fn):
        raise error(f"{what} spec {spec!r}: {where}.{name} is a {type(fn).__name__}, not a function")
    return fn  # type: ignore[no-any-return]


def load_reward_fn(spec: str | None) -> RewardFn:
    """None -> `default_compute_score`; "pkg.module:fn" or "path/to/file.py:fn" -> that function.

    Raises `RewardFunctionError` (a ValueError) naming the spec and what is wrong with it.
    """
    if spec is None:
        return default_compute_score
    return load_function(spec, "reward function", RewardFunctionError)


def _as_float(value: Any) -> float | None:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(value) > sys.float_info.max:
        return sys.float_info.max if value > 0 else -sys.float_info.max  # an int beyond any float: the largest float
    if isinstance(value, (bool, numbers.Real)):
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy / torch scalar
        try:
            return float(value.item())
        except (TypeError, ValueError):
            return None
    return None


def normalize_result(result: Any) -> tuple[float, dict[str, float]]:
    """(score, numeric extras) from what a reward function returned.

    Non-numeric extras (e.g. the extracted answer string) are dropped; a missing or non-finite
    score is an error, since a NaN reward would poison every advantage in its group.
    """
    extras: dict[str, float] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward dict has no 'score' key (keys: {sorted(map(str, result))})")
        score = _as_float(result["score"])
        for key, value in result.items():
            if key != "score":
                as_float = _as_float(value)
                if as_float is not None:
                    extras[str(key)] = as_float
    else:
        score = _as_float(result)
    if score is None:
        got = result["score"] if isinstance(result, dict) else result
        raise TypeError(f"reward must be a number or a dict with a numeric 'score', got {type(got).__name__}: {got!r:.80}")
    if not math.isfinite(score):
        raise ValueError(f"reward score is {score}")
    return score, extras
