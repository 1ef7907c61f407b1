"""Files a run or a resume reads again after its checks, swapped or damaged in between, are each one line, never a
hang or a traceback: a .metadata that became a FIFO before torch's DCP reader opens it; a run report that became
unreadable mid-run (a warning, the run goes on); a tokenizer or config file of a checkpoint that is a FIFO or a device
(named by the resume's comparison, not skipped); an export part record that is a FIFO (not waited on for 5 minutes)
or has no file list (no folder published). In this process, under an alarm."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest
import torch
from conftest import REPO, make_special

from fsdp_recipes.errors import CheckpointError

SPECIAL = ["fifo", "dev_zero", "folder", "broken_link"]


@pytest.fixture
def alarm():
    def hung(*_):
        raise TimeoutError("hung: still reading after 10 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_torchs_reader_refuses_a_metadata_swapped_after_the_checks(tmp_path, kind, alarm):
    import torch.distributed.checkpoint as dcp

    from fsdp_recipes.ckpt.dcp_pickles import guard_torch_dcp

    folder = tmp_path / "dcp"
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(folder), no_dist=True)
    guard_torch_dcp()
    assert dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata["w"].size == torch.Size([6])
    make_special(folder / ".metadata", kind)
    with pytest.raises((CheckpointError, ValueError), match="not a regular file|over the"):
        dcp.FileSystemReader(str(folder)).read_metadata()


@pytest.mark.parametrize("kind", [*SPECIAL, "not_json", "a_list"])
def test_an_unreadable_run_report_is_a_warning_and_the_run_goes_on(tmp_path, kind, caplog, alarm):
    from fsdp_recipes.train.run_report import read_run_report, update_run_report

    report = tmp_path / "fsdp_report.json"
    report.write_text(json.dumps({"world_size": 2}))
    update_run_report(report, lambda r: r.update(export={"dtype": "float32"}))
    assert json.loads(report.read_text()) == {"world_size": 2, "export": {"dtype": "float32"}}
    if kind in SPECIAL:
        make_special(report, kind)
    else:
        report.write_text('{"world_size": ' if kind == "not_json" else "[1, 2]")
    with caplog.at_level(logging.WARNING):
        assert read_run_report(report) is None
        # no exception
        update_run_report(report, lambda r: r.update(export={}))
    assert "fsdp_report.json" in caplog.text and "the run goes on" in caplog.text


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json"])
@pytest.mark.parametrize("kind", SPECIAL)
def test_a_resumes_comparison_names_a_description_file_that_is_no_file(tmp_path, name, kind, alarm):
    """Without the checkpoint's manifest (another tool's, or removed), nothing else names it for a resume."""
    from transformers import AutoConfig, AutoTokenizer

    from fsdp_recipes.ckpt.model_match import description_mismatch, tokenizer_record

    tiny = REPO / "assets" / "tiny-llama"
    config, tokenizer = AutoConfig.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)
    ckpt = tmp_path / "checkpoint-3"
    config.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    record = tokenizer_record(tokenizer)
    assert description_mismatch(ckpt, config.to_diff_dict(), None, record) is None
    make_special(ckpt / name, kind)
    said = description_mismatch(ckpt, config.to_diff_dict(), None, record)
    assert said is not None and name in said and len(said.splitlines()) == 1, said


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder"])
def test_a_chat_template_that_is_no_file_is_named_by_the_resume(tmp_path, kind, alarm):
    from transformers import AutoConfig, AutoTokenizer

    from fsdp_recipes.ckpt.model_match import description_mismatch, tokenizer_record

    tiny = REPO / "assets" / "tiny-llama"
    config, tokenizer = AutoConfig.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    ckpt = tmp_path / "checkpoint-3"
    config.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    assert (ckpt / "chat_template.jinja").is_file()
    record = tokenizer_record(tokenizer)
    assert description_mismatch(ckpt, config.to_diff_dict(), None, record) is None
    make_special(ckpt / "chat_template.jinja", kind)
    said = description_mismatch(ckpt, config.to_diff_dict(), None, record)
    assert said is not None and "chat_template.jinja" in said, said


@pytest.mark.parametrize(
    "record", ["{}", '{"files": "model.safetensors"}', '{"files": [1]}', "fifo_done", "fifo_failed"]
)
def test_an_export_part_record_of_another_form_stops_the_wait_at_once(tmp_path, record, alarm):
    from fsdp_recipes.train.export_parts import wait_for_parts

    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / ".part-0.done").write_text(json.dumps({"files": ["model.safetensors"], "seconds": 0.1}))
    if record.startswith("fifo"):
        os.mkfifo(staging / f".part-1.{record.split('_')[1]}")
    else:
        (staging / ".part-1.done").write_text(record)
    with pytest.raises(CheckpointError, match="rank 1"):
        wait_for_parts(staging, 2, log=lambda *_: None)


@pytest.mark.parametrize("kind", ["not_json", "fifo"])
def test_an_unreadable_report_records_no_published_folder(tmp_path, kind, alarm):
    """The export's record of the folder it published: a report cut short (or swapped) mid-run ended rank 0 in a
    traceback after the model was written; it records nothing now, so the next export keeps that folder aside."""
    from fsdp_recipes.ckpt.layout import published, record_published

    out, folder = tmp_path / "run", tmp_path / "run" / "model"
    folder.mkdir(parents=True)
    report = out / "fsdp_report.json"
    if kind == "fifo":
        os.mkfifo(report)
    else:
        report.write_text('{"cut')
    record_published(out, folder, [])
    assert published(out) == {}


CHECKPOINT_ENTRIES = [
    "trainer_state.json",
    ".made-by-fsdp-recipes",
    "rng_state_1.pth",
    "scheduler.pt",
    "pytorch_model_fsdp_0/.metadata",
    "pytorch_model_fsdp_0/__0_0.distcp",
    "optimizer_0/__1_0.distcp",
]


@pytest.mark.parametrize("kind", ["fifo", "socket"])
@pytest.mark.parametrize("name", CHECKPOINT_ENTRIES)
def test_a_checkpoint_entry_that_is_no_regular_file_is_named_as_such(tmp_path, name, kind, alarm, monkeypatch):
    """A checkpoint-N folder that --overwrite_output_dir or a resume would judge, with one of its files a pipe or a
    socket (alone, or beside the rest of a checkpoint): named as what it is, not "holds no training state"."""
    import socket

    from fsdp_recipes.ckpt.layout import checkpoint_unlike

    for alone in (True, False):
        ckpt = tmp_path / f"{alone}" / "checkpoint-6"
        ckpt.mkdir(parents=True)
        if not alone:
            for entry in CHECKPOINT_ENTRIES:
                (ckpt / entry).parent.mkdir(exist_ok=True)
                (ckpt / entry).write_bytes(b"{}")
            (ckpt / name).unlink()
        (ckpt / name).parent.mkdir(exist_ok=True)
        if kind == "fifo":
            os.mkfifo(ckpt / name)
        else:
            with socket.socket(socket.AF_UNIX) as sock:
                # a socket's path is limited to 107 bytes
                monkeypatch.chdir((ckpt / name).parent)
                sock.bind(name.rsplit("/", 1)[-1])
        said = checkpoint_unlike(ckpt)
        assert said == f"it holds {name}, which is not a regular file (a pipe, device or socket)", (alone, said)
