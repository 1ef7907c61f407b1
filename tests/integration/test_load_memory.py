"""Rank-0-only loading (fsdp_cpu_ram_efficient_loading, every shipped config): a non-zero rank holds no more
than its shard in private CPU RAM while loading and preparing (FSDP2: rank 0 scatters; FSDP1: rank 0 scatters each
unit's flat parameter, kept as received; fsdp_recipes/compat/rank0_loading.py), the weights every rank ends up with
are the file's, bit for bit, tied weights still tied, and a non-finite one rank 0 reads stops every rank."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import REPO, launch, rewrite_weights
from helpers.launch_sequence import launch_sequence
from safetensors.torch import load_file

sys.path.insert(0, str(REPO))
from bench.load_memory import build_model, measure  # noqa: E402

pytestmark = pytest.mark.slow


def test_non_zero_rank_does_not_hold_the_full_model_and_rank_0_one_copy(tmp_path):
    """LoRA, zero3.yaml, 2 ranks, a bf16 model with tied embeddings loaded as fp32 (the default dtype): rank 1's
    peak private memory (RssAnon) during loading + prepare grows by about its fp32 shard (0.5x the fp32 model)
    over the same run of the tiny model; accelerate's whole-parameter broadcast made it 0.81x (a 1 GB model,
    bench/results). 0.6: the shard plus allocator and polling noise (measured 0.52x). Rank 0 converts the file to
    fp32 in private memory (one full copy, 1x) and lets go of each full weight once scattered, so it holds at most
    the copy and the shard of the weight just scattered: here the tied embedding, half the model (1.25x); 1.4
    leaves room for noise. Holding the copy and every shard at once is 1.5x, 1.75x with the tied weight scattered
    twice."""
    big, tiny = tmp_path / "big", tmp_path / "tiny"
    fp32_bytes = 2 * build_model(big, 200_000_000, "bfloat16", tied=True, hidden=512)
    build_model(tiny, None, "bfloat16", tied=True)
    base = measure(tiny, 2, True, tmp_path, 0.02)
    peak = measure(big, 2, True, tmp_path, 0.02)
    growth = {rank: (peak[rank]["RssAnon"] - base[rank]["RssAnon"]) / fp32_bytes for rank in (0, 1)}
    assert growth[1] <= 0.6, (
        f"rank 1's peak RssAnon grew by {growth[1]:.2f}x the fp32 model's {fp32_bytes / 2**20:.0f} MiB"
    )
    assert growth[0] <= 1.4, (
        f"rank 0's peak RssAnon grew by {growth[0]:.2f}x the fp32 model's {fp32_bytes / 2**20:.0f} MiB"
    )


def test_fsdp1_non_zero_rank_holds_only_its_shard(tmp_path, monkeypatch):
    """LoRA, fsdp1/zero3.yaml, 2 ranks, a 200 MB fp32 model whose root unit (untied embedding and LM head) is about
    two thirds of it: rank 0 scatters each unit's flat parameter and rank 1 receives its chunk into the buffer FSDP
    keeps as its shard, so rank 1 holds its shard (0.5x) and nothing more; 0.1 of room for polling and allocator
    noise. Receiving the chunk and then letting FSDP clone it into the shard held, for a moment, a second copy of
    the root unit's chunk (0.5 + 0.33); torch's own sync broadcast each unit whole into rank 1's weights and then
    flattened it (a second whole copy): shard plus twice the root unit, about 1.8x here.

    glibc's malloc is given a fixed mmap threshold here: by default it serves tensors under 32 MB from its heap once
    a larger block was freed, and keeps what is freed there resident for reuse (the freed units then count as held).
    The benchmark's 1 GB model, whose tensors are mapped one by one, is measured with the default allocator."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    big, tiny = tmp_path / "big", tmp_path / "tiny"
    model_bytes = build_model(big, 200_000_000, "float32", tied=False, hidden=512)
    root = sum(n for name, n in stored_bytes(big).items() if not name.startswith("model.layers."))
    build_model(tiny, None, "float32", tied=False)
    config = REPO / "accelerate_configs" / "fsdp1" / "zero3.yaml"
    base = measure(tiny, 2, True, tmp_path, 0.02, config)
    peak = measure(big, 2, True, tmp_path, 0.02, config)
    growth = (peak[1]["RssAnon"] - base[1]["RssAnon"]) / model_bytes
    bound = 0.5 + 0.1
    assert root / model_bytes / 2 > 0.2, "the test needs a root unit whose chunk the bound would not hide"
    assert growth <= bound, (
        f"rank 1's peak RssAnon grew by {growth:.2f}x the model's {model_bytes / 2**20:.0f} MiB (bound {bound:.2f})"
    )


