"""Broken model folders are refused before any model loads, one line naming the config key and the
file (rlcore.trainer.model_folders via preflight): a truncated or padded safetensors file (policy,
critic, reward model), a sharded index naming a missing shard or tensor, a config transformers
cannot read, a classifier config without num_labels (transformers reads two labels), and
non-finite weights (a NaN score head is "non-finite weights in <file>: score.weight", not "this
architecture is not supported"), finite weights so large that the scores overflow, and a causal LM
whose config.json is labelled as a classifier. Real folders written by transformers, real
safetensors files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForSequenceClassification

from rlcore.cli import CONFIG_DIR, main, tiny_example_overrides
from rlcore.config import load_config
from rlcore.errors import RLCoreError
from rlcore.example.tokenizer import build_tokenizer
from rlcore.trainer.model_folders import safetensors_header
from rlcore.trainer.preflight import preflight_problems

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}")


def _reward_model(folder: Path, **config) -> Path:
    """A one-label Llama sequence classifier with the tiny example's tokenizer and a chat template."""
    tok = build_tokenizer()
    tok.chat_template = CHATML
    torch.manual_seed(0)
    sizes = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    LlamaForSequenceClassification(LlamaConfig(**{**sizes, **config})).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _config(example, tmp_path: Path, *extra: str):
    return load_config(CONFIG_DIR / "tiny_grpo.yaml", tiny_example_overrides(example, str(tmp_path / "run")) + list(extra))


def _problems(config, key: str) -> list[str]:
    return [p for p in preflight_problems(config) if p.startswith(f"{key}:")]


def _copy_model(example, tmp_path: Path) -> Path:
    return Path(shutil.copytree(example.model_dir, tmp_path / "model"))


def test_intact_folders_pass(tiny_example, tmp_path):
    rm = _reward_model(tmp_path / "rm")
    config = _config(tiny_example, tmp_path, f"reward_model.path={rm}")
    assert preflight_problems(config) == []


