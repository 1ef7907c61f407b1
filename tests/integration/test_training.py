"""Every shipped config, launched for real: 2+ CPU processes, the tiny default model, real FSDP.

The feature runs on zero3.yaml (evaluation and profiling, chat SFT) train one after another in one launch with
other files' (tests/helpers/zero3_runs.py): a launch each would pay torch's start-up every time."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import FSDP_CONFIGS, REPO, logged_losses, read_json, shard_files_written
from helpers.zero3_runs import zero3_runs as shared_zero3_runs
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def zero3_runs(trained, tmp_path_factory):
    """``get(name)`` -> the folder of tests/helpers/zero3_runs.py's run ``name``, ended normally."""
    get = shared_zero3_runs(trained, tmp_path_factory)
    return lambda name: get(name)[0]


@pytest.mark.parametrize("config", FSDP_CONFIGS)
def test_really_fsdp_and_sharded(trained, config):
    run = trained(config)
    report = run.report
    assert report["distributed_type"] == "FSDP"
    assert report["fsdp_version"] == run.fsdp_version
    assert report["world_size"] == run.world_size == len(report["ranks"])
    total = report["total_param_elements"]
    # the whole tiny model, not an empty or partial count
    assert total > 200_000
    for rank in report["ranks"]:
        # eager
        assert rank["wrapper"] == f"FSDP{run.fsdp_version}" and rank["compiled_modules"] == 0
        # exact: every weight dimension of the tiny model divides evenly by 2
        assert rank["local_param_elements"] * run.shard_group == total, rank


def bf16_computes_as_fp32_here(config: str) -> bool:
    """The config asks for bf16 and this machine (a CPU without native bf16) computes it in fp32 unless --cpu_bf16
    true."""
    import yaml

    from fsdp_recipes.compat.cpu_fsdp import native_bf16, read_cpuinfo

    mixed = yaml.safe_load((REPO / config).read_text())["mixed_precision"]
    return mixed == "bf16" and not torch.cuda.is_available() and native_bf16(read_cpuinfo()) is False


def check_precision_and_wrapping(run, forced: bool) -> None:
    """fsdp_report.json names the wrapped layer class with its count, and the dtypes of master weights, compute,
    gradient reduction, optimizer state and saved model; each checked against what the run wrote or was given."""
    import yaml
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader

    mixed = yaml.safe_load((REPO / run.config).read_text())["mixed_precision"]
    layers = read_json(run.model_dir / "config.json")["num_hidden_layers"]
    units = run.report["wrapped_units"]
    # the wrap class, and the root
    assert units["LlamaDecoderLayer"] == layers and units["LlamaForCausalLM"] == 1
    # FSDP2 (accelerate's fsdp2_prepare_model) also makes the embeddings, the LM head and the final norm units
    assert set(units) - {"LlamaDecoderLayer", "LlamaForCausalLM"} == (
        {"Embedding", "Linear", "LlamaRMSNorm"} if run.fsdp_version == 2 else set()
    )
    precision = run.report["precision"]
    as_fp32 = bf16_computes_as_fp32_here(run.config) and not forced
    assert precision["compute"] == ("float32" if as_fp32 else {"bf16": "bfloat16", "no": "float32"}[mixed])
    assert precision.get("cpu_bf16", {}).get("forced", False) is forced
    with safe_open(run.model_dir / "model.safetensors", "pt") as f:
        saved = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert saved == {"F32"} and precision["saved_model"] == precision["master_weights"] == "float32"
    step = max(int(p.name.split("-")[1]) for p in run.output_dir.glob("checkpoint-*"))
    optimizer = FileSystemReader(str(run.output_dir / f"checkpoint-{step}" / "optimizer_0")).read_metadata()
    moments = {
        str(m.properties.dtype).removeprefix("torch.")
        for k, m in optimizer.state_dict_metadata.items()
        if "exp_avg" in k
    }
    assert moments == {precision["optimizer_state"]}


@pytest.mark.parametrize("config", FSDP_CONFIGS)
def test_precision_and_wrapping_contract(trained, config):
    """Each config's own run: on a CPU without native bf16 its bf16 computes in fp32
    (tests/unit/compat/test_cpu_precision.py),
    which the report says."""
    check_precision_and_wrapping(trained(config), forced=False)


