"""LoRA (peft) under FSDP2 and FSDP1: only the adapter trains, sharded like the rest; checkpoints hold the adapter
alone (weights and optimizer state, every rank's slice); a run resumed from its mid-run checkpoint ends on the same
bits; the run ends with the merged model (equal to peft's own merge_and_unload of the trained adapter) and the adapter
folder PeftModel loads; the merge tool makes both from a checkpoint and the base.

The runs that end normally on one accelerate config train one after another in one launch (lora_runs), a resume
after the run it resumes, and so do the refused ones (refused): a launch each would pay torch's start-up every time.
The runs on launch flags of their own launch alone."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    LORA_RECIPE,
    QUICK,
    REPO,
    launch,
    logged_losses,
    lora_recipe_copy,
    quick,
    read_json,
    rewrite_weights,
    run,
    same_tensors,
    shared_temp,
)
from helpers.launch_sequence import FAULT_SEQUENCE, SequencedRun, launch_sequence, run_and_resume
from safetensors.torch import load_file

from fsdp_recipes.ckpt import base_identity
from fsdp_recipes.ckpt.dcp_pickles import read_layout
from fsdp_recipes.ckpt.readers import DCPSource

LORA = ["--use_peft", "true", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.0", "--learning_rate", "1e-2"]
CONFIGS = ["accelerate_configs/zero3.yaml", "accelerate_configs/fsdp1/zero3.yaml"]
TINY = str(REPO / "assets" / "tiny-llama")

# metric loss with greater_is_better true: the worst evaluation is the "best", so the best checkpoint is not the last
BEST = [
    "--load_best_model_at_end",
    "true",
    "--metric_for_best_model",
    "loss",
    "--greater_is_better",
    "true",
    "--validation_split_percentage",
    "10",
    "--eval_strategy",
    "steps",
    "--eval_steps",
    "2",
]

# The positive-path runs of the tests below, by name: each one's train_fsdp.py flags given its base, but --output_dir.
# A config's runs share one launch (lora_runs), "whole" first: the run its resume is compared with bit for bit is the
# launch's first, as in a launch of its own; "resumed", next, is its resume (RESUMES) into an output_dir of its own.
SHARED = {
    "whole": lambda base: [*QUICK, "--model_name_or_path", base, *LORA],
    "best": lambda base: [*quick(max_steps="6", save_steps="2"), "--model_name_or_path", base, *LORA, *BEST],
    "tied": lambda base: [
        *quick(max_steps="2", save_steps="2"),
        *LORA,
        "--model_name_or_path",
        base,
        "--tokenizer_name",
        TINY,
    ],
    "bf16": lambda base: [
        *quick(max_steps="2", save_steps="2"),
        *LORA,
        "--model_name_or_path",
        base,
        "--tokenizer_name",
        TINY,
        "--dtype",
        "bfloat16",
    ],
}
# and --resume_from_checkpoint (RESUMES)
SHARED["resumed"] = SHARED["whole"]
RUNS_OF = {CONFIGS[0]: ("whole", "resumed", "best", "tied", "bf16"), CONFIGS[1]: ("whole", "resumed", "best", "tied")}
# a resume -> the run and checkpoint it resumes (--resume_from_checkpoint that checkpoint's path)
RESUMES = {"resumed": ("whole", "checkpoint-6")}
# where the resume saves its optimizer as loaded (FSDP_DUMP_OPTIMIZER, under the run's home; only a resume dumps)
AS_LOADED = "optimizer-as-loaded"
# the runs on a base of their own (the tiny Llama from its config, seed 0): how it differs; the others adapt the
# session's trained model
OWN_BASE = {"tied": {"tie_word_embeddings": True}, "bf16": {"dtype": torch.bfloat16}}


def tiny_llama_base(folder: Path, dtype: torch.dtype | None = None, **config) -> None:
    """The tiny Llama built from its config (with ``config``'s changes) from seed 0, saved at ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY, **config))
    (model.to(dtype) if dtype is not None else model).save_pretrained(folder)


@pytest.fixture(scope="module")
def lora_runs(trained, tmp_path_factory):
    """``get(config, name)`` -> (output_dir, base) of SHARED's run ``name`` on ``config``, ended normally; with
    ``output``, its SequencedRun third. The runs of a config are trained one after another in one launch
    (tests/helpers/fault_sequence.py: each as its command line trains it, the resume's optimizer saved as loaded into
    ``<output_dir>/../optimizer-as-loaded``), the first time one is asked for; pytest-xdist's workers share it under a
    file lock."""
    from filelock import FileLock

    trained_base = trained("accelerate_configs/zero3.yaml").model_dir
    root = shared_temp(tmp_path_factory)

    def get(config: str, name: str, output: bool = False) -> tuple:
        folder = root / ("lora-runs-" + config.replace("/", "--").removesuffix(".yaml"))
        done = folder / "launch.json"
        with FileLock(f"{folder}.lock"):
            if not done.is_file():
                shutil.rmtree(folder, ignore_errors=True)
                commands = []
                for each in RUNS_OF[config]:
                    home = folder / each
                    home.mkdir(parents=True)
                    if each in OWN_BASE:
                        tiny_llama_base(home / "base", **OWN_BASE[each])
                    base = home / "base" if each in OWN_BASE else trained_base
                    arguments = [*SHARED[each](str(base)), "--output_dir", str(home / "run")]
                    if each in RESUMES:
                        run_of, checkpoint = RESUMES[each]
                        arguments += ["--resume_from_checkpoint", str(folder / run_of / "run" / checkpoint)]
                    command = home / "command.json"
                    command.write_text(json.dumps(arguments))
                    commands.append(str(command))
                dump = {"FSDP_DUMP_OPTIMIZER": str(folder / "resumed" / AS_LOADED)}
                proc = launch(config, *commands, script=FAULT_SEQUENCE, env=dump, check=False)
                done.write_text(json.dumps({k: getattr(proc, k) for k in ("returncode", "stdout", "stderr")}))
        launched = read_json(done)
        assert launched["returncode"] == 0, launched["stderr"][-6000:]
        home = folder / name
        stdout, said = (
            launched[key].partition(f"=== RECIPE {home / 'command.json'}\n")[2].partition("=== RECIPE ")[0]
            for key in ("stdout", "stderr")
        )
        result = read_json(home / "command.json.result.json")
        assert result["error"] is None, f"{result['error']}\n{said[-6000:]}"
        found = home / "run", home / "base" if name in OWN_BASE else trained_base
        return (*found, SequencedRun(stdout, said, launched["stdout"] + launched["stderr"])) if output else found

    return get


def adapter_only_layout(folder: Path, world: int = 2) -> dict[str, int]:
    """Checks that a DCP folder of a LoRA checkpoint holds every rank's slice, each file non-empty, and returns each
    tensor's elements (read with the vetted reader, ckpt/dcp_pickles.py)."""
    layout = read_layout(folder)
    files = {stored.relative_path for stored in layout.storage.values()}
    # every rank wrote
    assert files == {f"__{r}_0.distcp" for r in range(world)}, files
    assert all((folder / f).stat().st_size > 0 for f in files)
    elements = {}
    for name, entry in layout.tensors.items():
        total = math.prod(entry.shape)
        # no rank's slice is missing
        assert sum(math.prod(c.sizes) for c in entry.chunks) == total, name
        writers = {layout.storage[(name, c.offsets)].relative_path for c in entry.chunks if math.prod(c.sizes)}
        # sharded by rows: each rank holds a non-empty slice (not a step count)
        if entry.shape and entry.shape[0] >= world:
            assert len(writers) == world, (name, writers)
        elements[name] = total
    return elements


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=["fsdp2", "fsdp1"])
def test_lora_trains_resumes_exactly_and_ends_merged_and_as_adapter(lora_runs, config, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # base: a pre-trained model to adapt (the session's trained run)
    whole, base = lora_runs(config, "whole")
    losses = logged_losses(whole)
    assert losses[-1] < losses[0], losses

    report = read_json(whole / "fsdp_report.json")
    assert 0 < report["trainable_param_elements"] < report["total_param_elements"] / 5
    assert sum(r["local_trainable_elements"] for r in report["ranks"]) == report["trainable_param_elements"]
    # sharded
    assert all(0 < r["local_trainable_elements"] < report["trainable_param_elements"] for r in report["ranks"])
    assert report["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in report["trainable"])

    # Adapter-only checkpoints: the adapter's weights and Adam's moments, every rank's slice, not the frozen base.
    ckpt = whole / "checkpoint-6"
    weights = adapter_only_layout(ckpt / "pytorch_model_fsdp_0")
    assert len(weights) == 4 * 7 * 2 and all(".lora_A.default." in n or ".lora_B.default." in n for n in weights)
    assert sum(weights.values()) == report["trainable_param_elements"]
    moments = adapter_only_layout(ckpt / "optimizer_0")
    assert {n.rsplit(".", 1)[1] for n in moments} >= {"exp_avg", "exp_avg_sq"}
    assert sum(v for n, v in moments.items() if n.endswith(".exp_avg")) == report["trainable_param_elements"]
    checked = run([sys.executable, "tools/check_checkpoint.py", str(ckpt)])
    assert checked.returncode == 0 and f"LoRA adapter only (base {base}), 2 rank(s)): resumable" in checked.stdout, (
        checked.stdout
    )

    # Resumed from checkpoint-6 (what a run killed after step 9 leaves: test_fault_tolerance kills runs; here the
    # checkpoint, resumed into another output_dir in the same launch, stands for it): the same bits as the run never
    # stopped.
    out, _, resumed = lora_runs(config, "resumed", output=True)
    assert f"resuming from {ckpt}" in resumed.stdout
    saved, loaded = DCPSource(ckpt / "optimizer_0"), DCPSource(out.parent / AS_LOADED / out.name / "optimizer_0")
    assert saved.tensors and set(saved.tensors) == set(loaded.tensors)
    saved_values, loaded_values = saved.read(sorted(saved.tensors)), loaded.read(sorted(saved.tensors))
    # Adam's state came back whole
    assert all(torch.equal(saved_values[n], loaded_values[n]) for n in saved_values)
    for name in ("model/model.safetensors", "adapter/adapter_model.safetensors"):
        resumed, reference = load_file(out / name), load_file(whole / name)
        assert set(resumed) == set(reference)
        for key in reference:
            assert torch.equal(resumed[key], reference[key]), (name, key)

    merged = AutoModelForCausalLM.from_pretrained(whole / "model").state_dict()
    by_peft = (
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), whole / "adapter")
        .merge_and_unload()
        .state_dict()
    )
    untouched = AutoModelForCausalLM.from_pretrained(base).state_dict()
    assert set(merged) == set(by_peft)
    changed = 0
    for key in by_peft:
        torch.testing.assert_close(merged[key], by_peft[key], rtol=0, atol=1e-6)
        changed += not torch.equal(merged[key], untouched[key])
    # every targeted linear of the 4 layers moved; nothing else did
    assert changed == 4 * 7

    # The merge tool: checkpoint + base (the one adapter_config.json records, or --base-model) -> the merged model,
    # equal to peft's merge of the adapter folder it writes from the same checkpoint.
    final = whole / "checkpoint-12"
    adapter = tmp_path / "adapter-12"
    assert (
        run([sys.executable, "tools/merge_checkpoint.py", str(final), str(adapter), "--adapter-only"]).returncode == 0
    )
    by_peft = (
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).merge_and_unload().state_dict()
    )
    assert not any(torch.equal(by_peft[k], untouched[k]) for k in by_peft if "proj" in k)
    for extra in ([], ["--base-model", str(base)]):
        folder = tmp_path / f"merged{len(extra)}"
        done = run([sys.executable, "tools/merge_checkpoint.py", str(final), str(folder), *extra])
        assert done.returncode == 0 and f"the frozen base's weights from {base}" in done.stdout, (
            done.stdout + done.stderr
        )
        tool = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        assert set(tool) == set(by_peft)
        for key in by_peft:
            torch.testing.assert_close(tool[key], by_peft[key], rtol=0, atol=1e-6)
    without = run(
        [
            sys.executable,
            "tools/merge_checkpoint.py",
            str(final),
            str(tmp_path / "nobase"),
            "--base-model",
            str(tmp_path),
        ]
    )
    assert (
        without.returncode != 0
        and "holds the LoRA adapter alone" in without.stderr
        and "--base-model" in without.stderr
    )


