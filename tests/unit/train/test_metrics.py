"""fsdp_recipes.train.metrics: the FLOPs count behind MFU, the peak table, perplexity, the loss plot."""

from __future__ import annotations

import math

import pytest
from conftest import REPO
from transformers import AutoConfig, AutoModelForCausalLM

from fsdp_recipes.train.metrics import Throughput, flops_per_token, peak_tflops, perplexity, plot_losses


def llama_params(h, layers, vocab, heads, kv_heads, inter, tied, head_dim=None, qk_norm=False):
    """(all parameters, the token embedding's) of a Llama-family decoder from its config numbers alone: q and o
    (h x heads*d), k and v (h x kv*d), the MLP's three h x inter matrices and two norms a layer (plus Qwen3's q and
    k norms of d), the final norm, the embedding and, untied, the LM head."""
    d = head_dim or h // heads
    layer = 2 * h * heads * d + 2 * h * kv_heads * d + 3 * h * inter + 2 * h + (2 * d if qk_norm else 0)
    return layers * layer + h + vocab * h * (1 if tied else 2), vocab * h


def gpt2_params(h, layers, vocab, positions):
    """(all parameters, the lookups'): a GPT-2 block holds c_attn (h x 3h + 3h), c_proj (h x h + h), the MLP's
    h x 4h + 4h and 4h x h + h, two layer norms (2h each); the token embedding is tied to the LM head."""
    layer = (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h) + 4 * h
    return layers * layer + 2 * h + vocab * h + positions * h, positions * h


FLOP_CASES = {
    # Llama-3.2-1B: tied 128,256-token head, 1,235,814,400 parameters
    "llama-3.2-1b": (
        "llama",
        {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8},
        {"intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True},
    ),
    "llama-3.2-1b-untied": (
        "llama",
        {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8},
        {"intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": False},
    ),
    "llama-small": (
        "llama",
        {"hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2},
        {"intermediate_size": 688, "vocab_size": 1000, "tie_word_embeddings": False},
    ),
    # Qwen3: head_dim 128 over 16 heads of a 1024-wide model (heads x d = 2048, not the hidden size), q/k norms
    "qwen3-0.6b-shape": (
        "qwen3",
        {"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8},
        {"intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True, "head_dim": 128},
    ),
}


def meta_model(model_type: str, shape: dict, rest: dict):
    import torch

    config = AutoConfig.for_model(model_type, **shape, **rest)
    # the count needs shapes only: a 1B model costs nothing here
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("seq_len", [128, 1024, 8192])
@pytest.mark.parametrize("name", FLOP_CASES)
def test_flops_per_token_counts_the_lm_head_and_a_tied_one_once(name, seq_len):
    """torchtitan's count: 6 x every parameter but the embedding lookups (a tied head is the embedding, counted once
    as the head's matmul), plus 12 x layers x heads x head dim x sequence length."""
    model_type, shape, rest = FLOP_CASES[name]
    h, layers, heads = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"]
    d = rest.get("head_dim") or h // heads
    total, embedding = llama_params(
        h,
        layers,
        rest["vocab_size"],
        heads,
        shape["num_key_value_heads"],
        rest["intermediate_size"],
        rest["tie_word_embeddings"],
        rest.get("head_dim"),
        qk_norm=model_type == "qwen3",
    )
    model = meta_model(model_type, shape, rest)
    assert sum(p.numel() for p in model.parameters()) == total
    matmul = total if rest["tie_word_embeddings"] else total - embedding
    assert flops_per_token(model, seq_len) == 6 * matmul + 12 * layers * heads * d * seq_len


def test_the_1b_shape_is_counted_as_torchtitan_counts_it():
    """Llama-3.2-1B at 1,024 tokens: 6 x 1,235,814,400 + 12 x 16 x 32 x 64 x 1,024 (torchtitan's
    get_dense_model_nparams_and_flops with enable_weight_tying); leaving the tied head out would report 20% less."""
    model = meta_model(*FLOP_CASES["llama-3.2-1b"])
    assert flops_per_token(model, 1024) == 7_817_539_584
    assert (6 * (1_235_814_400 - 128256 * 2048) + 402_653_184) / 7_817_539_584 == pytest.approx(0.80, abs=0.005)


@pytest.mark.parametrize("layers, h, positions", [(2, 64, 128), (12, 768, 1024)])
def test_gpt2s_position_embeddings_are_a_lookup_and_its_tied_head_a_matmul(layers, h, positions):
    shape = {"n_layer": layers, "n_embd": h, "n_head": 4, "n_positions": positions, "vocab_size": 50257}
    model = meta_model("gpt2", shape, {})
    total, lookups = gpt2_params(h, layers, 50257, positions)
    assert sum(p.numel() for p in model.parameters()) == total
    assert flops_per_token(model, 256) == 6 * (total - lookups) + 12 * layers * h * 256


def test_the_tiny_model_is_counted_from_its_files():
    config = AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")
    model = AutoModelForCausalLM.from_config(config)
    total, embedding = llama_params(64, 4, 474, 4, 2, 172, tied=False, head_dim=16)
    assert flops_per_token(model, 128) == 6 * (total - embedding) + 12 * 4 * 4 * 16 * 128


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA L4", 121),
        ("NVIDIA L40S", 362),
        ("Tesla T4", None),
    ],
)
def test_peak_table_matches_the_most_specific_name(name, tflops):
    assert peak_tflops(name) == tflops


def test_mfu_from_tokens_flops_and_peak():
    throughput = Throughput(flops_per_token=1e9, peak=1e12)
    # 1000 tokens/s per device on 2 devices
    throughput.total_tokens, throughput.total_seconds = 4000, 2.0
    assert throughput.averages(world_size=2) == {
        "tokens": 4000,
        "tokens_per_second": 2000.0,
        "tokens_per_second_per_device": 1000.0,
        "mfu": 1.0,
    }
    assert "mfu" not in Throughput().averages(1) and Throughput().averages(1) == {}


def test_perplexity_and_an_empty_plot(tmp_path):
    assert math.isclose(perplexity(2.0), math.exp(2.0)) and perplexity(1000.0) == math.inf
    assert (
        plot_losses([{"step": 1, "learning_rate": 0.1}], tmp_path / "loss.png") is None
        and not (tmp_path / "loss.png").exists()
    )