@pytest.mark.parametrize("config", ["accelerate_configs/zero3.yaml", "accelerate_configs/fsdp1/zero3.yaml"])
def test_the_configs_bf16_computes_in_bf16_where_kept(trained, config):
    """The configs' bf16 tested as bf16 on a CPU without native bf16 (--cpu_bf16 true): one FSDP2 and one FSDP1
    config, the two ways accelerate applies mixed_precision (MixedPrecisionPolicy, MixedPrecision); the others
    compute it so on a GPU (tests/gpu/test_gpu.py) and in the test above on a CPU with native bf16."""
    if not bf16_computes_as_fp32_here(config):
        pytest.skip("this machine computes the config's bf16 in bf16 already: the test above checks it")
    check_precision_and_wrapping(trained(config, "--cpu_bf16", "true"), forced=True)


@pytest.mark.parametrize("config", FSDP_CONFIGS)
def test_loss_finite_and_falling(trained, config):
    losses = logged_losses(trained(config).output_dir)
    assert len(losses) == 6
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.85 * losses[0], losses


def test_fsdp1_hybrid_shard_on_one_machine_trains_as_one_job(trained):
    """FSDP1 HYBRID_SHARD on one machine is FULL_SHARD inside it: its ranks shard and reduce gradients together and
    log fsdp1/zero3.yaml's losses and gradient norms. Before cpu_fsdp made a CPU node's processes its devices, each
    process was a node of one (NO_SHARD, no gradient crossing processes): the losses parted from the third step and
    the gradient norm was half."""
    hybrid, full = (
        read_json(trained(c).output_dir / "trainer_state.json")["log_history"]
        for c in ("accelerate_configs/fsdp1/hybrid_shard.yaml", "accelerate_configs/fsdp1/zero3.yaml")
    )
    steps = [(h["loss"], h["grad_norm"], f["loss"], f["grad_norm"]) for h, f in zip(hybrid, full) if "loss" in h]
    assert len(steps) == 6
    for loss, norm, full_loss, full_norm in steps:
        assert loss == pytest.approx(full_loss, rel=1e-5) and norm == pytest.approx(full_norm, rel=1e-4)


@pytest.mark.parametrize("config", FSDP_CONFIGS)
def test_sharded_checkpoints_on_disk(trained, config):
    run = trained(config)
    for step in (6, 12):
        shards = run.output_dir / f"checkpoint-{step}" / "pytorch_model_fsdp_0"
        assert (shards / ".metadata").is_file()
        assert sorted(p.name for p in shards.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(run.world_size)]
        assert (run.output_dir / f"checkpoint-{step}" / "optimizer_0" / ".metadata").is_file()
    # written past the page cache (FSDP1's and FSDP2's, in the foreground or the background): rank 0's model and
    # optimizer shard files of checkpoints 6 and 12
    assert run.report["checkpoint_writes"]["shard_files"] == shard_files_written(4, run.output_dir)