def test_lora_recipe_on_a_fresh_checkout_names_a_base_that_loads(lora_recipe_run, monkeypatch):
    """recipes/tiny-llama/lora_sft.yaml builds its base from a config: the run saves that base once, and the adapter
    loads onto it exactly as a new user would write it, from where the recipe was launched."""
    import json

    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed

    # a fresh checkout the recipe was launched in
    monkeypatch.chdir(lora_recipe_run)

    # the new user's code, word for word
    adapter = "runs/tiny-llama-lora/adapter"
    base = json.loads(open(f"{adapter}/adapter_config.json").read())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)

    assert base == "runs/tiny-llama-lora/base_model"
    base_weights = AutoModelForCausalLM.from_pretrained(base).state_dict()
    # the recipe's seed: the base is the config's model as the run built it, random and frozen
    set_seed(42)
    built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("assets/tiny-llama")).state_dict()
    assert set(built) == set(base_weights) and all(torch.equal(built[k], base_weights[k]) for k in built)
    merged = AutoModelForCausalLM.from_pretrained("runs/tiny-llama-lora/model").state_dict()
    by_peft = model.merge_and_unload().state_dict()
    assert set(merged) == set(by_peft)
    changed = 0
    for key in by_peft:
        torch.testing.assert_close(merged[key], by_peft[key], rtol=0, atol=1e-6)
        changed += not torch.equal(merged[key], base_weights[key])
    # every targeted linear moved; the frozen rest is the base's, bit for bit
    assert changed == 4 * 7


