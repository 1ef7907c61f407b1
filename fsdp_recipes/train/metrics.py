"""What a run reports besides its loss: tokens per second, model FLOPs utilisation, perplexity, loss.png.

Throughput is measured between logging steps on training time only (evaluation and checkpoint writing are
left out), from the tokens each rank fed the model, summed over ranks with one all-reduce per logging step.
MFU (GPUs only) is counted as torchtitan counts it (torchtitan/models/utils.py, get_dense_model_nparams_and_flops):
6 x the parameters the matmuls use per token (every parameter but the embedding lookups: the LM head in, a head tied
to the input embeddings once) for the forward and backward matmuls, plus 12 x layers x heads x head dim x sequence
length for attention, against the device's dense bf16 peak (the table below, or --peak_tflops).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from pathlib import Path

# Dense bf16 tensor-core peaks (TFLOPS) from the vendors' datasheets; the first name found in the device's
# name wins, so the more specific names come first.
PEAK_BF16_TFLOPS = {
    "H100 NVL": 835,
    "H100 PCIe": 756,
    "H100": 989,
    "H200": 989,
    "H800": 989,
    "H20": 148,
    "A100": 312,
    "A800": 312,
    "L40S": 362,
    "L4": 121,
    "A10": 125,
    "B200": 2250,
    "GB200": 2500,
    "MI300X": 1307,
    "MI325X": 1307,
}
LOSS_PLOT = "loss.png"


def peak_tflops(device_name: str) -> float | None:
    for name, tflops in PEAK_BF16_TFLOPS.items():
        if name.lower() in device_name.lower():
            return float(tflops)
    return None


def device_peak_flops(tflops: float | None, warn) -> float | None:
    """The accelerator's dense bf16 peak in FLOPS for MFU: --peak_tflops, else the table; None on CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    if tflops is None and (tflops := peak_tflops(name)) is None:
        warn(f"MFU is not reported: {name!r} is not in fsdp_recipes/train/metrics.py's table; pass --peak_tflops")
        return None
    return tflops * 1e12


def flops_per_token(model, seq_len: int) -> float:
    """6N + 12 L H d T, as torchtitan counts it: N the parameters outside the embedding lookups (nn.Embedding: the
    token embeddings, GPT-2's positions), so the LM head is in (a quarter of Llama-3.2-1B) and a head tied to the
    token embeddings is counted once, as the one matmul it is; L layers, H attention heads of d dimensions (Qwen3's
    d is not hidden / H), T the sequence length: attention's scores and values, causal masking not discounted."""
    from torch import nn

    config = getattr(model.config, "text_config", None) or model.config
    head = model.get_output_embeddings()
    head_params = {id(p) for p in head.parameters()} if head is not None else set()
    lookups = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()} - head_params
    # parameters(): a tied one once
    matmul = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 6 * matmul + 12 * config.num_hidden_layers * heads * head_dim * seq_len


def perplexity(loss: float) -> float:
    # exp overflows a float past ~709
    return math.exp(loss) if loss < 700 else math.inf


class Throughput:
    """Tokens and training seconds since the last logging step, and since the start."""

    def __init__(self, flops_per_token: float | None = None, peak: float | None = None):
        # peak in FLOPS; None: no MFU (CPU, unknown GPU)
        self.flops_per_token, self.peak = flops_per_token, peak
        # this rank's, since the last logging step
        self.tokens = 0
        # of evaluation and saving since the last logging step
        self.excluded_seconds = 0.0
        self.started: float | None = None
        self.total_tokens = self.total_seconds = 0

    def count(self, inputs: dict) -> None:
        if self.started is None:
            self.started = time.perf_counter()
        ids = inputs.get("input_ids")
        self.tokens += ids.numel() if ids is not None else 0

    @contextmanager
    def excluded(self):
        """Time spent inside (evaluation, checkpoint writing) is not training time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.excluded_seconds += time.perf_counter() - start

    def window(self, reduce_sum, world_size: int) -> dict:
        """Metrics of the window that ends now; ``reduce_sum`` sums an int over ranks (a collective: every rank
        calls)."""
        now = time.perf_counter()
        tokens = reduce_sum(self.tokens)
        seconds = max(now - (self.started or now) - self.excluded_seconds, 1e-9)
        self.total_tokens += tokens
        self.total_seconds += seconds
        self.tokens, self.excluded_seconds, self.started = 0, 0.0, now
        return self._metrics(tokens, seconds, world_size)

    def averages(self, world_size: int) -> dict:
        if not self.total_seconds:
            return {}
        return {"tokens": self.total_tokens, **self._metrics(self.total_tokens, self.total_seconds, world_size)}

    def _metrics(self, tokens: int, seconds: float, world_size: int) -> dict:
        per_device = tokens / seconds / world_size
        metrics = {
            "tokens_per_second": round(tokens / seconds, 1),
            "tokens_per_second_per_device": round(per_device, 1),
        }
        if self.peak and self.flops_per_token:
            metrics["mfu"] = round(per_device * self.flops_per_token / self.peak, 4)
        return metrics


def plot_losses(log_history: list[dict], path: Path) -> Path | None:
    """Training loss (and evaluation loss where evaluated) against step, as a PNG; None without any loss logged."""
    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e and "step" in e]
    evaluation = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e and "step" in e]
    if not train and not evaluation:
        return None
    import matplotlib

    # no display on a cluster node
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for points, label, style in ((train, "training loss", "-"), (evaluation, "evaluation loss", "o-")):
        if points:
            ax.plot(*zip(*points), style, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