@pytest.mark.parametrize("config", FSDP_CONFIGS)
def test_final_folder_loads_with_trained_weights(trained, config, tmp_path):
    from accelerate.utils import merge_fsdp_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = trained(config)
    out, final = run.output_dir, run.model_dir
    # the model alone in its folder: what from_pretrained and an upload need (no training_args.bin, no marker, no lock)
    assert sorted(p.name for p in final.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert read_json(final / "config.json")["architectures"] == ["LlamaForCausalLM"]
    # the model's own use_cache, not the Trainer's training setting (TrainingArguments.use_cache, false)
    assert (
        read_json(final / "config.json")["use_cache"]
        is read_json(out / "checkpoint-12" / "config.json")["use_cache"]
        is True
    )
    assert (
        not (out / ".final-sharded").exists()
        and not (out / ".export-tmp").exists()
        and not list(out.glob(".run.lock*"))
    )
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert len(tokenizer) == model.config.vocab_size

    # Reference: accelerate's own merger over the last training checkpoint (taken after the final step).
    merge_fsdp_weights(str(out / "checkpoint-12" / "pytorch_model_fsdp_0"), str(tmp_path), safe_serialization=True)
    reference = load_file(tmp_path / "model.safetensors")
    loaded = model.state_dict()
    assert set(loaded) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name
    initial = AutoModelForCausalLM.from_config(model.config)
    assert not torch.equal(initial.state_dict()["lm_head.weight"], loaded["lm_head.weight"])


def test_chat_sft_from_local_folder(zero3_runs):
    """Chat SFT over a pre-trained folder, with padding-free batches (whole conversations in one row, no padding;
    test_data.py proves no token attends across conversations): trains under FSDP2 and loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # over the session's trained zero3.yaml run
    out = zero3_runs("chat")
    assert read_json(out / "run_args.json")["data"]["packing"] == "padding_free"
    losses = logged_losses(out)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    assert "{% generation %}" in tokenizer.chat_template
    AutoModelForCausalLM.from_pretrained(out / "model")


@pytest.mark.slow
def test_evaluation_throughput_loss_plot_and_tensorboard(zero3_runs):
    """One 2-process FSDP2 run with a held-out 10% evaluated every 6 steps and at the end, reported to
    TensorBoard, steps 3-4 profiled: eval_loss and eval_perplexity equal on every rank, tokens per second at every
    logging step and the run's token count in the end metrics, loss.png a PNG that decodes, TensorBoard scalars
    written, a Chrome trace per rank holding FSDP's collectives and a summary of their share."""
    from matplotlib.image import imread
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # the sequence's first run
    out = zero3_runs("evaluation")
    # FSDP_DUMP_EVAL's folder
    dumps = out.parent / "eval"
    final = read_json(out / "eval_results.json")
    assert math.isclose(final["eval_perplexity"], math.exp(final["eval_loss"]), rel_tol=1e-9)
    for step in (6, 12):
        ranks = [read_json(dumps / f"rank{r}-step{step}.json") for r in (0, 1)]
        assert [(m["eval_loss"], m["eval_perplexity"]) for m in ranks] == [
            (ranks[0]["eval_loss"], ranks[0]["eval_perplexity"])
        ] * 2
    history = read_json(out / "trainer_state.json")["log_history"]
    # eval_steps, and the final evaluation
    assert [e["step"] for e in history if "eval_loss" in e] == [6, 12, 12]

    train_logs = [e for e in history if "loss" in e]
    assert len(train_logs) == 6
    for entry in train_logs:
        # no MFU on CPU
        assert entry["tokens_per_second"] > 0 and "mfu" not in entry
        assert math.isclose(entry["tokens_per_second"], 2 * entry["tokens_per_second_per_device"], rel_tol=1e-3)
    args, metrics = read_json(out / "run_args.json")["training"], read_json(out / "train_results.json")
    block_size = read_json(out / "run_args.json")["data"]["block_size"]
    assert (
        metrics["train_tokens"]
        == 12 * 2 * args["per_device_train_batch_size"] * args["gradient_accumulation_steps"] * block_size
    )
    assert metrics["train_tokens_per_second"] > 0

    png = out / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and imread(png).shape[0] > 100

    for rank in (0, 1):
        trace = read_json(out / "profile" / f"rank{rank}.trace.json")["traceEvents"]
        names = {e.get("name") for e in trace}
        assert {"gloo:all_gather", "gloo:all_reduce"} <= names and any(
            n.startswith("FSDP::all_gather") for n in names if n
        )
    summary = read_json(out / "profile" / "summary.json")
    assert summary["steps"] == [3, 4] and 0 < summary["all_gather_share"] <= summary["communication_share"] <= 1
    assert 0 <= summary["overlapped_share"] <= 1

    # the final evaluation, after training ended, opens a second event file
    scalars: dict[str, list] = {}
    for events in (out / "runs").rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events)).Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(e.step for e in accumulator.Scalars(tag))
    assert sorted(scalars["train/loss"]) == [2, 4, 6, 8, 10, 12] and sorted(scalars["eval/loss"]) == [6, 12, 12]
    assert len(scalars["train/tokens_per_second"]) == 6 and len(scalars["eval/perplexity"]) == 3


def test_gpt2_with_tied_embeddings(gpt2_run):
    """GPT-2 from a tiny config (2 GPT2Blocks, tied input and output embeddings), FSDP2 on 2 processes: each block
    is a unit, the tied tensor is sharded and saved once, and the final folder loads with the head still tied to
    the trained embedding."""
    from transformers import AutoModelForCausalLM

    out = gpt2_run.output_dir
    report = read_json(out / "fsdp_report.json")
    assert report["wrapped_units"]["GPT2Block"] == 2 and report["wrapped_units"]["GPT2LMHeadModel"] == 1
    assert sum(r["local_param_elements"] for r in report["ranks"]) == report["total_param_elements"]
    losses = logged_losses(out)
    assert losses[-1] < losses[0], losses
    saved = load_file(out / "model" / "model.safetensors")
    # tied: written once
    assert "lm_head.weight" not in saved and "transformer.wte.weight" in saved
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert torch.equal(model.transformer.wte.weight, saved["transformer.wte.weight"])