def test_only_an_exported_adapter_folder_is_replaced(tmp_path):
    """The next export replaces output_dir/adapter only when it holds nothing but adapter files in a real folder."""
    from fsdp_recipes.ckpt.layout import is_exported_adapter

    ours = tmp_path / "adapter"
    ours.mkdir()
    (ours / "adapter_config.json").write_text("{}")
    (ours / "adapter_model.safetensors").write_bytes(b"")
    assert is_exported_adapter(ours)
    link = tmp_path / "link"
    link.symlink_to(ours)
    assert not is_exported_adapter(link)
    (ours / "notes.txt").write_text("a user's file")
    assert not is_exported_adapter(ours)
    assert not is_exported_adapter(tmp_path / "missing")


def test_a_lora_base_is_saved_once_and_another_models_is_refused(tmp_path):
    """The base a LoRA run builds from a config is saved whole (a resume trains on those very weights); a base of
    another config in the same output_dir is refused, in one line, and left as it was."""
    import json

    from transformers import AutoModelForCausalLM

    from fsdp_recipes.config.model_arguments import ModelArguments
    from fsdp_recipes.errors import RecipeError
    from fsdp_recipes.train.modeling import lora_base, save_lora_base, use_lora_base

    args = ModelArguments(config_name=str(REPO / "assets" / "tiny-llama"), use_peft=True)
    # no LoRA: nothing to save
    assert lora_base(ModelArguments(config_name=args.config_name), str(tmp_path)) is None
    base = lora_base(args, str(tmp_path))
    assert base == str(tmp_path / "base_model")
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    use_lora_base(args, str(tmp_path), log=lambda _: None)
    # every rank goes on from the same RNG state
    assert torch.equal(torch.random.get_rng_state(), before)
    assert (args.model_name_or_path, args.config_name) == (base, None)
    saved = AutoModelForCausalLM.from_pretrained(base).state_dict()
    # its staging folder is gone
    assert sorted(p.name for p in (tmp_path).iterdir()) == ["base_model"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in Path(base).iterdir()}

    said = []
    save_lora_base(
        ModelArguments(config_name=str(REPO / "assets" / "tiny-llama"), use_peft=True), base, log=said.append
    )
    # kept, not rebuilt
    assert "saved by an earlier run of this output_dir" in said[0]
    again = AutoModelForCausalLM.from_pretrained(base).state_dict()
    assert all(torch.equal(saved[k], again[k]) for k in saved)

    other = tmp_path / "other-config"
    other.mkdir()
    config = json.loads((REPO / "assets" / "tiny-llama" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    wrong = ModelArguments(config_name=str(other), tokenizer_name=str(REPO / "assets" / "tiny-llama"), use_peft=True)
    with pytest.raises(
        RecipeError, match=r"holds another model's base .*num_hidden_layers.*choose another --output_dir"
    ):
        save_lora_base(wrong, base)


@pytest.mark.parametrize("kind", ["folder of the user's", "link to a base"])
def test_a_base_model_path_that_is_not_a_saved_base_is_refused_before_anything_is_built(tmp_path, kind):
    """output_dir/base_model that is a folder without config.json, or a link (to weights this run did not save, even
    a real base), is neither used nor replaced, and no staging copy of a new base is left beside it."""
    from fsdp_recipes.config.model_arguments import ModelArguments
    from fsdp_recipes.errors import RecipeError
    from fsdp_recipes.train.modeling import save_lora_base

    run = tmp_path / "run"
    run.mkdir()
    if kind == "folder of the user's":
        (run / "base_model").mkdir()
        (run / "base_model" / "notes.txt").write_text("mine")
    else:
        (run / "base_model").symlink_to(REPO / "assets" / "tiny-llama")
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    with pytest.raises(RecipeError, match="choose another --output_dir, or move it away"):
        save_lora_base(
            ModelArguments(config_name=str(REPO / "assets" / "tiny-llama"), use_peft=True), str(run / "base_model")
        )
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before


def test_check_checkpoint_refuses_empty_or_partial_model_shards(tmp_path):
    """What stock adapter-only saves left (FSDP1: no tensor at all; accelerate PR #4206's FSDP2 bug: rank 0's slice
    only) is incomplete, named; every slice present is fine, and a LoRA adapter alone is named as such."""
    from fsdp_recipes.ckpt.checkpoint_files import _coverage_problems
    from fsdp_recipes.ckpt.dcp_check import chunk_problems
    from fsdp_recipes.ckpt.dcp_layout import Chunk, Layout, Stored, TensorEntry
    from fsdp_recipes.ckpt.status import CheckpointStatus

    folder = tmp_path / "checkpoint-6" / "pytorch_model_fsdp_0"
    name = "model.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    halves = (Chunk((0, 0), (4, 64)), Chunk((4, 0), (4, 64)))
    status = CheckpointStatus(str(folder.parent))
    assert _coverage_problems(folder, Layout({name: TensorEntry("float32", (8, 64), halves)}, {}), status) == []
    assert status.lora == "adapter only"
    status = CheckpointStatus(str(folder.parent))
    whole = {
        name: TensorEntry("float32", (8, 64), halves),
        name.replace("lora_A.default", "base_layer"): TensorEntry("float32", (64, 64), ()),
    }
    assert _coverage_problems(folder, Layout(whole, {}), status) == [] and status.lora == "whole model"
    stored = {(name, c.offsets): Stored("__0_0.distcp", 0, 10**9, False) for c in halves}
    [problem] = chunk_problems(
        Layout({name: TensorEntry("float32", (8, 64), halves[:1])}, stored), folder / ".metadata"
    )
    assert problem.startswith(
        f"unreadable {folder / '.metadata'}: the chunks of {name!r} hold 256 of its 512 elements (a rank's "
        "slice is missing"
    ), problem
    [problem] = chunk_problems(Layout(whole, stored), folder / ".metadata")
    assert "base_layer.weight' hold 0 of its 4,096 elements (a rank's slice is missing" in problem, problem
    [problem] = _coverage_problems(folder, Layout({}, {}), CheckpointStatus("x"))
    assert problem.startswith("pytorch_model_fsdp_0/ holds no tensors")


def test_an_adapter_only_checkpoint_merges_onto_its_base(tmp_path):
    """An adapter-only checkpoint (the adapter's tensors by peft's names, as FSDPTrainer saves them) plus its base
    gives peft's own merge_and_unload: the base the adapter config records, or --base-model; without a base that
    loads, or with another model's, it stops in one line."""
    import json

    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_recipes.ckpt.inspection import inspect_checkpoint
    from fsdp_recipes.ckpt.merge import merge_checkpoint
    from fsdp_recipes.errors import CheckpointError

    base_dir, ckpt = tmp_path / "base", tmp_path / "run" / "checkpoint-3"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")).save_pretrained(
        base_dir
    )
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                # a trained adapter: the merge moves the weights
                param.normal_()
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert len(adapter) == 4 * 2 * 2
    dcp.save({"model": adapter}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"), no_dist=True)
    model.peft_config["default"].save_pretrained(str(ckpt))
    model.save_pretrained(str(tmp_path / "peft-adapter"))
    by_peft = (
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "peft-adapter")
        .merge_and_unload()
        .state_dict()
    )
    assert json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_dir)

    assert inspect_checkpoint(ckpt)["layout"].startswith(
        "layout: 16 LoRA adapter tensors (lora_A, lora_B) and no frozen base weight"
    )
    said = []
    # the base adapter_config.json records
    merge_checkpoint(ckpt, tmp_path / "merged", log=said.append)
    assert f"adapter-only LoRA checkpoint: the frozen base's weights from {base_dir}" in said
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert set(merged) == set(by_peft)
    for key in by_peft:
        torch.testing.assert_close(merged[key], by_peft[key], rtol=0, atol=1e-6)

    config = json.loads((ckpt / "adapter_config.json").read_text())
    (ckpt / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": str(tmp_path / "moved")})
    )
    with pytest.raises(
        CheckpointError,
        match=r"holds the LoRA adapter alone .* names '.*moved', which is not a local folder .* pass --base-model",
    ):
        merge_checkpoint(ckpt, tmp_path / "nobase")
    merge_checkpoint(ckpt, tmp_path / "given", base_model=str(base_dir), log=said.append)
    given = AutoModelForCausalLM.from_pretrained(tmp_path / "given").state_dict()
    assert all(torch.equal(given[k], merged[k]) for k in merged)

    other = tmp_path / "other"
    AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama", intermediate_size=64)
    ).save_pretrained(other)
    with pytest.raises(
        CheckpointError,
        match=r"down_proj has LoRA weights in the checkpoint but no weight of that size in the base model",
    ):
        merge_checkpoint(ckpt, tmp_path / "wrong", base_model=str(other))
    merge_checkpoint(ckpt, tmp_path / "adapter", adapter_only=True, log=said.append)
    from safetensors.torch import load_file as load

    written, by_peft_adapter = (
        load(tmp_path / "adapter" / "adapter_model.safetensors"),
        load(tmp_path / "peft-adapter" / "adapter_model.safetensors"),
    )
    assert set(written) == set(by_peft_adapter) and all(torch.equal(written[k], by_peft_adapter[k]) for k in written)

    # the base a merge reads is never its output, however it is named, --overwrite or not
    from conftest import _snapshot

    before = _snapshot(base_dir)
    for named_by in ("--base-model", "the adapter config"):
        if named_by == "the adapter config":
            (ckpt / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(base_dir)}))
        given = {"base_model": str(base_dir)} if named_by == "--base-model" else {}
        with pytest.raises(CheckpointError, match=r"is the base model .*, which this merge reads"):
            merge_checkpoint(ckpt, base_dir, overwrite=True, **given)
    assert _snapshot(base_dir) == before


