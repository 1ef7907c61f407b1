"""A multi-rank FSDP2-layout checkpoint of a chosen size, without training: for benchmarks and memory tests.

Each of ``ranks`` gloo processes generates only its own dim-0 shard of every weight of a Llama-shaped model
and saves them as DTensors with torch.distributed.checkpoint, the way accelerate saves an FSDP2 model
(``pytorch_model_fsdp_0/`` holding ``{"model": state_dict}``). config.json, the tiny tokenizer and the
manifest are written beside it as a training run writes them, so the checkpoint merges on its own.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from fsdp_recipes.removal import make_folder, remove

# transformers is imported where it is used: each rank imports this module, and needs torch alone
if TYPE_CHECKING:
    from transformers import LlamaConfig

BENCH_CHECKPOINT = "benchmark checkpoint"
TINY = Path(__file__).resolve().parent.parent / "assets" / "tiny-llama"


def llama_config(target_bytes: int, hidden: int = 2048, vocab: int = 32000) -> LlamaConfig:
    """A Llama config whose fp32 weights take about ``target_bytes`` (at least one layer)."""
    from transformers import LlamaConfig

    intermediate = 4 * hidden
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((target_bytes / 4 - fixed) / per_layer))
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=max(1, hidden // 128),
        vocab_size=vocab,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )


def _shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _worker(rank: int, world: int, port: int, jobs: list[tuple[str, dict[str, tuple[int, ...]]]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    for out, shapes in jobs:
        state = {}
        for i, (name, shape) in enumerate(sorted(shapes.items())):
            rows = -(-shape[0] // world)
            local_rows = max(0, min(rows, shape[0] - rank * rows))
            gen = torch.Generator().manual_seed(i * 1000 + rank)
            local = torch.randn((local_rows, *shape[1:]), generator=gen)
            state[name] = DTensor.from_local(
                local,
                mesh,
                [Shard(0)],
                run_check=False,
                shape=torch.Size(shape),
                stride=torch.empty(shape, device="meta").stride(),
            )
        dcp.save({"model": state}, checkpoint_id=out)
        del state
    dist.destroy_process_group()


def make_checkpoints(
    sizes: dict[str | os.PathLike, int], ranks: int = 2, hidden: int = 2048, vocab: int = 32000
) -> list[Path]:
    """For each ``folder: target_bytes``, write ``folder/checkpoint-1/{pytorch_model_fsdp_0, config.json, tokenizer}``,
    all from one set of ``ranks`` processes (starting them is most of the time for small sizes); return the
    checkpoint folders."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    from fsdp_recipes.ckpt.description import describe_folder, write_manifest
    from fsdp_recipes.ckpt.shard_digests import write_shard_digests

    jobs = []
    for folder, target_bytes in sizes.items():
        ckpt = Path(folder) / "checkpoint-1"
        # only one this function wrote (its marker)
        remove(ckpt, BENCH_CHECKPOINT, missing_ok=True)
        make_folder(ckpt, BENCH_CHECKPOINT)
        (ckpt / "pytorch_model_fsdp_0").mkdir()
        jobs.append((ckpt, llama_config(target_bytes, hidden, vocab)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(
        _worker,
        args=(ranks, port, [(str(c / "pytorch_model_fsdp_0"), _shapes(config)) for c, config in jobs]),
        nprocs=ranks,
        join=True,
    )
    # config, generation config, tokenizer and manifest as the training run's DescribeCheckpoints writes them
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    for ckpt, config in jobs:
        files = describe_folder(ckpt, LlamaForCausalLM, config, tokenizer, GenerationConfig.from_model_config(config))
        write_manifest(ckpt, config, files)
        # as a training run does once every rank is done
        write_shard_digests(ckpt, ("pytorch_model_fsdp_0",))
    return [ckpt for ckpt, _ in jobs]


def make_checkpoint(
    folder: str | os.PathLike, target_bytes: int, ranks: int = 2, hidden: int = 2048, vocab: int = 32000
) -> Path:
    """Write ``folder/checkpoint-1/{pytorch_model_fsdp_0, config.json, tokenizer}``; return the checkpoint folder."""
    [ckpt] = make_checkpoints({folder: target_bytes}, ranks, hidden, vocab)
    return ckpt