def test_a_nan_score_head_is_named_as_non_finite_weights(tiny_example, tmp_path, capsys):
    rm = _reward_model(tmp_path / "rm")
    weights = load_file(rm / "model.safetensors")
    weights["score.weight"] = torch.full_like(weights["score.weight"], float("nan"))
    save_file(weights, rm / "model.safetensors", metadata={"format": "pt"})
    args = ["train", str(CONFIG_DIR / "tiny_grpo.yaml"), *tiny_example_overrides(tiny_example, str(tmp_path / "run")),
            f"reward_model.path={rm}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"reward_model.path: non-finite weights in {rm / 'model.safetensors'}: score.weight (32 of 32 values NaN or inf)" in err
    assert "not supported" not in err and "Traceback" not in err


def test_a_score_head_that_overflows_is_named_at_preflight_and_at_load(tiny_example, tmp_path, capsys):
    """Finite weights at 1e38 give infinite scores: named as weights too large, not "not supported"."""
    from rlcore.workers.loading import load_sequence_classifier

    rm = _reward_model(tmp_path / "rm")
    weights = load_file(rm / "model.safetensors")
    weights["score.weight"] = torch.full_like(weights["score.weight"], 1e38)
    save_file(weights, rm / "model.safetensors", metadata={"format": "pt"})
    args = ["train", str(CONFIG_DIR / "tiny_grpo.yaml"), *tiny_example_overrides(tiny_example, str(tmp_path / "run")),
            f"reward_model.path={rm}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (f"reward_model.path: weights too large to compute with in {rm / 'model.safetensors'}: score.weight holds "
            "values up to 1e+38") in err, err
    assert "not supported" not in err and "Traceback" not in err
    with pytest.raises(RLCoreError, match=r"reward_model\.path: .* overflows"):  # past preflight: the probe names it
        load_sequence_classifier(rm, "float32", torch.device("cpu"), key="reward_model.path")


def test_a_causal_lm_labelled_as_a_classifier_is_named_at_preflight(tiny_example, tmp_path, capsys):
    lm = _copy_model(tiny_example, tmp_path)
    raw = json.loads((lm / "config.json").read_text())
    arch = raw["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
    (lm / "config.json").write_text(json.dumps({**raw, "architectures": [arch], "num_labels": 1,
                                                "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}))
    (lm / "chat_template.jinja").write_text(CHATML)
    args = ["train", str(CONFIG_DIR / "tiny_grpo.yaml"), *tiny_example_overrides(tiny_example, str(tmp_path / "run")),
            f"reward_model.path={lm}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"reward_model.path: {lm}'s config.json names {arch} with one label, but its weights hold no score head" in err
    assert "a causal LM whose config.json was labelled as a classifier" in err and "Traceback" not in err, err


def test_a_classifier_config_without_num_labels_reads_as_two_labels(tiny_example, tmp_path):
    rm = _reward_model(tmp_path / "rm")
    raw = json.loads((rm / "config.json").read_text())
    for key in ("num_labels", "id2label", "label2id"):
        raw.pop(key, None)
    (rm / "config.json").write_text(json.dumps(raw))
    [line] = _problems(_config(tiny_example, tmp_path, f"reward_model.path={rm}"), "reward_model.path")
    assert "transformers reads num_labels=2" in line and "neither num_labels nor id2label" in line and str(rm) in line


@pytest.mark.parametrize("damage", ["truncated", "padded", "header cut", "empty"])
def test_a_damaged_safetensors_file_is_named_with_its_key(tiny_example, tmp_path, damage):
    model = _copy_model(tiny_example, tmp_path)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    cut = {"truncated": data[:-1000], "padded": data + b"\0" * 64, "header cut": data[:50], "empty": b""}[damage]
    weights.write_bytes(cut)
    with pytest.raises(Exception, match=r"incomplete|Error|error"):  # what loading says: no file, no key
        load_file(weights)
    config = _config(tiny_example, tmp_path, f"model.path={model}")
    [line] = _problems(config, "model.path")
    assert line.startswith(f"model.path: unreadable weights in {weights}: ")
    reason = {"truncated": "truncated", "padded": "padded", "header cut": "truncated", "empty": "shorter than"}[damage]
    assert reason in line
    ppo = load_config(CONFIG_DIR / "tiny_ppo.yaml", tiny_example_overrides(tiny_example, str(tmp_path / "run"))
                      + [f"critic.model_path={model}"])
    assert _problems(ppo, "critic.model_path") == [line.replace("model.path:", "critic.model_path:", 1)]


def test_a_sharded_folder_is_checked_against_its_index(tiny_example, tmp_path):
    model = _copy_model(tiny_example, tmp_path)
    weights = load_file(model / "model.safetensors")
    names = sorted(weights)
    half = len(names) // 2
    (model / "model.safetensors").unlink()
    save_file({n: weights[n] for n in names[:half]}, model / "model-00001-of-00002.safetensors")
    save_file({n: weights[n] for n in names[half:]}, model / "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {n: f"model-0000{1 if i < half else 2}-of-00002.safetensors"
                                           for i, n in enumerate(names)}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    config = _config(tiny_example, tmp_path, f"model.path={model}")
    assert _problems(config, "model.path") == []
    index["weight_map"]["lm_head.extra"] = "model-00001-of-00002.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    [line] = _problems(config, "model.path")
    assert "model-00001-of-00002.safetensors lacks 1 tensor(s) its index puts there, first 'lm_head.extra'" in line
    (model / "model-00002-of-00002.safetensors").unlink()
    assert any("names the shard model-00002-of-00002.safetensors, which is missing" in p for p in _problems(config, "model.path"))


def test_a_config_transformers_cannot_read_is_named(tiny_example, tmp_path):
    model = _copy_model(tiny_example, tmp_path)
    (model / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    [line] = _problems(_config(tiny_example, tmp_path, f"model.path={model}"), "model.path")
    assert line.startswith(f"model.path: transformers cannot read {model / 'config.json'}: ")


def test_the_header_reader_agrees_with_safetensors(tiny_example):
    header = safetensors_header(tiny_example.model_dir / "model.safetensors")
    assert set(header) == set(load_file(tiny_example.model_dir / "model.safetensors"))