@pytest.mark.slow
def test_full_state_dict_lora_checkpoints_hold_the_adapter_and_resume_exactly(tmp_path):
    """FSDP2 FULL_STATE_DICT: the checkpoint's pytorch_model_fsdp.bin holds the adapter alone (every rank's rows
    gathered: accelerate PR #4206's bug kept rank 0's), the resume ends on the same bits, the merge tool adds the
    base. The run and its resume (from its checkpoint-3, into another output_dir, where the recipe builds its base
    again) train in one launch."""
    full = ("--fsdp_state_dict_type", "FULL_STATE_DICT")
    args = ["recipes/tiny-llama/lora_sft.yaml", "--max_steps", "6", "--save_steps", "3"]
    runs, whole, resumed = run_and_resume(tmp_path, "accelerate_configs/zero3.yaml", args, "checkpoint-3", full)
    runs("run")
    saved = torch.load(whole / "checkpoint-3" / "pytorch_model_fsdp.bin", weights_only=True)
    lora = load_file(whole / "adapter" / "adapter_model.safetensors")
    assert len(saved) == len(lora) == 4 * 7 * 2 and all(".lora_A." in n or ".lora_B." in n for n in saved)
    # whole tensors, not a rank's rows
    assert sum(t.numel() for t in saved.values()) == sum(t.numel() for t in lora.values())
    said = runs("resumed")
    assert f"resuming from {whole / 'checkpoint-3'}" in said.stdout + said.stderr
    # the base the checkpoint was trained on, built again (a copy of the folder stood for it)
    same_tensors(resumed / "base_model" / "model.safetensors", whole / "base_model" / "model.safetensors")
    for name in ("model/model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(whole / name), load_file(resumed / name)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name
    merged = tmp_path / "merged"
    assert run([sys.executable, "tools/merge_checkpoint.py", str(whole / "checkpoint-6"), str(merged)]).returncode == 0
    a, b = load_file(whole / "model" / "model.safetensors"), load_file(merged / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_bf16_lora_run_ends_on_peft_s_merge_of_its_adapter(lora_runs):
    """--dtype bfloat16 over a bf16 base: the adapter trains in fp32 (mixed precision upcasts trainable weights), the
    final model/ is exactly peft's merge_and_unload of the run's adapter/ into the bf16 base (it was garbage: fp32
    sums written into the bf16 places of the merged file, overwriting the tensors after them)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # its base: the tiny Llama in bf16
    out, base = lora_runs(CONFIGS[0], "bf16")
    final = load_file(out / "model" / "model.safetensors")
    by_peft = (
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), out / "adapter")
        .merge_and_unload()
        .state_dict()
    )
    trained = [k for k in final if "q_proj" in k]
    # the adapter moved them
    assert trained and any(not torch.equal(final[k], load_file(base / "model.safetensors")[k]) for k in trained)
    for key in final:
        assert final[key].dtype == torch.bfloat16 and torch.equal(final[key], by_peft[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=["fsdp2", "fsdp1"])
def test_a_tied_model_s_lora_checkpoint_holds_the_adapter_alone_and_merges(lora_runs, tmp_path, config):
    """A base with tied embeddings: torch's ignore_frozen_params dropped the frozen head under one of its two names
    only, so every checkpoint also held lm_head.weight: neither adapter-only nor whole, and the merge refused it
    ("has LoRA weights but no base_layer.weight"). Now it holds the adapter alone, check_checkpoint says so, a resume
    takes it as this model's, and the merge of the checkpoint is the run's own final model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fsdp_recipes.ckpt.inspection import inspect_checkpoint
    from fsdp_recipes.ckpt.merge import merge_checkpoint
    from fsdp_recipes.ckpt.model_match import model_mismatch, omittable_names

    # its base: the tiny Llama with tied embeddings
    out, base = lora_runs(config, "tied")
    names = adapter_only_layout(out / "checkpoint-2" / "pytorch_model_fsdp_0")
    assert names and all("lora_" in n for n in names), sorted(n for n in names if "lora_" not in n)
    assert "no frozen base weight" in inspect_checkpoint(out / "checkpoint-2")["layout"]
    # and a resume takes it as this model's (the frozen head under peft's second name may be absent)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig.from_pretrained(out / "checkpoint-2"))
    shapes = {name: tuple(t.shape) for name, t in lora.state_dict().items()}
    assert model_mismatch(out / "checkpoint-2", shapes, omittable_names(lora)) is None
    merge_checkpoint(out / "checkpoint-2", tmp_path / "merged", log=lambda line: None)
    merged, final = load_file(tmp_path / "merged" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    # tied: written once
    assert set(merged) == set(final) and "lm_head.weight" not in final
    assert all(torch.equal(merged[k], final[k]) for k in final)


@pytest.fixture(scope="module")
def refused(lora_recipe_run, tmp_path_factory):
    """``refused(name)`` -> (run folder, SequencedRun): the LoRA runs below, each refused, in one launch of zero3.yaml
    (tests/helpers/launch_sequence.py): each must stop with the same one-line error on every rank.

    - "tied": LoRA on the tied LM head of a model built from the tiny config;
    - "zeroed": a copy of the LoRA recipe's run resumed with one weight of its saved base zeroed since;
    - "rebuilt": a copy resumed with its base gone, so that a new one is built, from another seed;
    - "bf16": a copy resumed with --dtype bfloat16 (its checkpoints hold an fp32 run's adapter), under the config's
      mixed precision (tests/integration/test_resume_refusals.py's resumes run without it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora-refused")
    base = root / "tied-base"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY, tie_word_embeddings=True)).save_pretrained(base)
    runs = {
        "tied": [
            *quick(max_steps="2"),
            *LORA,
            *("--lora_target_modules", "q_proj", "lm_head"),
            *("--model_name_or_path", str(base), "--tokenizer_name", TINY),
        ]
    }
    for name, flags in (("zeroed", []), ("rebuilt", ["--seed", "7"]), ("bf16", ["--dtype", "bfloat16"])):
        lora_recipe_copy(lora_recipe_run, root / name)
        runs[name] = [LORA_RECIPE, "--max_steps", "6", "--save_steps", "2", *flags, "--resume_from_checkpoint", "true"]
    rewrite_weights(root / "zeroed" / "base_model", lambda t: t["model.layers.1.self_attn.o_proj.weight"].zero_())
    shutil.move(root / "rebuilt" / "base_model", root / "rebuilt-base-moved")
    get = launch_sequence(
        root / "launch", CONFIGS[0], {name: [*args, "--output_dir", str(root / name)] for name, args in runs.items()}
    )
    return lambda name: (root / name, get(name, refused=True))


def test_lora_on_a_tied_head_under_fsdp2_efficient_loading_is_one_line(refused):
    """accelerate 1.15's FSDP2 preparation with fsdp_cpu_ram_efficient_loading (every shipped config) crashes in
    tie_weights when the tied LM head is a LoRA layer: the run stops before preparing, with one line naming the two
    ways out, instead of accelerate's KeyError."""
    out, said = refused("tied")
    assert said.refusal.startswith("train_fsdp.py: error: LoRA on the LM head of a model with tied"), said.refusal
    assert "fsdp_cpu_ram_efficient_loading: false" in said.refusal and not (out / "model").exists()


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=["fsdp2", "fsdp1"])
def test_a_lora_run_ends_on_its_best_checkpoint(lora_runs, config, tmp_path):
    """--load_best_model_at_end of a LoRA run loads the best checkpoint as a resume does (the Trainer's stock load asks
    peft for adapter names our adapter-only checkpoints do not keep): the run's model/ and adapter/ are the merge of
    that checkpoint exactly, on each FSDP version, the best checkpoint not the last."""
    # its base: the session's trained run
    out, _ = lora_runs(config, "best")
    state = read_json(out / "trainer_state.json")
    best = Path(state["best_model_checkpoint"])
    assert best.parent == out and best.name != "checkpoint-6", best
    # the end-of-run evaluation is the best checkpoint's, not the last step's
    last = [entry["eval_loss"] for entry in state["log_history"] if entry.get("step") == 6 and "eval_loss" in entry][0]
    assert last != pytest.approx(state["best_metric"], rel=1e-4), (last, state["best_metric"])
    assert read_json(out / "eval_results.json")["eval_loss"] == pytest.approx(state["best_metric"], rel=1e-6)
    merged, adapter = tmp_path / "best-merged", tmp_path / "best-adapter"
    for folder, extra in ((merged, []), (adapter, ["--adapter-only"])):
        done = run([sys.executable, "tools/merge_checkpoint.py", str(best), str(folder), *extra])
        assert done.returncode == 0, done.stdout + done.stderr
    same_tensors(out / "model" / "model.safetensors", merged / "model.safetensors")
    same_tensors(out / "adapter" / "adapter_model.safetensors", adapter / "adapter_model.safetensors")


def test_a_lora_run_records_its_base_and_a_resume_on_another_base_is_refused(lora_recipe_run, refused):
    """The LoRA recipe (its base built from a config and saved once): every checkpoint and the adapter record the
    base; the base zeroed since, or rebuilt from another seed, stops the resume in one line, before training."""
    recorded = base_identity.identity(lora_recipe_run / "runs" / "tiny-llama-lora" / "base_model")
    for folder in ("base_model", "checkpoint-2", "checkpoint-4", "adapter"):
        found = base_identity.read(lora_recipe_run / "runs" / "tiny-llama-lora" / folder)
        assert found["tensors"] == recorded["tensors"], folder

    out, said = refused("zeroed")
    assert (
        f"the LoRA base {out / 'base_model'} changed since a run saved it (1 of 39 weight(s) hold other values"
        in said.refusal
    ), said.refusal
    assert "model.layers.1.self_attn.o_proj.weight" in said.refusal and not (out / "checkpoint-6").exists()

    # a new base gets built, from another seed: not the checkpoints'
    out, said = refused("rebuilt")
    assert f"is not the one {out / 'checkpoint-4'} was trained on" in said.refusal, said.refusal
    # the norms are ones in both
    assert "30 of 39 weight(s) hold other values" in said.refusal
    assert not (out / "checkpoint-6").exists()


def test_resuming_a_lora_runs_fp32_checkpoint_in_bf16_stops_before_the_first_step(lora_recipe_run, refused):
    """A LoRA checkpoint stores the adapter and its Adam state, not the frozen base, which the resume loads at
    --dtype: an fp32 run resumed with --dtype bfloat16 would train its adapter on over a rounded base (exit 0 before).
    Refused in one line from the checkpoint's recorded dtype, with mixed precision on or off (this launch keeps the
    config's bf16 where the CPU has it, and drops it where not): the same verdict on every machine."""
    out, said = refused("bf16")
    assert "checkpoint-4 was trained on its base model's weights in float32" in said.refusal, said.refusal
    assert "loads them in bfloat16" in said.refusal and "resume with --dtype float32" in said.refusal
    assert not (out / "checkpoint-6").exists()
    saved = lora_recipe_run / "runs" / "tiny-llama-lora" / "checkpoint-4"
    files = {p.relative_to(saved): p.read_bytes() for p in saved.rglob("*") if p.is_file()}
    assert {
        p.relative_to(out / "checkpoint-4"): p.read_bytes() for p in (out / "checkpoint-4").rglob("*") if p.is_file()
    } == files
