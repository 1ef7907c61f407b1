"""A LoRA run's final export, written in parallel (fsdp_recipes/train/export_parts.py): each rank merges the adapter
into the base weights of its own shards, and the parts written together are peft's merge_and_unload, for any number of
ranks, tied or untied, fp32 or bf16; the run's export record counts every rank that wrote as a writer. (The same
under real launches: tests/integration/test_lora.py.)"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@cache
def lora_checkpoint(root: Path, tied: bool, dtype: str) -> tuple[Path, object, dict[str, torch.Tensor]]:
    """A tiny Llama with a random LoRA adapter, saved as the final export saves it before the merge (the whole peft
    model's state dict as DCP, the description beside it): (that folder, the base config, peft's merge_and_unload)."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_recipes.train.export import save_model_description

    folder = root / f"shards-{'tied' if tied else 'untied'}-{dtype}"
    config = AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama", tie_word_embeddings=tied)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            # peft starts lora_B at zero: a merge of that would change nothing
            if "lora_" in name:
                param.copy_(torch.randn_like(param, dtype=torch.float32) * 0.1)
                # the adapter trains in fp32 over a bf16 base, as under FSDP
                param.data = param.data.float()
    dcp.save({"model": model.state_dict()}, checkpoint_id=folder / "pytorch_model_fsdp_0", no_dist=True)
    save_model_description(model, None, folder)
    merged = {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}
    return folder, config, merged


def write_parts(shards: Path, staging: Path, config, world: int, max_shard_size: int) -> list[tuple]:
    """Every rank's part, one after the other (each given only the shards folder, as on its own machine)."""
    from fsdp_recipes.ckpt.layout import EXPORT_STAGING
    from fsdp_recipes.ckpt.lora_input import lora_merge_input
    from fsdp_recipes.removal import make_folder
    from fsdp_recipes.train.export_parts import write_part

    make_folder(staging, EXPORT_STAGING)
    return [
        write_part(
            lambda: lora_merge_input(shards, log=lambda line: None).source,
            staging,
            config,
            (rank, world),
            None,
            max_shard_size,
        )
        for rank in range(world)
    ]


def shard_size(merged: dict[str, torch.Tensor], shards: int) -> int:
    return sum(t.numel() * t.element_size() for t in merged.values()) // shards


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_parts_of_every_rank_together_are_peft_s_merge(tmp_path_factory, world, tied, dtype):
    shards, config, by_peft = lora_checkpoint(tmp_path_factory.getbasetemp(), tied, dtype)
    staging = tmp_path_factory.mktemp("parts") / ".export-tmp"
    results = write_parts(shards, staging, config, world, shard_size(by_peft, 6))
    every = results[0][2]
    # every rank plans the same folder
    assert all(result[2] == every for result in results)
    written = [name for _, files, _ in results for name in files]
    # each file once, by one rank
    assert sorted(written) == sorted(every)
    # six shards: every rank writes some
    assert all(files for _, files, _ in results)
    got = {}
    for name in every:
        if name.endswith(".safetensors"):
            got.update(load_file(staging / name))
    index = json.loads((staging / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)
    # a tied head: written once
    assert set(got) == set(by_peft) - ({"lm_head.weight"} if tied else set())
    for name, tensor in by_peft.items():
        if name in got:
            assert got[name].dtype == getattr(torch, dtype) and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_lora_export_records_every_rank_that_wrote_as_a_writer(tmp_path_factory, tmp_path, world):
    from transformers import AutoModelForCausalLM

    from fsdp_recipes.ckpt.description import describe_folder
    from fsdp_recipes.train.export_parts import publish_parts

    shards, config, by_peft = lora_checkpoint(tmp_path_factory.getbasetemp(), False, "float32")
    out, staging = tmp_path / "run", tmp_path / "run" / ".export-tmp"
    out.mkdir()
    (out / "fsdp_report.json").write_text(json.dumps({"world_size": world}))
    results = write_parts(shards, staging, config, world, shard_size(by_peft, world))
    model_cls, weight_names = results[0][0], results[0][2]
    record = publish_parts(
        staging,
        out,
        world,
        weight_names,
        lambda folder: describe_folder(folder, model_cls, config, None, None, "float32"),
        "float32",
        0.0,
    )
    shards_written = sum(n.endswith(".safetensors") for n in weight_names)
    assert shards_written >= world
    report = json.loads((out / "fsdp_report.json").read_text())
    assert report["export"] == record and record["writers"] == world and record["shards"] == shards_written
    assert sorted(record["ranks"]) == [str(r) for r in range(world)]
    loaded = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    assert set(loaded) == set(by_peft) and all(torch.equal(loaded[k], by_peft[k]) for k in by_peft)


@pytest.mark.parametrize("failed_rank", [None, 0, 1])
def test_the_adapter_is_published_only_with_the_model_it_goes_with(tmp_path_factory, tmp_path, failed_rank):
    """A LoRA export's adapter is staged while the ranks write; a rank whose part failed stops the export with
    neither folder replaced (an earlier run's model/ and adapter/ stay a pair); otherwise both are published."""
    from fsdp_recipes.ckpt.description import describe_folder
    from fsdp_recipes.errors import CheckpointError
    from fsdp_recipes.train.export_parts import publish_parts, write_part
    from fsdp_recipes.train.model_folder import stage_adapter_folder

    shards, config, by_peft = lora_checkpoint(tmp_path_factory.getbasetemp(), False, "float32")
    out, staging = tmp_path / "run", tmp_path / "run" / ".export-tmp"
    out.mkdir()
    (out / "fsdp_report.json").write_text(json.dumps({"world_size": 2}))
    results = write_parts(shards, staging, config, 2, shard_size(by_peft, 2))
    # that rank's part again, its source failing: it leaves .part-K.failed
    if failed_rank is not None:
        for leftover in staging.glob(f".part-{failed_rank}*"):
            leftover.unlink()

        def full_disk():
            raise OSError(28, "No space left on device")

        with pytest.raises(OSError):
            write_part(full_disk, staging, config, (failed_rank, 2), None)
    adapter = stage_adapter_folder(shards, out, log=lambda line: None)
    model_cls, weight_names = results[0][0], results[0][2]

    def publish():
        describe = lambda folder: describe_folder(folder, model_cls, config, None, None, "float32")  # noqa: E731
        return publish_parts(staging, out, 2, weight_names, describe, "float32", 0.0, adapter)

    if failed_rank is not None:
        with pytest.raises(CheckpointError, match="nothing was published"):
            publish()
        assert not (out / "model").exists() and not (out / "adapter").exists() and adapter.is_dir()
    else:
        publish()
        assert (out / "model" / "config.json").is_file() and (out / "adapter" / "adapter_config.json").is_file()
        assert not adapter.exists()
