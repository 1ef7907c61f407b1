"""The loss over a large vocabulary peaks at three fp32 tensors of tokens x vocabulary: what the estimate counts."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest

from fsdp_recipes.config.memory import LOGITS_PEAK_BYTES, ModelShape, Setup, activation_bytes

PRECISIONS = ["bf16", "fp32"]


def peak_bytes() -> int:
    """This process's resident high-water mark (getrusage's ru_maxrss cannot be reset)."""
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


# One forward and backward of a one-layer, 64-wide Llama with a large tied vocabulary, in this process: the growth of
# its peak resident memory over tokens x vocabulary is the loss's peak (the layer's own activations are 1% of it).
# Each fp32 [tokens, vocab] tensor is 64 MiB, far above glibc's mmap threshold: freed memory leaves the process, so
# the resident peak is the live peak. Writing 5 to clear_refs resets that peak to the present size (Linux).
def loss_peak(precision: str, vocab: int = 32768, tokens: int = 512) -> float:
    """Bytes per token and vocabulary entry that one step's loss adds to the resident peak."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4}
    config = LlamaConfig(
        **shape, num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=tokens
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (1, tokens))

    def step(n):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(input_ids=ids[:, :n], labels=ids[:, :n]).loss
        loss.backward()

    # the weights' gradients exist before the peak is read, as from a run's second step
    step(16)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = peak_bytes()
    step(tokens)
    return (peak_bytes() - before) / (tokens * vocab)


@pytest.fixture(scope="module")
def measured() -> dict[str, float]:
    """Each precision's peak with one OpenMP thread, as a launched rank computes (OMP_NUM_THREADS=1): more threads
    hold scratch buffers of their own (16 of them measured 13.1 for fp32)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        found = {precision: loss_peak(precision) for precision in PRECISIONS}
    finally:
        torch.set_num_threads(threads)
    gc.collect()
    return found


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_loss_peaks_at_three_fp32_tensors_of_the_vocabulary(measured, precision):
    assert LOGITS_PEAK_BYTES - 1 <= measured[precision] <= LOGITS_PEAK_BYTES + 0.5, measured


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("batch, seq", [(1, 128), (4, 1024), (21, 1024)])
def test_the_estimate_counts_that_peak_per_token_and_vocabulary_entry(batch, seq, precision):
    def activations(vocab):
        shape = ModelShape(params=10**9, hidden=2048, layers=16, vocab=vocab, heads=32, largest_unit=10**8)
        return activation_bytes(shape, Setup(micro_batch=batch, seq_len=seq, precision=precision))[0]

    assert activations(128_256) - activations(1_000) == LOGITS_PEAK_BYTES * batch * seq * 127_256
