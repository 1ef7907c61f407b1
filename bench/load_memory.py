"""Per-rank CPU memory of each phase of an FSDP run (loading + prepare, training, the final export): does any rank
hold the whole model?

    PYTHONPATH=. python bench/load_memory.py                       # fp32, untied, ~1 GB, 2 ranks, setting on and off
    PYTHONPATH=. python bench/load_memory.py --dtype bfloat16 --tied --nprocs 2 4

It builds a model folder (random Llama weights written with save_pretrained, safetensors) of about
``--gigabytes`` in fp32 (half that in bf16), then runs ``accelerate launch --config_file zero3.yaml
train_fsdp.py`` LoRA fine-tuning of it for one step (tiny data, block size 32): loading, ``prepare`` (FSDP
wrapping and, with fsdp_cpu_ram_efficient_loading, the broadcast from rank 0) and one tiny step. The same run
of the 3-layer tiny model (``assets/tiny-llama`` config, also saved with save_pretrained) is the baseline, so
``growth = peak(big) - peak(tiny)`` is what the model's weights cost each rank.

How memory is read: this process polls ``/proc/<pid>/status`` of every rank (the launcher's descendants whose
command line runs train_fsdp.py, rank from their RANK environment variable) every ``--interval`` seconds and
keeps the largest ``RssAnon`` until the run logs its sharding report (after accelerate's ``prepare``: loading +
prepare); per later phase (``PHASES``: training, until the run prints its train metrics, then the final export)
each rank's RssAnon at the phase's first sample and its peak in it, so that a phase's growth is its peak less its
start; and over the whole run, ``RssAnon`` (private, anonymous memory: tensors the rank allocated; not the page
cache or the safetensors file pages it maps, which the kernel can drop and which every process shares) and the
last ``VmHWM`` (the kernel's own exact peak RSS, which does count mapped file pages). RssAnon has no kernel peak,
so a spike shorter than the interval can be missed; loading a 1 GB model takes seconds, far longer. The final
export's writers and seconds come from the run's fsdp_report.json.

A rank that only ever holds its own shard grows by about 1/N of the model's bytes; one that holds the full
model at some moment grows by 1x or more.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsdp_recipes.console import HelpFormatter
from fsdp_recipes.removal import make_folder, remove

REPO = Path(__file__).resolve().parent.parent
# loading + prepare; the training steps; the final export (and the end)
PHASES = ("loading", "training", "export")
# the log lines that end the first two
PHASE_ENDS = ("this rank holds", "***** train metrics *****")
# the default work folder's marker (fsdp_recipes.removal)
BENCH_WORK = "load memory benchmark"
TINY = REPO / "assets" / "tiny-llama"
CONFIG = REPO / "accelerate_configs" / "zero3.yaml"


def build_model(
    folder: Path, target_bytes: int | None, dtype: str, tied: bool, hidden: int = 2048, vocab: int = 32000
) -> int:
    """Write a random Llama model folder (save_pretrained, safetensors) and the tiny tokenizer; return the
    weights' bytes. target_bytes None: the tiny model's own config."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from bench.synthetic import llama_config

    config = AutoConfig.from_pretrained(TINY) if target_bytes is None else llama_config(target_bytes, hidden, vocab)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY).save_pretrained(folder)
    # tied: counted once
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    return nbytes


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def rank_pids(root: int, script: bytes = b"train_fsdp.py") -> dict[int, int]:
    """{rank: pid} of the processes below ``root`` whose command line runs ``script`` (rank from their RANK)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            todo.append(child)
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(arg.endswith(script) for arg in cmdline):
                rank = [e[5:] for e in environ if e.startswith(b"RANK=")]
                if rank:
                    found[int(rank[0])] = child
    return found


def measure(
    model: Path,
    nprocs: int,
    efficient: bool,
    work: Path,
    interval: float,
    config_file: Path = CONFIG,
    lora: bool = True,
) -> dict[int, dict[str, int]]:
    """Launch one step (LoRA, or full fine-tuning with lora False) under config_file; return {rank: {RssAnon, VmHWM,
    VmRSS: peaks during loading + prepare, RssAnon_whole_run}}.
    Loading + prepare ends when the run logs its sharding report ("this rank holds ..."), written after
    accelerate's prepare, before the first step."""
    tag = f"{config_file.parent.name}-{config_file.stem}"
    config = work / f"{tag}-efficient-{efficient}.yaml"
    text = config_file.read_text()
    if not efficient:
        text = text.replace("fsdp_cpu_ram_efficient_loading: true", "fsdp_cpu_ram_efficient_loading: false")
    config.write_text(text)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = work / f"run-{model.name}-{tag}-{'lora' if lora else 'full'}-{nprocs}-{efficient}"
    cmd = [
        "accelerate",
        "launch",
        "--config_file",
        str(config),
        "--num_processes",
        str(nprocs),
        "--num_machines",
        "1",
        "--main_process_port",
        str(port),
        str(REPO / "train_fsdp.py"),
        "--model_name_or_path",
        str(model),
        "--tokenizer_name",
        str(TINY),
        "--use_peft",
        str(lora).lower(),
        "--train_file",
        str(REPO / "assets" / "data" / "tiny_corpus.txt"),
        "--block_size",
        "32",
        "--per_device_train_batch_size",
        "1",
        "--max_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--dataloader_pin_memory",
        "false",
        "--output_dir",
        str(out),
        "--overwrite_output_dir",
        "true",
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    log = open(work / f"{out.name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    # loading + prepare: until the sharding report's log line
    peaks: dict[int, dict[str, int]] = {}
    # the whole run (the step and the final export too)
    whole: dict[int, dict[str, int]] = {}
    # RssAnon at the first sample of each later phase, and its peak there: {phase: {rank: (start, peak)}}
    phases: dict[str, dict[int, tuple[int, int]]] = {phase: {} for phase in PHASES[1:]}
    pids: dict[int, int] = {}
    # the index in PHASES of the phase the run is in, from its log
    phase = 0
    while proc.poll() is None:
        if len(pids) < nprocs:
            pids.update(rank_pids(proc.pid))
        if phase < len(PHASES) - 1:
            # each phase's end is a line every run logs: the sharding report, once FSDP has wrapped the model and
            # the weights are broadcast (collectives: every rank is there); the train metrics, printed once training
            # has ended, before the final export
            text = Path(log.name).read_text(errors="replace")
            while phase < len(PHASES) - 1 and PHASE_ENDS[phase] in text:
                phase += 1
        for rank, pid in pids.items():
            try:
                now = _status(pid)
            except (OSError, ValueError):
                continue
            for table in (whole,) if phase else (whole, peaks):
                peak = table.setdefault(rank, {})
                for k, v in now.items():
                    peak[k] = max(peak.get(k, 0), v)
            # a rank that has just exited has none
            if phase and "RssAnon" in now:
                start, top = phases[PHASES[phase]].get(rank, (now["RssAnon"], 0))
                phases[PHASES[phase]][rank] = (start, max(top, now["RssAnon"]))
        time.sleep(interval)
    log.close()
    if proc.returncode:
        raise SystemExit(f"launch failed ({proc.returncode}); see {log.name}:\n" + Path(log.name).read_text()[-3000:])
    for rank, peak in whole.items():
        peaks.setdefault(rank, {})["RssAnon_whole_run"] = peak.get("RssAnon", 0)
        for name, ranks in phases.items():
            start, top = ranks.get(rank, (0, 0))
            peaks[rank][f"RssAnon_{name}_start"], peaks[rank][f"RssAnon_{name}_peak"] = start, top
    report = json.loads((out / "fsdp_report.json").read_text()) if (out / "fsdp_report.json").is_file() else {}
    for peak in peaks.values():
        peak["export"] = report.get("export", {})
    return peaks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--gigabytes", type=float, default=1.0, help="model size in fp32, gigabytes")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the saved model")
    p.add_argument("--tied", action="store_true", help="tie lm_head to embed_tokens")
    p.add_argument(
        "--hidden",
        type=int,
        default=2048,
        help="model width; layers fill --gigabytes (2048: 2 layers at 1 GB, the embeddings half the model; 1024: 15 "
        "layers, as a real model's share of them; FSDP1's peak depends on the largest wrapped unit)",
    )
    p.add_argument("--nprocs", type=int, nargs="+", default=[2], help="process counts to measure")
    p.add_argument(
        "--config", type=Path, default=CONFIG, help="accelerate config (default accelerate_configs/zero3.yaml, FSDP2)"
    )
    p.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    p.add_argument("--setting", choices=["on", "off", "both"], default="both", help="fsdp_cpu_ram_efficient_loading")
    p.add_argument("--interval", type=float, default=0.02, help="seconds between memory samples")
    p.add_argument("--work", type=Path, help="folder for the models and runs (default: a temporary one)")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args(argv)
    # kept: its models are reused by the next run given the same folder
    if a.work is not None:
        return run(a, a.work)
    # GBs of models: removed after
    work = make_folder(Path(tempfile.mkdtemp(prefix="load_memory-")), BENCH_WORK, exist_ok=True)
    try:
        return run(a, work)
    finally:
        remove(work, BENCH_WORK)


def run(a: argparse.Namespace, work: Path) -> int:
    work.mkdir(parents=True, exist_ok=True)
    tag = f"{a.dtype}-{'tied' if a.tied else 'untied'}"
    big, tiny = work / f"big-{a.gigabytes}-{a.hidden}-{tag}", work / f"tiny-{tag}"
    sizes = {}
    for folder, target in ((big, int(a.gigabytes * 1e9)), (tiny, None)):
        marker = folder / "nbytes"
        if not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(str(build_model(folder, target, a.dtype, a.tied, hidden=a.hidden)))
        sizes[folder] = int(marker.read_text())
    model_bytes = sizes[big]
    layers = json.loads((big / "config.json").read_text())["num_hidden_layers"]
    print(
        f"model {big}: {model_bytes / 2**20:,.0f} MiB of weights ({tag}); tiny baseline {sizes[tiny] / 2**20:,.1f} MiB",
        flush=True,
    )
    settings = {"on": [True], "off": [False], "both": [True, False]}[a.setting]
    results = []
    for n in a.nprocs:
        for efficient in settings:
            base = measure(tiny, n, efficient, work, a.interval, a.config, not a.full)
            peak = measure(big, n, efficient, work, a.interval, a.config, not a.full)
            for rank in sorted(peak):
                row = {
                    "config": str(a.config.resolve().relative_to(REPO))
                    if a.config.resolve().is_relative_to(REPO)
                    else str(a.config),
                    "training": "full" if a.full else "lora",
                    "nprocs": n,
                    "cpu_ram_efficient_loading": efficient,
                    "rank": rank,
                    "model_bytes": model_bytes,
                    "dtype": a.dtype,
                    "tied": a.tied,
                    "hidden": a.hidden,
                    "layers": layers,
                }
                for k in ("RssAnon", "VmHWM"):
                    row[f"{k}_peak"] = peak[rank].get(k, 0)
                    row[f"{k}_tiny"] = base.get(rank, {}).get(k, 0)
                    row[f"{k}_growth_x_model"] = round((row[f"{k}_peak"] - row[f"{k}_tiny"]) / model_bytes, 3)
                row["RssAnon_whole_run_growth_x_model"] = round(
                    (peak[rank]["RssAnon_whole_run"] - base.get(rank, {}).get("RssAnon_whole_run", 0)) / model_bytes, 3
                )
                # growth over the phase: its peak less its start, the tiny run's subtracted
                for phase in PHASES[1:]:
                    rose = {
                        run: ran.get(rank, {}).get(f"RssAnon_{phase}_peak", 0)
                        - ran.get(rank, {}).get(f"RssAnon_{phase}_start", 0)
                        for run, ran in (("big", peak), ("tiny", base))
                    }
                    row[f"RssAnon_{phase}_growth_x_model"] = round((rose["big"] - rose["tiny"]) / model_bytes, 3)
                row["export"] = peak[rank]["export"]
                results.append(row)
                print(
                    f"  {n} ranks, efficient loading {'on ' if efficient else 'off'}, rank {rank}: "
                    f"peak RssAnon {row['RssAnon_peak'] / 2**20:8,.0f} MiB (tiny {row['RssAnon_tiny'] / 2**20:6,.0f}), "
                    f"growth {row['RssAnon_growth_x_model']:5.2f}x model | peak RSS (VmHWM) "
                    f"{row['VmHWM_peak'] / 2**20:8,.0f} MiB, "
                    f"growth {row['VmHWM_growth_x_model']:5.2f}x model",
                    flush=True,
                )
    print("\nGrowth over the tiny model's run, in the model's bytes; loading + prepare unless said otherwise")
    print(
        "| ranks | efficient loading | rank | RssAnon | VmHWM (peak RSS) | RssAnon, whole run (1 LoRA step, export) |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['nprocs']} | {'on' if r['cpu_ram_efficient_loading'] else 'off'} | {r['rank']} | "
            f"{r['RssAnon_growth_x_model']:.2f} | {r['VmHWM_growth_x_model']:.2f} | "
            f"{r['RssAnon_whole_run_growth_x_model']:.2f} |"
        )
    print(
        "\nEach phase's RssAnon growth per rank (peak in the phase less its start; loading + prepare: its peak), over"
    )
    print("the tiny model's run, in the model's bytes; the final export's writers and seconds (fsdp_report.json)")
    print("| ranks | efficient loading | rank | loading + prepare | training | export | export writers | export s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['nprocs']} | {'on' if r['cpu_ram_efficient_loading'] else 'off'} | {r['rank']} | "
            f"{r['RssAnon_growth_x_model']:.2f} | {r['RssAnon_training_growth_x_model']:.2f} | "
            f"{r['RssAnon_export_growth_x_model']:.2f} | {r['export'].get('writers', '?')} | "
            f"{r['export'].get('seconds', '?')} |"
        )
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
