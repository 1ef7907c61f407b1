"""The final export (fsdp_recipes/train/export_parts.py): every rank writes its part of the model folder, no
rank waits on a collective bounded by --ddp_timeout while the others write, and --save_dtype sets the weights' dtype.
(The same under real launches: tests/integration/test_final_export.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import header_dtypes

from fsdp_recipes.ckpt.readers import TensorInfo
from fsdp_recipes.ckpt.safetensors_writer import weight_files, write_weights
from fsdp_recipes.errors import CheckpointError
from fsdp_recipes.train.export_parts import part_shard_size, wait_for_parts


class MemorySource:
    """A checkpoint source held in memory (no copy_plan: every tensor goes through read)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.data = tensors
        self.tensors = {n: TensorInfo(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()}

    def read(self, names):
        return {n: self.data[n].clone() for n in names}


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_parts_written_apart_make_the_folder_one_writer_makes(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    source = MemorySource({f"layer.{i}.weight": torch.randn(64 + i, 32, generator=gen) for i in range(7)})
    names = sorted(source.tensors)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    whole.mkdir(), parts.mkdir()
    # about two tensors a shard: four shards for three parts
    size = 20_000 if dtype is None else 10_000
    assert write_weights(source, names, whole, max_shard_size=size, dtype=dtype) == weight_files(
        source, names, size, dtype
    )
    written = [write_weights(source, names, parts, max_shard_size=size, dtype=dtype, part=(k, 3)) for k in range(3)]
    # each rank some, none twice
    assert all(written) and sorted(sum(written, [])) == sorted(p.name for p in whole.iterdir())
    assert "model.safetensors.index.json" in written[0]
    for p in whole.iterdir():
        assert (parts / p.name).read_bytes() == p.read_bytes(), p.name
        if p.suffix == ".safetensors":
            assert header_dtypes(p) == {"BF16" if dtype else "F32"}


def test_shard_size_gives_every_rank_a_share_of_a_large_model():
    # 1.25 GiB each
    assert part_shard_size(10 << 30, 8) == -(-(10 << 30) // 8)
    # save_pretrained's largest shard
    assert part_shard_size(280 * 10**9, 8) == 5 * 10**9
    # a small model: one shard, one writer
    assert part_shard_size(1 << 20, 2) == 64 << 20


def test_a_failed_rank_is_named_and_nothing_is_published(tmp_path):
    (tmp_path / ".part-0.done").write_text('{"files": ["model-00001-of-00002.safetensors"], "seconds": 1}\n')
    (tmp_path / ".part-1.failed").write_text("OSError: [Errno 28] No space left on device\n")
    with pytest.raises(
        CheckpointError, match=r"rank 1 failed writing its part of the final model \(OSError: \[Errno 28\]"
    ):
        wait_for_parts(tmp_path, 2)


def test_a_rank_whose_heartbeat_stops_is_given_up_on(tmp_path, monkeypatch):
    import fsdp_recipes.train.export_parts as export

    monkeypatch.setattr(export, "PART_POLL_SECONDS", 0.05)
    monkeypatch.setattr(export, "PART_STALE_SECONDS", 0.3)
    (tmp_path / ".part-0.done").write_text('{"files": [], "seconds": 1}\n')
    # written once, then never again
    (tmp_path / ".part-1.alive").write_text("7\n")
    with pytest.raises(
        CheckpointError, match=r"rank 1 has shown no sign of life for 0 s .*\.part-1\.alive stopped changing"
    ):
        wait_for_parts(tmp_path, 2)


def test_a_bad_save_dtype_is_one_line(tmp_path):
    """Refused by RunArguments before anything starts; train_fsdp.py prints the message as its one line."""
    from fsdp_recipes.config.parse import parse_args
    from fsdp_recipes.errors import RecipeError

    for args in (["--save_dtype", "bf16"], [str(tmp_path / "recipe.yaml")]):
        (tmp_path / "recipe.yaml").write_text("save_dtype: bf16\n")
        with pytest.raises(RecipeError) as err:
            parse_args([*args, "--output_dir", str(tmp_path / "out"), "--allow_no_fsdp", "true"])
        assert (
            str(err.value).endswith("save_dtype='bf16' is not one of auto, float32, bfloat16, float16")
            or str(err.value) == "recipe key save_dtype: 'bf16' is not one of auto, float32, bfloat16, float16"
        )
        assert "\n" not in str(err.value)
