"""Registered model versions as MLflow models: an HF folder that is also an MLflow pyfunc model.

A version's folder keeps the Hugging Face files at its root (`config.json`, `model.safetensors`,
tokenizer), so transformers and vLLM load it as is, and adds MLflow's `MLmodel`, the requirements
and this file under `code/`, so `mlflow.pyfunc.load_model("models:/<name>@champion")` loads it
too and `predict` generates text (greedy) from prompts, offline. A reward model's version (a
one-label sequence classifier) is the same kind of folder, and its `predict` scores
[prompt, response] pairs instead (`SequenceScorer`).

Why not `mlflow.transformers`: it stores the HF files under `model/components/...` (no longer a
folder vLLM loads as is) and wants torchvision or hand-listed requirements anyway. Why a
`loader_module` and not a `PythonModel`: a `PythonModel`'s files live under `artifacts/`, while
a loader module is handed the model's root folder, which here is the HF folder itself.

This file is copied into every version and imported there by MLflow as the top-level module
`hf_pyfunc`: it must import nothing from rlcore (a serving environment need not have it).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

LOADER_MODULE = "hf_pyfunc"
DEFAULT_MAX_NEW_TOKENS = 64
# What loading and generating needs (mlflow adds itself); pinned to the versions that trained it.
REQUIREMENTS = ("torch", "transformers", "tokenizers", "safetensors", "pandas")


def _load_tokenizer(folder: Path) -> Any:
    """AutoTokenizer, as vLLM and users' code load it, with a pad token: the same rule as
    rlcore.workers.tokenizer (this file imports nothing from rlcore, so the rule is repeated here,
    on purpose)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


class TextGenerator:
    """Greedy generation from an HF causal LM folder; prompts are rendered as in training (a
    user message through the tokenizer's chat template, when it has one)."""

    def __init__(self, path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        folder = Path(path)
        tok = _load_tokenizer(folder)
        tok.padding_side = "left"
        self.tokenizer = tok
        self.model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
        # Every end token the model declares (the tokenizer's EOS and generation_config's list),
        # as rlcore.workers.tokenizer.end_token_ids: passing only the tokenizer's to `generate`
        # would replace the generation config's list.
        declared = self.model.generation_config.eos_token_id
        declared = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
        self.end_token_ids = list(dict.fromkeys([i for i in [tok.eos_token_id, *declared] if i is not None]))

    def render(self, prompt: str, chat_template: bool = True) -> tuple[str, bool]:
        """(text, templated): the prompt as one user message through the chat template, or as is."""
        if chat_template and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)
            return str(text), True
        return prompt, False

    def generate(self, prompts: Sequence[str], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                 chat_template: bool = True) -> list[str]:
        """The greedy completion of each prompt, up to its first end token (new text only, special
        tokens dropped)."""
        import torch

        tok = self.tokenizer
        rendered = [self.render(p, chat_template) for p in prompts]
        rows = [tok(text, add_special_tokens=not templated)["input_ids"] for text, templated in rendered]
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + list(r) for r in rows])
        attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                      max_new_tokens=int(max_new_tokens), pad_token_id=tok.pad_token_id,
                                      eos_token_id=self.end_token_ids)
        return [tok.decode(self._cut(row[width:].tolist()), skip_special_tokens=True) for row in out]

    def _cut(self, ids: list[int]) -> list[int]:
        """Up to the first end token (as rlcore.workers.tokenizer.cut_at_end)."""
        ends = set(self.end_token_ids)
        return next((ids[:i] for i, t in enumerate(ids) if t in ends), ids)

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> list[str]:
        """pyfunc's entry point: a string, a list of strings, or a one-column DataFrame."""
        params = params or {}
        if isinstance(model_input, str):
            prompts = [model_input]
        elif hasattr(model_input, "iloc"):  # pandas: MLflow hands a DataFrame
            prompts = [str(v) for v in (model_input.iloc[:, 0] if model_input.ndim == 2 else model_input)]
        else:
            prompts = [str(v) for v in model_input]
        if not prompts:
            return []
        return self.generate(prompts, int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
                             bool(params.get("chat_template", True)))


