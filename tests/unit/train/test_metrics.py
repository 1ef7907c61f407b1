"""fsdp_recipes.train.metrics: the FLOPs count behind MFU, the peak table, perplexity, the loss plot."""

from __future__ import annotations

import math

import pytest
from conftest import REPO
from transformers import AutoConfig, AutoModelForCausalLM

from fsdp_recipes.train.metrics import Throughput, flops_per_token, peak_tflops, perplexity, plot_losses


def test_flops_per_token_is_six_n_plus_attention():
    """Counted here from the config alone: a Llama layer holds q and o (h x h), k and v (h x kv), the MLP's three
    h x i matrices and two norms; the embeddings and the LM head are left out (PaLM's count, as torchtitan's)."""
    config = AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")
    model = AutoModelForCausalLM.from_config(config)
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    non_embedding = layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h
    assert flops_per_token(model, 128) == 6 * non_embedding + 12 * layers * h * 128


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
    throughput.total_tokens, throughput.total_seconds = 4000, 2.0  # 1000 tokens/s per device on 2 devices
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
