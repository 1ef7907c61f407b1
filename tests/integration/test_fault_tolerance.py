"""Fault injection with real multi-process runs: SIGKILL mid-run and mid-save, resume on another process count,
bad input that must stop every rank before anything is set up. The runs on zero3.yaml that end normally after an
interruption (the resumes, a resume after a full disk, a start over in a stopped run's folder) share one launch (the
``resumed`` fixture)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time

import pytest
import torch
from conftest import (
    FAULT_SCRIPT,
    QUICK,
    REPO,
    elastic_root_cause,
    launch,
    logged_losses,
    quick,
    read_json,
)
from helpers.launch_sequence import FAULT_SEQUENCE, resumed_together
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fsdp_recipes.ckpt.merge import merge_checkpoint
from fsdp_recipes.ckpt.readers import DCPSource

# every test here launches real runs
pytestmark = pytest.mark.slow

# (config, fault): which rank(s) die, at which point, after how many steps. The uninterrupted run
# checkpoints at steps 6 and 12, so every fault lands between checkpoint-6 and the end.
KILLS = [
    # FSDP2 FULL_SHARD: one rank dies, the launcher stops the rest
    ("accelerate_configs/zero3.yaml", "1:step:9"),
    # FSDP2 SHARD_GRAD_OP: SIGTERM to the whole job in test_preempted_run_saves_its_step_and_resumes_exactly
    # FSDP1 FULL_SHARD: dies while writing checkpoint-12
    ("accelerate_configs/fsdp1/zero3.yaml", "0:optimizer:12"),
    # FSDP1 SHARD_GRAD_OP resumes exactly in test_preempted_run_saves_its_step_and_resumes_exactly
]


def load_dcp(folder) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder, f"{tmp}/state.pt")
        return torch.load(f"{tmp}/state.pt", weights_only=False)


ZERO3 = "accelerate_configs/zero3.yaml"
# 16 steps
EPOCHS = (*quick(max_steps="-1"), "--num_train_epochs", "1", "--save_strategy", "epoch", "--max_train_samples", "600")


def remove_descriptions_and_leave_staging(out) -> None:
    """checkpoint-12 without its config.json and tokenizer (a rank 0 killed right after trainer_state.json, before
    description files came first), and the staging folders of the killed export, as the export makes them."""
    from fsdp_recipes.removal import make_folder

    for f in (out / "checkpoint-12").iterdir():
        if f.name.startswith(("config", "generation_config", "tokenizer", "chat_template", "model_description")):
            f.unlink()
    # marked, then written into
    for leftover in (".final-sharded", ".export-tmp"):
        make_folder(out / leftover, "export staging")
        (out / leftover / "pytorch_model_fsdp_0").mkdir()
        (out / leftover / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"partial")


def killed_at_the_final_model(flags, then=None):
    def interrupt(out):
        killed = launch(
            ZERO3, *flags, "--output_dir", str(out), script=FAULT_SCRIPT, env={"FSDP_FAULT": "all:final:0"}, check=False
        )
        # no folder: resumed_together says so, with the launch's output
        if then is not None and out.is_dir():
            then(out)
        return killed

    return interrupt


def copy_of_the_sessions_run(trained):
    # no launch: run_args.json comes along, so the run is ours
    def interrupt(out):
        shutil.copytree(trained(ZERO3).output_dir, out, ignore=shutil.ignore_patterns("model"))

    return interrupt


def stopped_in_stages(trained):
    """output_dir as a stop leaves it, built from the session's run in stages: none saved, checkpoint-6, a
    checkpoint-12 cut short after the model's shards, then checkpoint-6 cut short before any shard (Ctrl-C during the
    first save). What how_to_go_on said at each stage goes to ``<output_dir>-advice.json`` beside it, a list."""

    # no launch: run_args.json comes along, so the run is ours
    def interrupt(out):
        from fsdp_recipes.ckpt.stop_advice import how_to_go_on

        source, advice = trained(ZERO3).output_dir, []
        out.mkdir()
        shutil.copy(source / "run_args.json", out / "run_args.json")
        advice.append(how_to_go_on(out))
        shutil.copytree(source / "checkpoint-6", out / "checkpoint-6")
        advice.append(how_to_go_on(out))
        shutil.copytree(source / "checkpoint-12", out / "checkpoint-12")
        # cut short after the model's shards
        shutil.rmtree(out / "checkpoint-12" / "optimizer_0")
        advice.append(how_to_go_on(out))
        # cut short before any shard: the first save
        shutil.rmtree(out / "checkpoint-6" / "pytorch_model_fsdp_0")
        advice.append(how_to_go_on(out))
        out.with_name(f"{out.name}-advice.json").write_text(json.dumps(advice))

    return interrupt


# max_steps 4 with checkpoints 2 and 4: both fit on a 7.8 MB filesystem, the final model does not
DISK_FULL = ["--max_steps", "4", "--save_steps", "2", "--logging_steps", "1"]


def mount_tmpfs(folder, size: str) -> bool:
    """A tmpfs of ``size`` at ``folder`` (made here), if this machine lets the tests mount one (it needs root)."""
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        folder.rmdir()
        return False
    return True


def full_at_the_final_model(out):
    """``out``, a 7.8 MB tmpfs, fills up as the final model is written; then it grows to 20 MB for the resume."""
    failed = launch(ZERO3, *DISK_FULL, "--output_dir", str(out), check=False)
    # the resume asks for a 64 MB margin
    subprocess.run(["mount", "-o", "remount,size=20m", str(out)], check=True)
    return failed


def killed_by(config: str, fault: str):
    def interrupt(out):
        return launch(
            config, *QUICK, "--output_dir", str(out), script=FAULT_SCRIPT, env={"FSDP_FAULT": fault}, check=False
        )

    return interrupt


@pytest.fixture(scope="module")
def resumed(trained, tmp_path_factory):
    """The runs on zero3.yaml that end normally after an interruption, in one launch; each interruption in a launch of
    its own (or none: files put in place). The zero3 kill's resume saves its optimizer as loaded into
    ``optimizer-as-loaded/killed`` (FSDP_DUMP_OPTIMIZER). "disk-full" (its output_dir a tmpfs, unmounted once the
    module is done) is there only where the tests may mount one."""
    root = tmp_path_factory.mktemp("resumed")
    resume = ["--resume_from_checkpoint", "true"]
    [(_, zero3_fault)] = [kill for kill in KILLS if kill[0] == ZERO3]
    cases = {
        "final": (killed_at_the_final_model(QUICK, remove_descriptions_and_leave_staging), [*QUICK, *resume]),
        "epoch": (killed_at_the_final_model(EPOCHS), [*EPOCHS, *resume]),
        "branch": (
            copy_of_the_sessions_run(trained),
            [*QUICK, "--resume_from_checkpoint", str(root / "branch" / "checkpoint-6")],
        ),
        "killed": (killed_by(ZERO3, zero3_fault), [*QUICK, *resume]),
        # starts over
        "cut-short": (stopped_in_stages(trained), [*QUICK, "--overwrite_output_dir", "true"]),
    }
    mounted = mount_tmpfs(root / "disk-full", "7800k")
    if mounted:
        cases["disk-full"] = (full_at_the_final_model, [*DISK_FULL, *resume])
    # the kill's resume alone
    env = {"FSDP_DUMP_OPTIMIZER": f"{root / 'optimizer-as-loaded'}:killed"}
    try:
        yield resumed_together(root, ZERO3, cases, script=FAULT_SEQUENCE, env=env)
    finally:
        if mounted:
            subprocess.run(["umount", str(root / "disk-full")], capture_output=True)


@pytest.mark.parametrize("config, fault", KILLS, ids=[f"{c.split('/', 1)[1]}-{f}" for c, f in KILLS])
def test_killed_run_resumes_to_the_uninterrupted_weights(trained, request, config, fault, tmp_path):
    """Exact for FSDP1 and FSDP2 alike: same process count, same data order, restored RNG, optimizer and schedule.
    (FSDP1 needs FSDPTrainer's optimizer fix: without it, Adam's moments restart and the weights differ by ~1e-2.)
    zero3.yaml's resume is one of ``resumed``'s; fsdp1/zero3.yaml's a launch of its own."""
    uninterrupted = trained(config).output_dir
    if config == ZERO3:
        # fsdp1's case does not need the shared launch
        case = request.getfixturevalue("resumed")["killed"]
        out, killed, left = case.out, case.killed, case.as_left
        as_loaded = out.parent / "optimizer-as-loaded" / out.name
    else:
        out = left = tmp_path / "run"
        killed = killed_by(config, fault)(out)
        as_loaded = tmp_path / "optimizer-as-loaded" / out.name
    assert killed.returncode != 0 and "fault injection: SIGKILL" in killed.stderr, killed.stderr[-3000:]
    # no model, and no lock file left
    assert not (left / "model").exists() and not list(left.glob(".run.lock*"))

    if config == ZERO3:
        said = case.resume()
    else:
        dump = {"FSDP_DUMP_OPTIMIZER": str(as_loaded.parent)}
        resume = ["--output_dir", str(out), "--resume_from_checkpoint", "true"]
        said = launch(config, *QUICK, *resume, script=FAULT_SCRIPT, env=dump)
    assert f"resuming from {out / 'checkpoint-6'}" in said.stdout
    # the torn checkpoint-12 is named, skipped and kept aside
    if fault.endswith(":optimizer:12"):
        assert "skipping checkpoint-12" in said.stderr and "missing optimizer_0/" in said.stderr
        assert (out / "incomplete-checkpoint-12" / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert read_json(out / "trainer_state.json")["global_step"] == 12
    assert sorted(p.name for p in (out / "model").iterdir()) == sorted(
        p.name for p in trained(config).model_dir.iterdir()
    )
    assert not list(out.glob(".run.lock*"))

    final, reference = (
        load_file(out / "model" / "model.safetensors"),
        load_file(uninterrupted / "model" / "model.safetensors"),
    )
    assert set(final) == set(reference)
    for name in reference:
        assert torch.equal(final[name], reference[name]), name

    saved = load_dcp(out / "checkpoint-6" / "optimizer_0")["optimizer"]
    loaded = load_dcp(as_loaded / "optimizer_0")["optimizer"]
    assert saved["state"] and set(loaded["state"]) == set(saved["state"])
    for param, moments in saved["state"].items():
        assert set(moments) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in moments.items():
            assert torch.equal(loaded["state"][param][key], value), (param, key)
    assert [g["lr"] for g in loaded["param_groups"]] == [g["lr"] for g in saved["param_groups"]]


# (config, signal): SIGTERM from rank 0 to the launcher and every rank (as SLURM sends it to a job step), or
# SIGUSR1 to rank 1 alone (rank 0 never gets it and must stop at the same step).
SIGNALS = [
    ("accelerate_configs/zero2.yaml", "0:sigterm:8", "SIGTERM", 143),
    ("accelerate_configs/fsdp1/zero2.yaml", "1:usr1:8", "SIGUSR1", 138),
]


@pytest.mark.parametrize("config, fault, name, code", SIGNALS, ids=["fsdp2-sigterm-group", "fsdp1-usr1-one-rank"])
def test_preempted_run_saves_its_step_and_resumes_exactly(trained, config, fault, name, code, tmp_path):
    """The signal lands during step 9: every rank finishes it, checkpoint-9 is written as a periodic one would be
    (judged resumable), the job exits 128 + signal with how to resume, and the resumed run ends bit-identical."""
    from fsdp_recipes.ckpt.status import checkpoint_status

    uninterrupted = trained(config).output_dir
    out = tmp_path / "run"
    stopped = launch(
        config,
        *QUICK,
        "--output_dir",
        str(out),
        script=FAULT_SCRIPT,
        env={"FSDP_FAULT": fault},
        check=False,
        new_session=True,
    )
    assert (
        f"stopped by {name} after step 9: saved {out}/checkpoint-9; the run is not finished: run the same "
        "command with --resume_from_checkpoint true" in stopped.stdout + stopped.stderr
    ), stopped.stderr[-3000:]
    # the ranks exit 128 + signal; a launcher that got SIGTERM too exits 1 through torch elastic's SignalException
    assert stopped.returncode != 0 and (
        f"exitcode  : {code}" in stopped.stderr or "SignalException" in stopped.stderr
    ), stopped.stderr[-3000:]
    assert checkpoint_status(out / "checkpoint-9").resumable and not (out / "model").exists()
    # the launcher's report ends with our line
    if "Root Cause (first observed failure)" in stopped.stderr:
        assert elastic_root_cause(stopped.stderr).startswith(f"train_fsdp.py: stopped by {name} after step 9"), (
            stopped.stderr[-3000:]
        )
    resumed = launch(config, *QUICK, "--output_dir", str(out), "--resume_from_checkpoint", "true")
    assert f"resuming from {out / 'checkpoint-9'}" in resumed.stdout
    # nothing to pin to on CPU: no warning per DataLoader
    assert "pin_memory" not in resumed.stderr
    # the arguments in force, the accelerate config's text included
    args = read_json(out / "run_args.json")
    assert args["accelerate_config_file"].endswith(config) and "fsdp_version" in args["accelerate_config"]
    # in force: file + flags
    assert args["accelerate_settings"]["fsdp_config"]["fsdp_version"] == (2 if "fsdp1" not in config else 1)
    # the tests pick a free port
    assert args["accelerate_settings_from"] == f"{REPO / config} + accelerate launch (--main_process_port)"
    assert args["training"]["resume_from_checkpoint"] == str(out / "checkpoint-9") and args["world_size"] == 2
    final, reference = (
        load_file(out / "model" / "model.safetensors"),
        load_file(uninterrupted / "model" / "model.safetensors"),
    )
    assert set(final) == set(reference)
    for tensor_name in reference:
        assert torch.equal(final[tensor_name], reference[tensor_name]), tensor_name
    # the loss logged at step 10 averages steps 9-10 in the uninterrupted run but only step 10 after the resume
    assert logged_losses(out)[-1] == logged_losses(uninterrupted)[-1]


def test_ctrl_c_is_one_line_on_how_to_resume(tmp_path):
    """SIGINT to the launcher's process group (what Ctrl-C at a terminal sends; the launcher forwards it to the
    ranks): one line per machine saying how to resume, not a traceback per rank. The launcher's own traceback
    (torch elastic's SignalException) is the launcher's."""
    out = tmp_path / "run"
    proc = launch(
        "accelerate_configs/zero3.yaml",
        *QUICK,
        "--output_dir",
        str(out),
        script=FAULT_SCRIPT,
        env={"FSDP_FAULT": "0:sigint:3"},
        check=False,
        new_session=True,
    )
    ours = [line for line in proc.stderr.splitlines() if line.startswith("train_fsdp.py:")]
    assert proc.returncode != 0 and ours == [
        "train_fsdp.py: interrupted: nothing was saved since the last checkpoint; no checkpoint was saved yet: run the "
        "same command again to start over (SIGTERM or SIGUSR1 instead of Ctrl-C saves one first)"
    ], proc.stderr[-3000:]
    assert "[rank" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr[-3000:]
    # what the line says to do works: the same command's check of the folder left passes (nothing to delete), and
    # the folder's lock is free
    from types import SimpleNamespace

    from fsdp_recipes.ckpt.resume import check_output_dir
    from fsdp_recipes.ckpt.stop_advice import how_to_go_on
    from fsdp_recipes.train.preflight import hold_output_dir

    assert how_to_go_on(out) == "no checkpoint was saved yet: run the same command again to start over"
    assert check_output_dir(str(out), resuming=False, overwrite=False) == []
    hold_output_dir(SimpleNamespace(process_index=0, output_dir=str(out)))


def test_what_to_run_after_a_stop_is_what_works_in_the_folder_left(resumed):
    """After Ctrl-C or a full disk the line says what to run next, as output_dir was left: resume from the newest
    complete checkpoint; start over with none saved; with only cut-short ones (Ctrl-C during the first save), start
    over with --overwrite_output_dir, which removes them (a resume finds nothing, a plain start refuses them). The
    start over is one of ``resumed``'s runs, in the folder as the last stage left it."""
    from fsdp_recipes.ckpt.status import checkpoint_status

    case = resumed["cut-short"]
    out = case.out
    # stopped_in_stages'
    none, six, twelve_cut, all_cut = read_json(out.with_name("cut-short-advice.json"))
    assert none == "no checkpoint was saved yet: run the same command again to start over"
    assert six == "run the same command with --resume_from_checkpoint true to continue from checkpoint-6"
    assert twelve_cut.endswith("continue from checkpoint-6")
    assert all_cut.startswith(
        "no checkpoint is complete (checkpoint-12, checkpoint-6 cut short): run the same command with "
        "--overwrite_output_dir true"
    ), all_cut
    said = case.resume()
    assert (out / "model").is_dir() and checkpoint_status(out / "checkpoint-12").resumable, said.stderr[-2000:]


def test_killed_while_writing_the_final_model_resumes_without_training(trained, resumed):
    """After the last checkpoint nothing is left to train: the Trainer would still run one more step (it checks
    max_steps only after a step), so the resume writes the final folder from the checkpoint instead. It does so
    even when (a) the checkpoint lacks its config.json and tokenizer (a rank 0 killed right after
    trainer_state.json, before description files came first): the run's own config is used; and (e) the staging
    folders of the killed export are removed (remove_descriptions_and_leave_staging)."""
    case = resumed["final"]
    out, killed, left = case.out, case.killed, case.as_left
    assert killed.returncode != 0 and "fault injection: SIGKILL" in killed.stderr
    assert not (left / "model").exists() and (left / "checkpoint-12").is_dir()
    said = case.resume().stdout
    assert "is at step 12, max_steps is 12: nothing left to train" in said
    assert f"removed {out / '.final-sharded'}, left by an export that did not finish" in said
    assert not (out / ".final-sharded").exists() and not (out / ".export-tmp").exists()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-6"]
    assert read_json(out / "trainer_state.json")["global_step"] == 12
    final = load_file(out / "model" / "model.safetensors")
    reference = load_file(trained(ZERO3).model_dir / "model.safetensors")
    assert set(final) == set(reference) and all(torch.equal(final[k], reference[k]) for k in reference)
    assert read_json(out / "model" / "config.json")["architectures"] == ["LlamaForCausalLM"]


def test_epoch_based_run_killed_while_writing_the_final_model(resumed, tmp_path):
    """Without max_steps the Trainer resumed at the end of its last epoch trains nothing (no extra step to guard
    against, unlike above): the final folder holds the last checkpoint's weights."""
    case = resumed["epoch"]
    out, killed = case.out, case.killed
    assert killed.returncode != 0 and "fault injection: SIGKILL" in killed.stderr
    [ckpt] = case.as_left.glob("checkpoint-*")
    step = read_json(ckpt / "trainer_state.json")["global_step"]
    assert step > 12 and not (case.as_left / "model").exists()
    case.resume()
    assert [p.name for p in out.glob("checkpoint-*")] == [ckpt.name]
    assert read_json(out / "trainer_state.json")["global_step"] == step
    merge_checkpoint(out / ckpt.name, tmp_path / "merged", log=lambda *_: None)
    final, reference = (
        load_file(out / "model" / "model.safetensors"),
        load_file(tmp_path / "merged" / "model.safetensors"),
    )
    assert set(final) == set(reference) and all(torch.equal(final[k], reference[k]) for k in reference)


@pytest.mark.parametrize("config", ["accelerate_configs/zero3.yaml", "accelerate_configs/fsdp1/zero3.yaml"])
def test_resume_on_more_processes_reshards(trained, config, tmp_path):
    """Saved by 2 processes x 8 sequences, resumed on 4 x 4: the same sequences in each global batch, so the run
    continues the same trajectory; only the order of floating-point sums over ranks differs (bf16 autocast, or fp32 on a
    CPU without native bf16).
    Tolerance: per tensor, the distance to the uninterrupted weights is under 5% of how far the last 6 steps
    moved that tensor (measured: at most 0.3%, FSDP1 and FSDP2). Resuming without the weights or the optimizer
    state is far off."""
    uninterrupted = trained(config).output_dir
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(uninterrupted / "checkpoint-6", out / "checkpoint-6")
    proc = launch(
        config,
        *QUICK,
        "--per_device_train_batch_size",
        "4",
        "--output_dir",
        str(out),
        "--resume_from_checkpoint",
        "true",
        launch_args=("--num_processes", "4"),
    )
    assert "checkpoint-6 was saved by 2 processes, this run has 4" in proc.stderr
    assert read_json(out / "fsdp_report.json")["world_size"] == 4
    final, reference = (
        load_file(out / "model" / "model.safetensors"),
        load_file(uninterrupted / "model" / "model.safetensors"),
    )
    source = DCPSource(uninterrupted / "checkpoint-6" / "pytorch_model_fsdp_0")
    at_6 = source.read(list(source.tensors))
    for name, tensor in reference.items():
        # accelerate stores {"model": state_dict}
        moved = (tensor - at_6[f"model.{name}"]).norm()
        assert moved > 0, name
        assert (final[name] - tensor).norm() < 0.05 * moved, name
    resumed_losses, reference_losses = logged_losses(out), logged_losses(uninterrupted)
    # steps 2-6 from the checkpoint's history, 8-12 new
    assert len(resumed_losses) == len(reference_losses) == 6
    # step 8, the first after the resume
    assert resumed_losses[3] == pytest.approx(reference_losses[3], rel=0.01)


TINY = "config_name: assets/tiny-llama\n"
CORPUS = "train_file: assets/data/tiny_corpus.txt\n"
# case: (recipe or None for the default, extra flags, the one error line)
BAD_INPUT = {
    "missing dataset file": (
        None,
        ["--train_file", "/nonexistent/corpus.txt"],
        "train_file='/nonexistent/corpus.txt': does not exist",
    ),
    "missing model path": (
        "model_name_or_path: ./no-such-model\n" + CORPUS,
        [],
        "model_name_or_path='./no-such-model' does not exist",
    ),
    "unknown recipe key": (
        TINY + CORPUS + "num_train_epoch: 3\n",
        [],
        "recipe: unknown key(s): num_train_epoch (did you mean num_train_epochs?)",
    ),
    "bad value": (TINY + CORPUS + "learning_rate: fast\n", [], "recipe key learning_rate: 'fast' is not a number"),
    "another run's checkpoints": (None, [], "already holds another run's checkpoints (checkpoint-6)"),
}


def bad_input(case: str, tmp_path) -> tuple[list[str], str]:
    """(the arguments after train_fsdp.py, the error line) of a BAD_INPUT case, with its files in place."""
    recipe_text, flags, message = BAD_INPUT[case]
    out = tmp_path / "out"
    if case == "another run's checkpoints":
        (out / "checkpoint-6").mkdir(parents=True)
    recipe = []
    if recipe_text:
        (tmp_path / "recipe.yaml").write_text(recipe_text)
        recipe = [str(tmp_path / "recipe.yaml")]
    return [*recipe, *flags, "--output_dir", str(out)], message


def test_bad_input_stops_every_rank_before_anything_is_set_up(tmp_path, monkeypatch):
    """One case through a real 2-process launch (every rank stops in parsing, one line, nothing written); the
    others take the same path, so their lines are checked where it runs, in this process."""
    from fsdp_recipes.config.parse import parse_args
    from fsdp_recipes.errors import RecipeError

    (tmp_path / "launched").mkdir()
    args, message = bad_input("unknown recipe key", tmp_path / "launched")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    start = time.monotonic()
    proc = launch("accelerate_configs/zero3.yaml", *args, check=False)
    # seconds, not a timeout
    assert proc.returncode != 0 and time.monotonic() - start < 60
    errors = [line for line in proc.stderr.splitlines() if line.startswith("train_fsdp.py: error:")]
    # one message, not one per rank
    assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
    # main() never began
    assert "running FSDP over gloo" not in proc.stdout
    # nothing written
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before

    # the recipes' relative paths, as a launch from the repository root
    monkeypatch.chdir(REPO)
    for case in BAD_INPUT:
        folder = tmp_path / case.replace(" ", "-").replace("'", "")
        folder.mkdir()
        args, message = bad_input(case, folder)
        before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
        with pytest.raises(RecipeError) as err:
            parse_args(args)
        assert message in str(err.value), (case, str(err.value))
        assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before, case


def test_an_earlier_checkpoint_starts_a_branch_and_later_ones_are_never_rewritten(trained, resumed):
    """(b) resuming checkpoint-6 of a run that reached checkpoint-12: checkpoint-12 is moved aside before the
    resumed run writes its own step 12 (the Trainer would write into the old folder, mixing two runs' files)."""
    case = resumed["branch"]
    out, uninterrupted = case.out, trained(ZERO3).output_dir
    old = (case.as_left / "checkpoint-12" / "pytorch_model_fsdp_0" / "__0_0.distcp").read_bytes()
    said = case.resume()
    assert (
        "resuming checkpoint-6 starts a new branch of the run: moved checkpoint-12 to replaced-checkpoint-12"
        in said.stdout + said.stderr
    )
    assert (out / "replaced-checkpoint-12" / "pytorch_model_fsdp_0" / "__0_0.distcp").read_bytes() == old
    final, reference = (
        load_file(out / "model" / "model.safetensors"),
        load_file(uninterrupted / "model" / "model.safetensors"),
    )
    assert all(torch.equal(final[k], reference[k]) for k in reference)


HOLD_LOCK = """
import os, sys, time
from types import SimpleNamespace
from fsdp_recipes.train.preflight import hold_output_dir
hold_output_dir(SimpleNamespace(process_index=0, output_dir=sys.argv[1]))
print("held", flush=True)
time.sleep(60)
"""


def test_one_run_per_output_dir(tmp_path):
    """(c) an output_dir another live process holds is refused, the holder named; once that process is gone (killed:
    the kernel drops its lock) the folder is free again."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from fsdp_recipes.errors import RecipeError
    from fsdp_recipes.train.preflight import hold_output_dir

    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RecipeError, match=rf"is in use by another run \(pid {holder.pid} on "):
            hold_output_dir(SimpleNamespace(process_index=0, output_dir=str(out)))
    finally:
        holder.kill()
        holder.wait()
    # a killed run holds nothing
    hold_output_dir(SimpleNamespace(process_index=0, output_dir=str(out)))


def test_disk_full_while_saving_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    """(d) output_dir on a 5 MB filesystem: checkpoint-6 fits, checkpoint-12 does not. torch's own error is
    "unexpected pos ..." deep in a traceback; here it is one line with what is missing, and checkpoint-6 stays
    resumable (a resume then sets the torn checkpoint-12 aside, as after any kill mid-save)."""
    import subprocess

    from fsdp_recipes.ckpt.status import checkpoint_status

    disk = tmp_path / "small-disk"
    disk.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(disk)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("mounting a 5 MB tmpfs needs root, which this machine does not give the tests")
    try:
        out = disk / "run"
        proc = launch("accelerate_configs/zero3.yaml", *QUICK, "--output_dir", str(out), check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("train_fsdp.py: error:")]
        assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
        assert f"train_fsdp.py: error: no space left on {out}: a checkpoint takes 3.5 MB" in errors[0]
        assert (
            "MB more; checkpoint-6 is intact: free space (or move output_dir), then run the same command with "
            "--resume_from_checkpoint true" in errors[0]
        )
        assert (
            checkpoint_status(out / "checkpoint-6").resumable and not checkpoint_status(out / "checkpoint-12").resumable
        )
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_disk_full_while_writing_the_final_model_is_one_line_and_a_resume_writes_it(resumed):
    """output_dir on a 7.8 MB filesystem: both checkpoints fit, the final model does not. One line (not every rank's
    DCP traceback) says training had finished, which checkpoint is intact and how to get the model, and that
    command, once there is room (the filesystem grown to 20 MB), writes it without training. The resume is one of
    ``resumed``'s."""
    from fsdp_recipes.ckpt.status import checkpoint_status

    if "disk-full" not in resumed:
        pytest.skip("mounting a tmpfs needs root, which this machine does not give the tests")
    case = resumed["disk-full"]
    out, proc, left = case.out, case.killed, case.as_left
    errors = [line for line in proc.stderr.splitlines() if line.startswith("train_fsdp.py: error:")]
    # no rank's traceback
    assert proc.returncode != 0 and len(errors) == 1 and "[rank" not in proc.stderr, proc.stderr[-3000:]
    assert f"no space left on {out} while writing the final model (" in errors[0], errors
    assert (
        "training had finished and checkpoint-4 is intact: free space (or move output_dir), then run the same "
        "command with --resume_from_checkpoint true" in errors[0]
    )
    assert checkpoint_status(left / "checkpoint-4").resumable and not (left / "model").exists()
    said = case.resume()
    # this run's line, not a neighbour's
    assert f"model saved to {out / 'model'}" in said.stdout + said.stderr
    # the model, written without training again
    assert load_file(out / "model" / "model.safetensors")
    assert read_json(out / "trainer_state.json")["global_step"] == 4


@pytest.mark.parametrize("sig, code", [("TERM", 143), ("INT", 130)])
def test_stop_signal_before_training_is_one_line(tmp_path, sig, code):
    """A stop (or Ctrl-C: it said "nothing was saved since the last checkpoint", as if training had begun) while the
    model loads."""
    out = tmp_path / "run"
    proc = launch(
        "accelerate_configs/zero3.yaml",
        *QUICK,
        "--output_dir",
        str(out),
        script=FAULT_SCRIPT,
        env={"FSDP_FAULT": f"all:early:{sig}"},
        check=False,
    )
    ours = [line for line in proc.stderr.splitlines() if line.startswith("train_fsdp.py:")]
    how = "interrupted" if sig == "INT" else f"stopped by SIG{sig}"
    assert proc.returncode != 0 and ours == [
        f"train_fsdp.py: {how} before training started: nothing was trained or saved by this run; run the same "
        "command again to start (with --resume_from_checkpoint true, to continue from the last checkpoint of "
        "an earlier run)"
    ], proc.stderr[-3000:]
    # no traceback of a rank (the launcher's own report about its failed children is the launcher's)
    assert f"exitcode  : {code}" in proc.stderr and "[rank" not in proc.stderr and "Stopped" not in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert not list(out.glob("checkpoint-*"))
