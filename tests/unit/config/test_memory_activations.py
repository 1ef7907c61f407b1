"""The estimator's activation term and peak against what really holds memory: autograd's saved tensors on CPU (counted
with saved-tensor hooks, for generated shapes) and every CUDA peak on record from bench/gpu_check.py runs."""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch
import yaml
from conftest import REPO
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen3Config

from fsdp_recipes.config.memory import ModelShape, Setup, estimate, model_shape, saved_per_token
from fsdp_recipes.config.strategy import strategy_of


def saved_bytes(config, dtype: torch.dtype, batch: int, seq: int) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward with labels (weights excluded)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in weights)


def generated_shapes(count: int, seed: int):
    """Llama and Qwen3 (a norm on each query and key head) layers; the heads' width need not be the hidden size
    (Qwen3-0.6B: 16 x 128 heads on 1024)."""
    rng = random.Random(seed)
    for i in range(count):
        heads = rng.choice([2, 4, 6, 8])
        head_dim = rng.choice([8, 16, 32, 64])
        # half: q width != hidden
        per_head = head_dim if i % 4 < 2 else rng.choice([d for d in (8, 16, 32, 64) if d != head_dim])
        # transformers wants hidden a multiple of the heads
        hidden = heads * per_head
        kv_heads = rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0])
        intermediate = rng.choice([2 * hidden, 3 * hidden, int(hidden * 2.6875) // 8 * 8])
        yield (
            ["llama", "qwen3"][i % 2],
            heads,
            kv_heads,
            head_dim,
            hidden,
            intermediate,
            rng.choice([16, 48]),
            rng.choice([1, 3]),
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "shape_args", list(generated_shapes(8, seed=7)), ids=lambda a: "{0}-h{4}-I{5}-heads{1}x{3}-kv{2}".format(*a)
)
def test_one_layer_saves_what_the_formula_counts(dtype, shape_args, tmp_path):
    family, heads, kv_heads, head_dim, hidden, intermediate, seq, batch = shape_args
    Config = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]

    def config(layers):
        return Config(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            num_hidden_layers=layers,
            vocab_size=97,
            max_position_embeddings=seq,
            attn_implementation="sdpa",
        )

    one_layer = saved_bytes(config(2), dtype, batch, seq) - saved_bytes(config(1), dtype, batch, seq)
    config(1).save_pretrained(tmp_path)
    # read from the config as tools/estimate_memory.py reads it
    shape = model_shape(str(tmp_path))
    assert (shape.q_width, shape.qk_norm) == (heads * head_dim, family == "qwen3")
    expected = saved_per_token(shape, dtype.itemsize) * seq * batch
    assert one_layer == pytest.approx(expected, rel=0.01), (one_layer, expected)


def test_model_shape_reads_the_mlp_and_the_key_value_width(tmp_path):
    LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=100,
    ).save_pretrained(tmp_path / "llama")
    shape = model_shape(str(tmp_path / "llama"))
    assert (shape.intermediate, shape.kv_width, shape.gated) == (176, 2 * 8, True)
    GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100).save_pretrained(tmp_path / "gpt2")
    gpt = model_shape(str(tmp_path / "gpt2"))
    assert gpt.gated is False
    est = estimate(gpt, Setup(nproc_per_node=1, micro_batch=2, seq_len=32))
    # said, since only the gated family is measured
    assert any("GPT formula" in note for note in est.notes)


def test_gradients_and_activations_are_not_counted_together():
    shape = ModelShape(
        params=int(1e9),
        hidden=2048,
        layers=16,
        vocab=32000,
        heads=16,
        largest_unit=int(6e7),
        intermediate=5632,
        kv_width=512,
        gated=True,
    )
    # gradients dominate, then activations
    for seq in (64, 8192):
        est = estimate(shape, Setup(strategy="FULL_SHARD", nproc_per_node=1, seq_len=seq))
        parts = est.params + est.optimizer + est.gathered_params + est.all_gather_working_set
        assert est.gpu_total == pytest.approx(parts + max(est.grads, est.activations))
        assert est.gpu_total < parts + est.grads + est.activations


def recorded_gpu_peaks():
    for results in sorted((REPO / "bench" / "results").glob("*/gpu-check-*/results.json")):
        for row in json.loads(results.read_text())["rows"]:
            if row.get("estimate_peak") and row.get("peak_allocated"):
                yield pytest.param(row, id=f"{results.parent.parent.name}/{results.parent.name}/{row['config']}")


@pytest.mark.parametrize("row", list(recorded_gpu_peaks()))
def test_estimate_within_10_percent_of_every_cuda_peak_on_record(row, tmp_path):
    """A GPU visit's measured peak (torch.cuda.max_memory_allocated of a full fine-tuning run of bench/gpu_check.py's
    ~1B Llama, or of its speed rows' Llama-3.2-1B shape at the batch they trained) against the estimate the current
    formulas give for that config and workload; a compiled or Liger row's peak at most 10% over it (the estimate
    counts eager activations: a bound there)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "bench"))
    # "speed: zero3, compiled + liger, batch auto"
    speed = row["config"].startswith("speed:")
    levers = row.get("levers", [lever for lever in ("compiled", "liger") if speed and lever in row["config"]])
    gpu_check.model_config(gpu_check.LLAMA_1B if speed else None).save_pretrained(tmp_path)
    config = gpu_check.SPEED_CONFIG if speed else row["config"]
    strategy = strategy_of(yaml.safe_load((REPO / config).read_text()))
    est = estimate(
        model_shape(str(tmp_path)),
        Setup(
            strategy=strategy.memory_strategy_on(gpu_check.PROCESSES),
            nproc_per_node=gpu_check.PROCESSES,
            offload=strategy.offload,
            micro_batch=row.get("batch") or gpu_check.BATCH,
            seq_len=gpu_check.SEQ,
            fused_loss="liger" in levers,
        ),
    )
    ratio = row["peak_allocated"] / est.gpu_total
    assert (0.9 if not levers else 0) <= ratio <= 1.1, (row["peak_allocated"] / 2**30, est.gpu_total / 2**30)