def is_reward_model(path: str | Path) -> bool:
    """The folder holds a one-label sequence classifier (a reward model), by its config.json."""
    config = json.loads((Path(path) / "config.json").read_text())
    labels = config.get("id2label")
    one_label = len(labels) == 1 if isinstance(labels, dict) else config.get("num_labels", 1) == 1
    return one_label and any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])


class SequenceScorer:
    """Scores from an HF reward-model folder: each (prompt, response) rendered as rlcore trains and
    reads it (the prompt as a user message, the response as the assistant's turn, through the
    folder's chat template, no special tokens added), scored by transformers' own forward (the
    score head at the last non-pad token of each right-padded row)."""

    def __init__(self, path: str) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        folder = Path(path)
        self.tokenizer = _load_tokenizer(folder)
        self.model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True,
                                                                        dtype=torch.float32).eval()

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        import torch

        tok = self.tokenizer
        rows = []
        for prompt, response in zip(prompts, responses):
            text = tok.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
                                           tokenize=False)
            rows.append(tok(str(text), add_special_tokens=False)["input_ids"])
        width = max(len(r) for r in rows)
        pad = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else tok.pad_token_id
        input_ids = torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows])
        attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        with torch.no_grad():
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].float().tolist()

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> list[float]:
        """pyfunc's entry point: a DataFrame (or dict of lists) with `prompt` and `response`, or a
        list of (prompt, response) pairs."""
        if hasattr(model_input, "iloc") or isinstance(model_input, dict):
            prompts, responses = list(model_input["prompt"]), list(model_input["response"])
        else:
            prompts, responses = [str(p) for p, _ in model_input], [str(r) for _, r in model_input]
        if not prompts:
            return []
        return self.score([str(p) for p in prompts], [str(r) for r in responses])


def _load_pyfunc(path: str) -> TextGenerator | SequenceScorer:
    """MLflow calls this with the model's root folder (no `data` path in MLmodel)."""
    return SequenceScorer(path) if is_reward_model(path) else TextGenerator(path)


# ---------------------------------------------------------------------- writing a version
def requirements() -> list[str]:
    """`name==version` for what loading needs, as installed here (no guessing by MLflow, which
    would load the model in a subprocess to find out)."""
    out = []
    for name in REQUIREMENTS:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(name)
    return out


def _link_or_copy(src: str, dst: str) -> None:
    """Hard link (weights are not copied twice on one file system), else copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def save_hf_pyfunc(hf_dir: str | Path, dst: str | Path) -> Path:
    """Write `dst`: the files of the HF folder `hf_dir` at its root plus the pyfunc model around
    them (`MLmodel`, `code/hf_pyfunc.py`, requirements, signature, an input example)."""
    import mlflow
    from mlflow.models import Model, ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    hf_dir, dst = Path(hf_dir), Path(dst)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir}: not an HF model folder (no config.json)")
    if is_reward_model(hf_dir):  # (prompt, response) -> score
        import pandas as pd

        signature = ModelSignature(inputs=Schema([ColSpec("string", "prompt"), ColSpec("string", "response")]),
                                   outputs=Schema([ColSpec("double")]))
        example: Any = pd.DataFrame({"prompt": ["12+34="], "response": ["#### 46"]})
        about = "root: AutoModelForSequenceClassification loads this folder as is (a reward model)"
    else:
        signature = ModelSignature(
            inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]),
            params=ParamSchema([ParamSpec("max_new_tokens", "long", DEFAULT_MAX_NEW_TOKENS),
                                ParamSpec("chat_template", "boolean", True)]))
        example = (["12+34="], {"max_new_tokens": 16, "chat_template": True})
        about = "root: transformers and vLLM load this folder as is"
    mlflow.pyfunc.save_model(
        str(dst), loader_module=LOADER_MODULE, code_paths=[str(Path(__file__).resolve())],
        pip_requirements=requirements(), signature=signature, input_example=example, metadata={"hf_folder": about},
    )
    shutil.copytree(hf_dir, dst, dirs_exist_ok=True, copy_function=_link_or_copy)
    model = Model.load(str(dst / "MLmodel"))  # its size, now with the weights in
    model.model_size_bytes = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    model.save(str(dst / "MLmodel"))
    return dst


__all__ = ["LOADER_MODULE", "SequenceScorer", "TextGenerator", "is_reward_model", "requirements", "save_hf_pyfunc"]