def stored_bytes(folder) -> dict[str, int]:
    return {name: t.numel() * t.element_size() for name, t in load_file(folder / "model.safetensors").items()}


# the final model: the loaded weights
LR0 = ["--learning_rate", "0", "--max_steps", "2", "--save_steps", "2"]
# a tied bf16 folder, trained 3 steps
TRAINED = ["--dtype", "float32", "--max_steps", "3", "--save_steps", "3"]


@pytest.fixture(scope="module")
def loaded(trained, tmp_path_factory):
    """``loaded(config, name)`` -> (model folder, output_dir): a float32 untied folder loaded at learning rate 0
    ("lr0") and a tied bf16 folder trained as float32 ("trained"), both with the config's rank-0-only loading, in
    one launch per config (tests/helpers/launch_sequence.py); on fsdp1/zero3.yaml also the chat recipe at learning
    rate 0 over the folder the session's zero3.yaml run wrote ("written")."""
    root = tmp_path_factory.mktemp("loaded")
    untied, tied = root / "untied", root / "tied"
    build_model(untied, None, "float32", tied=False)
    build_model(tied, None, "bfloat16", tied=True)
    folders = {"lr0": untied, "trained": tied}
    runs = {"lr0": LR0, "trained": TRAINED, "written": ["recipes/tiny-llama/chat_sft.yaml", *LR0]}
    sequences = {}

    def get(config: str, name: str):
        slug = config.replace("/", "-").removesuffix(".yaml")
        if config not in sequences:
            names = ("lr0", "trained", "written") if config == "fsdp1/zero3.yaml" else ("lr0", "trained")
            if "written" in names:
                folders["written"] = trained("accelerate_configs/zero3.yaml").model_dir
            commands = {
                each: [*runs[each], "--model_name_or_path", str(folders[each]), "--output_dir", str(root / slug / each)]
                for each in names
            }
            sequences[config] = launch_sequence(root / slug / "launch", f"accelerate_configs/{config}", commands)
        sequences[config](name)
        return folders[name], root / slug / name

    return get


