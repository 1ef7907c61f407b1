"""Checkpoints as other tools write them, from real 2-process FSDP2 runs on CPU (gloo), for the converter tests.

    python tests/helpers/foreign_checkpoints.py OUT

Each OUT/<case>/ holds the checkpoint the tool writes (its own names and layout, nothing of ours) and
OUT/<case>.truth.safetensors the model's true weights, gathered by torch from the live model, under the names
save_pretrained uses. A tiny Llama from assets/tiny-llama, one real AdamW step (so optimizer state exists).

  raw_dcp          dcp.save(model.state_dict())                         flat names, no prefix
  get_state_dict   dcp.save({"model": ..., "optim": ...}) from torch.distributed.checkpoint.state_dict
  bf16             dcp.save of a model held in bfloat16
  peft_lora        peft LoRA (r=4, alpha=8, q/v) under fully_shard, saved as accelerate does ({"model": ...});
                   adapter_config.json beside; the truth is peft's own merge_and_unload()
  lightning        Lightning Trainer, ModelParallelStrategy (FSDP2), trainer.save_checkpoint (a DCP folder), on the
                   same two processes, started as torchrun would have
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "assets" / "tiny-llama"


def tiny_model(dtype=torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY), dtype=dtype)


def shard(model, layers):
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def one_step(model):
    batch = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    return optimizer


def full_weights(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_truth(out: Path, case: str, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / f"{case}.truth.safetensors"))


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    warnings.filterwarnings("ignore")
    out = Path(out)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = tiny_model()
    shard(model, model.model.layers)
    optimizer = one_step(model)
    dcp.save(model.state_dict(), checkpoint_id=str(out / "raw_dcp"))
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out / "get_state_dict"))
    save_truth(out, "raw_dcp", full_weights(model))
    save_truth(out, "get_state_dict", full_weights(model))

    model = tiny_model(torch.bfloat16)
    shard(model, model.model.layers)
    dcp.save(model.state_dict(), checkpoint_id=str(out / "bf16"))
    save_truth(out, "bf16", full_weights(model))

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    model = get_peft_model(tiny_model(), config)
    shard(model, model.base_model.model.model.layers)
    one_step(model)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(out / "peft_lora"))
    full = full_weights(model)
    if rank == 0:
        model.peft_config["default"].save_pretrained(str(out / "peft_lora"))
        reference = get_peft_model(tiny_model(), config)
        reference.load_state_dict(full)
        save_truth(out, "peft_lora", reference.merge_and_unload().state_dict())
        reference = get_peft_model(tiny_model(), config)
        reference.load_state_dict(full)
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        save_file(
            {k: v.contiguous() for k, v in get_peft_model_state_dict(reference).items()},
            str(out / "peft_lora.adapter.safetensors"),
        )
    lightning(rank, world, port, out)
    # Everything is written. Leave without the interpreter's teardown, where gloo's threads now and then abort the
    # process ("terminate called without an active exception", SIGABRT) after the work is done.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def lightning(rank: int, world: int, port: int, out: Path) -> None:
    """Lightning's Trainer on these ranks, as torchrun would have started them (its TorchElastic environment): it
    starts no processes of its own and takes the process group as it is (each process pays its imports once)."""
    os.environ.update(
        TORCHELASTIC_RUN_ID="foreign-checkpoints",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_PORT=str(port),
    )
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    class LitLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_model()

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, i):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    tokens = torch.randint(0, 400, (8, 16), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(tokens, batch_size=2)
    strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=str(out / "lightning-root"),
    )
    module = LitLM()
    trainer.fit(module, data)
    trainer.save_checkpoint(str(out / "lightning"))
    full = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    save_truth(out, "lightning", full)
    trainer.strategy.barrier()


def main(out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, str(Path(out).resolve())), nprocs=2, join=True)


if __name__ == "__main__":
    main(sys.argv[1])
