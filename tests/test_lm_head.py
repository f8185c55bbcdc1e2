"""The log-prob path uses each model's own LM head semantics, checked against the model's own
forward (log_softmax of its logits / T): a biased head (Llama with an nn.Linear(bias=True) head;
Phi, a real architecture with one), Cohere's logit_scale, Granite's logits_scaling (MiniCPM3
divides its hidden state by the same attribute) and Gemma 2's final_logit_softcapping.
Log-probs, entropies and every parameter's gradient (the head's bias included) must agree; each
case is built so that dropping its head feature (the old `hidden @ W.T`) would miss by far more
than the tolerance. A model whose forward makes its logits some other way (Falcon-H1 multiplies
them by `lm_head_multiplier`) is refused at load, naming its class. Each runs padded and packed
(rlcore's packed-sequence attention; Gemma 2's soft-capped attention is refused there).

Tolerances (float32 throughout): log-probs and entropies 1e-5 absolute; gradients 1e-4 of the
largest entry of each reference gradient (the chunked path sums in a different order).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    FalconH1Config,
    FalconH1ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MiniCPM3Config,
    MiniCPM3ForCausalLM,
    PhiConfig,
    PhiForCausalLM,
)

from rlcore.protocol import Batch
from rlcore.triton_kernels import fused_token_logprobs
from rlcore.workers.attention import use_packed_attention
from rlcore.workers.forward import LMHead, lm_head_semantics, response_hidden_states, response_log_probs
from rlcore.workers.loading import load_causal_lm
from rlcore.workers.model_checks import check_lm_head, check_packed_forward

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _llama_biased_head() -> nn.Module:
    model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False))
    model.lm_head = nn.Linear(32, VOCAB, bias=True)
    with torch.no_grad():
        model.lm_head.bias.normal_(0.0, 2.0)
    return model


def _phi() -> nn.Module:
    kw = {k: v for k, v in SMALL.items() if k != "num_key_value_heads"}
    model = PhiForCausalLM(PhiConfig(**kw, partial_rotary_factor=0.5))
    with torch.no_grad():
        model.lm_head.bias.normal_(0.0, 2.0)  # initialised to zeros: make the bias matter
    return model


def _cohere() -> nn.Module:
    return CohereForCausalLM(CohereConfig(**SMALL, logit_scale=8.0, initializer_range=0.2))


def _granite() -> nn.Module:
    return GraniteForCausalLM(GraniteConfig(**SMALL, logits_scaling=0.125, initializer_range=0.2))


def _minicpm3() -> nn.Module:
    cfg = MiniCPM3Config(**{**SMALL, "num_key_value_heads": 4}, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                         qk_rope_head_dim=8, v_head_dim=8, dim_model_base=4, initializer_range=0.4)
    return MiniCPM3ForCausalLM(cfg)


def _gemma2() -> nn.Module:
    return Gemma2ForCausalLM(Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=1.5, initializer_range=0.5,
                                          sliding_window=16))


MODELS = {
    "llama_biased_head": (_llama_biased_head, LMHead(has_bias=True)),
    "phi": (_phi, LMHead(has_bias=True)),
    "cohere": (_cohere, LMHead(has_bias=False, logit_scale=8.0)),
    "granite": (_granite, LMHead(has_bias=False, logit_scale=8.0)),
    "minicpm3": (_minicpm3, LMHead(has_bias=False, logit_scale=0.125)),  # hidden / (32 / 4)
    "gemma2": (_gemma2, LMHead(has_bias=False, softcap=1.5)),
}


def _batch(seed: int = 0, n: int = 4, p: int = 7, r: int = 6) -> Batch:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, VOCAB, (n, p), generator=g)
    responses = torch.randint(3, VOCAB, (n, r), generator=g)
    attn = torch.ones(n, p + r, dtype=torch.long)
    attn[0, :3] = 0  # one left-padded prompt
    return Batch(tensors={"input_ids": torch.cat([prompts, responses], 1), "attention_mask": attn,
                          "position_ids": (attn.cumsum(-1) - 1).clamp(min=0), "responses": responses})


def _own(model: nn.Module, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies from the model's own forward: the ground truth."""
    r = batch["responses"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits.float()
    logp = torch.log_softmax(logits[:, -r - 1: -1] / temperature, -1)
    return logp.gather(-1, batch["responses"][..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]().eval()


@pytest.mark.parametrize("name", list(MODELS))
def test_semantics_read_from_the_model(name):
    model = _build(name)
    assert lm_head_semantics(model) == MODELS[name][1]
    assert check_lm_head(model) == MODELS[name][1]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", list(MODELS))
def test_log_probs_entropy_and_grads_equal_the_models_own_forward(name, packed):
    model = _build(name)
    batch = _batch()
    temperature = 0.7
    own_lp, own_ent = _own(model, batch, temperature)
    own_grads = torch.autograd.grad(own_lp.sum() + 0.5 * own_ent.sum(), list(model.parameters()))
    if packed:  # as `load_causal_lm` sets a model up with model.use_remove_padding (the default)
        use_packed_attention(model)
        if name == "gemma2":  # soft-capped attention logits: refused, naming the key that turns packing off
            with pytest.raises(ValueError, match="softcap.*model.use_remove_padding=false"):
                check_packed_forward(model)
            return
        check_packed_forward(model)

    lp, ent = response_log_probs(model, batch, temperature, chunk_tokens=5, compute_entropy=True, backend="torch",
                                 remove_padding=packed)
    # Two float32 computation orders: they agree to rounding, which scales with the values (log-probs
    # reach -40 here; kernels differ by CPU: 1.9e-5 apart on an AVX2-only AMD EPYC, 1.79e-5 at -3.3 on an
    # AVX-512 one, packed). A wrong token alignment or mask moves log-probs by 1e-3 or more.
    torch.testing.assert_close(lp, own_lp, atol=3e-5, rtol=2e-6)
    torch.testing.assert_close(ent, own_ent, atol=3e-5, rtol=2e-6)
    grads = torch.autograd.grad(lp.sum() + 0.5 * ent.sum(), list(model.parameters()))
    for (pname, _), got, want in zip(model.named_parameters(), grads, own_grads):
        scale = want.abs().max().clamp_min(1e-6)
        assert (got - want).abs().max() <= 1e-4 * scale, pname
    if MODELS[name][1].has_bias:
        assert model.get_output_embeddings().bias in set(model.parameters())

    # the head feature matters here: the plain `hidden @ W.T` log-probs are far off
    with torch.no_grad():
        hidden = response_hidden_states(model, batch)
        plain = fused_token_logprobs(hidden, model.get_output_embeddings().weight, batch["responses"],
                                     temperature=temperature, backend="torch").logprobs
    assert (plain - own_lp).abs().max().item() > 0.05


def test_biased_head_loads_from_a_checkpoint(tmp_path):
    _build("phi").save_pretrained(tmp_path / "phi")
    model = load_causal_lm(tmp_path / "phi", "float32", torch.device("cpu"))
    assert lm_head_semantics(model).has_bias and model.lm_head.bias.abs().max() > 0.5


def test_model_with_unknown_logit_transform_is_refused_at_load(tmp_path):
    """Falcon-H1 multiplies its logits by `lm_head_multiplier`, which rlcore does not read."""
    torch.manual_seed(0)
    cfg = FalconH1Config(**SMALL, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1,
                         mamba_chunk_size=16, lm_head_multiplier=4.0)
    FalconH1ForCausalLM(cfg).save_pretrained(tmp_path / "falcon_h1")
    with pytest.raises(ValueError, match="FalconH1ForCausalLM: its forward computes logits differently"):
        load_causal_lm(tmp_path / "falcon_h1", "float32", torch.device("cpu"))


def test_head_rlcore_cannot_express_is_refused_naming_the_attribute():
    model = _build("cohere")
    model.logit_scale = nn.Parameter(torch.tensor(8.0))  # a learned scale
    with pytest.raises(ValueError, match=r"CohereForCausalLM.logit_scale is a tensor"):
        lm_head_semantics(model)
    model = _build("llama_biased_head")
    model.lm_head = nn.Sequential(nn.Linear(32, VOCAB))
    with pytest.raises(ValueError, match="LlamaForCausalLM: get_output_embeddings"):
        lm_head_semantics(model)


def test_checkpoint_folder_is_required(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_causal_lm(tmp_path, "float32", torch.device("cpu"))