@pytest.mark.parametrize(
    "config, tied",
    [
        ("zero3.yaml", False),
        ("fsdp1/zero3.yaml", False),
        # FSDP1 keeps the whole flat parameter: broadcast whole, not scattered
        ("fsdp1/no_shard.yaml", False),
        # two sync groups, across nodes then within: broadcast, then scattered
        ("fsdp1/hybrid_shard.yaml", False),
    ],
    ids=["fsdp2-untied", "fsdp1-untied", "fsdp1-no_shard", "fsdp1-hybrid"],
)
def test_rank0_only_loading_gives_every_rank_the_files_weights(loaded, tmp_path, tied, config):
    """Learning rate 0 under FSDP2 and FSDP1 configs: the final model, gathered from every rank's shard, equals the
    folder's weights bit for bit. A tied model under zero3.yaml and fsdp1/zero3.yaml is the next test's: trained,
    it equals the run where every rank loads the folder, its LM head still tied (one tensor saved, embed_tokens).
    zero3.yaml's and fsdp1/zero3.yaml's runs share a launch with the next test's (``loaded``)."""
    if config in ("zero3.yaml", "fsdp1/zero3.yaml"):
        # the shared run's folder is untied
        assert not tied
        folder, out = loaded(config, "lr0")
    else:
        folder, out = tmp_path / "model", tmp_path / "out"
        build_model(folder, None, "float32", tied=tied)
        launch(f"accelerate_configs/{config}", "--model_name_or_path", str(folder), *LR0, "--output_dir", str(out))
    before, after = load_file(folder / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert set(before) == set(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert ("lm_head.weight" not in after) == tied


@pytest.mark.parametrize("config", ["zero3.yaml", "fsdp1/zero3.yaml"], ids=["fsdp2", "fsdp1"])
def test_rank0_only_loading_trains_like_every_rank_loading(loaded, tmp_path, config):
    """A tied bf16 model folder loaded as float32, trained 3 steps at the recipe's learning rate: with
    fsdp_cpu_ram_efficient_loading (the other ranks build on meta and receive rank 0's buffers, e.g. the rotary
    frequencies) the final weights equal those of the same run with every rank loading the folder, bit for bit.
    A rank with wrong buffers or an untied LM head would compute other gradients."""
    text = (REPO / "accelerate_configs" / config).read_text()
    # the shared run (``loaded``) is the efficient one
    assert "fsdp_cpu_ram_efficient_loading: true" in text
    folder, efficient = loaded(config, "trained")
    copy, every_rank = tmp_path / "every-rank.yaml", tmp_path / "out-every-rank"
    copy.write_text(text.replace("fsdp_cpu_ram_efficient_loading: true", "fsdp_cpu_ram_efficient_loading: false"))
    launch(str(copy), "--model_name_or_path", str(folder), *TRAINED, "--output_dir", str(every_rank))
    on, off = (
        load_file(efficient / "model" / "model.safetensors"),
        load_file(every_rank / "model" / "model.safetensors"),
    )
    assert set(on) == set(off) and "lm_head.weight" not in on
    changed = [n for n in on if not torch.equal(on[n], load_file(folder / "model.safetensors")[n].float())]
    assert changed, "training changed no weight: the comparison would prove nothing"
    for name in on:
        assert torch.equal(on[name], off[name]), name


def test_a_folder_train_fsdp_wrote_loads_on_every_rank(loaded):
    """model_name_or_path = a folder train_fsdp.py wrote, fine-tuned with the chat recipe on fsdp1/zero3.yaml. With
    learning rate 0 the final weights must equal the folder's: a rank that got uninitialised or unsynced weights
    (cpu_ram_efficient_loading) would change them."""
    base, out = loaded("fsdp1/zero3.yaml", "written")
    before, after = load_file(base / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert set(before) == set(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_rank0_only_loading_of_a_non_finite_weight_stops_every_rank_in_one_line(tmp_path):
    """Only rank 0 reads the files, so only it can see a NaN in them: its verdict reaches every rank (rank 1 would
    otherwise wait for weights that never come), and the launch ends before the first step in one line naming the
    tensor, no checkpoint or model written."""
    folder, out = tmp_path / "model", tmp_path / "out"
    build_model(folder, None, "float32", tied=False)
    rewrite_weights(folder, lambda t: t["model.layers.2.self_attn.v_proj.weight"].view(-1)[7].fill_(float("nan")))
    proc = launch(
        "accelerate_configs/zero3.yaml",
        "--model_name_or_path",
        str(folder),
        "--max_steps",
        "2",
        "--output_dir",
        str(out),
        check=False,
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("train_fsdp.py: error:")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    assert "1 non-finite value(s) (NaN or Inf) in model.layers.2.self_attn.v_proj.weight" in lines[0], lines[0]
    assert not list(out.glob("checkpoint-*")) and not (out / "model").exists()
