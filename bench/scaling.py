"""Speed against memory for every strategy and process count: the seed's scaling tables, re-runnable anywhere.

    python bench/scaling.py --quick --output bench/results/cpu     # under 10 minutes on 2 CPU cores
    python bench/scaling.py --output DIR                           # FSDP1 beside FSDP2, more steps
    python bench/scaling.py --output DIR --nproc 1 --nproc 8       # a GPU node (default there: 1, 2, 4 ... all GPUs)

Each strategy (DDP, ZeRO-1, FSDP1 NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, FULL_SHARD + offload; FSDP2 and FSDP1 where
both exist) at each process count is a short real run of train_fsdp.py on one model, a Llama built from a config
(default hidden 512 x 8 layers, 19M parameters: the step does real work). Measured per run:
  - tokens/s and samples/s: median step time over the steps after warm-up (bench/step_times.py, on rank 0);
  - per rank: model-state bytes (parameters, gradients, optimizer state, from fsdp_report.json) and peak memory
    (CUDA max allocated on GPUs; resident set on CPU, which counts every library the process loaded too);
    the table shows the largest rank;
  - the communication share of step time (all-gather, reduce-scatter, all-reduce, and how much overlapped
    compute), from a profiler trace of the last two steps (--profile_steps; those steps are not timed).
Beside the sweep, in the same invocation, the overhead of this repository's layer: train_fsdp.py against
bench/bare_trainer.py (the same model, data and config through a bare accelerate + Trainer script), run in
ABBA order, with each one's tokens/s and time from launch to the end of the first step. Target: under 3%.
Writes DIR/scaling.md (the tables), DIR/scaling.json (one record per run) and DIR/scaling.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# the Llama of assets/tiny-llama, resized
from overhead import model_config

from fsdp_recipes.console import RawHelpFormatter

REPO = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
# per device, as the default recipe; tokens per step = BATCH x BLOCK x processes
BATCH, BLOCK = 8, 128


def label(name: str, fsdp_version: int | None) -> str:
    return name + (f" (FSDP{fsdp_version})" if fsdp_version else "")


@dataclass(frozen=True)
class Strategy:
    name: str
    config: str
    fsdp_version: int | None
    args: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return label(self.name, self.fsdp_version)


STRATEGIES = [
    Strategy("DDP", "accelerate_configs/ddp.yaml", None),
    Strategy("ZeRO-1", "accelerate_configs/ddp.yaml", None, ("--zero1", "true")),
    Strategy("NO_SHARD", "accelerate_configs/fsdp1/no_shard.yaml", 1),
    Strategy("SHARD_GRAD_OP", "accelerate_configs/zero2.yaml", 2),
    Strategy("SHARD_GRAD_OP", "accelerate_configs/fsdp1/zero2.yaml", 1),
    Strategy("FULL_SHARD", "accelerate_configs/zero3.yaml", 2),
    Strategy("FULL_SHARD", "accelerate_configs/fsdp1/zero3.yaml", 1),
    Strategy("FULL_SHARD + offload", "accelerate_configs/zero3_offload.yaml", 2),
    Strategy("FULL_SHARD + offload", "accelerate_configs/fsdp1/zero3_offload.yaml", 1),
]
# DDP, ZeRO-1 and the FSDP2 configs
QUICK = [s for s in STRATEGIES if s.fsdp_version != 1]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_nprocs(gpus: int) -> list[int]:
    if not gpus:
        # FSDP over gloo needs 2+; 4 oversubscribes 2 cores, which the table then shows
        return [2, 4]
    counts = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= gpus]
    return counts + ([gpus] if gpus not in counts else [])


def launch(
    script: Path, config: str, nproc: int, args: list[str], times: Path, gpus: int
) -> tuple[float, subprocess.CompletedProcess]:
    import socket

    # a free port: two benchmarks (or a test suite) may run at once
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        "accelerate",
        "launch",
        "--config_file",
        str(REPO / config),
        "--num_processes",
        str(nproc),
        "--num_machines",
        "1",
        "--main_process_port",
        str(port),
        str(script),
        *args,
    ]
    env = {**os.environ, "SCALING_STEP_TIMES": str(times), "TOKENIZERS_PARALLELISM": "false"}
    if not gpus:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // nproc))
    started = time.time()
    return started, subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)


def step_stats(times: Path, started: float, first_timed: int, last_timed: int) -> tuple[float, float]:
    """(median seconds per step over steps first_timed..last_timed, seconds from launch to the end of step 1)."""
    ends = json.loads(times.read_text())["step_end"]
    durations = [ends[i] - ends[i - 1] for i in range(first_timed - 1, last_timed)]
    return statistics.median(durations), ends[0] - started


def common_args(model: Path, steps: int, out: Path, gpus: int) -> list[str]:
    args = [
        "--config_name",
        str(model),
        "--tokenizer_name",
        str(REPO / "assets" / "tiny-llama"),
        "--train_file",
        str(REPO / "assets" / "data" / "tiny_corpus.txt"),
        "--block_size",
        str(BLOCK),
        "--per_device_train_batch_size",
        str(BATCH),
        "--max_steps",
        str(steps),
        "--logging_steps",
        "5",
        "--learning_rate",
        "1e-3",
        "--warmup_steps",
        "0",
        "--report_to",
        "none",
        "--output_dir",
        str(out),
    ]
    return args + ([] if gpus else ["--dataloader_pin_memory", "false"])


@dataclass
class Record:
    strategy: str
    fsdp_version: int | None
    config: str
    processes: int
    device: str
    parameters: int
    tokens_per_second: float
    samples_per_second: float
    step_seconds: float
    time_to_first_step_seconds: float
    # per rank, the largest rank: parameters + gradients + optimizer state
    model_state_bytes: int
    # per rank, the largest rank
    peak_memory_bytes: int
    # cuda_max_allocated or rss
    peak_memory_kind: str
    all_gather_share: float | None
    reduce_scatter_share: float | None
    all_reduce_share: float | None
    overlapped_share: float | None


def run_one(
    strategy: Strategy, nproc: int, model: Path, steps: int, warmup: int, work: Path, gpus: int
) -> Record | str:
    out = work / f"{strategy.config.replace('/', '_').removesuffix('.yaml')}{''.join(strategy.args)}-{nproc}"
    times = out.with_suffix(".times.json")
    profile = f"{steps - 1}-{steps}"
    args = common_args(model, steps, out, gpus) + [
        "--save_steps",
        str(10 * steps),
        "--profile_steps",
        profile,
        *strategy.args,
    ]
    started, proc = launch(BENCH / "timed_run.py", strategy.config, nproc, args, times, gpus)
    if proc.returncode != 0:
        return (
            f"{strategy.label} on {nproc}: failed ({proc.returncode}): "
            f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}"
        )
    # the profiled steps are not timed
    step, first = step_stats(times, started, warmup + 1, steps - 2)
    report = json.loads((out / "fsdp_report.json").read_text())
    summary = json.loads((out / "profile" / "summary.json").read_text())
    ranks = report["ranks"]
    cuda = all("cuda_max_allocated_bytes" in r["peak_memory"] for r in ranks)
    peak_key = "cuda_max_allocated_bytes" if cuda else "rss_bytes"
    return Record(
        strategy=strategy.name,
        fsdp_version=strategy.fsdp_version,
        config=strategy.config + "".join(f" {a}" for a in strategy.args),
        processes=nproc,
        device=report["device"].split(":")[0],
        parameters=report["total_param_elements"],
        tokens_per_second=BATCH * BLOCK * nproc / step,
        samples_per_second=BATCH * nproc / step,
        step_seconds=step,
        time_to_first_step_seconds=first,
        model_state_bytes=max(sum(r["bytes"].values()) for r in ranks),
        peak_memory_bytes=max(r["peak_memory"][peak_key] for r in ranks),
        peak_memory_kind=peak_key.removesuffix("_bytes"),
        all_gather_share=summary.get("all_gather_share"),
        reduce_scatter_share=summary.get("reduce_scatter_share"),
        all_reduce_share=summary.get("all_reduce_share"),
        overlapped_share=summary.get("overlapped_share"),
    )


def overhead(model: Path, steps: int, warmup: int, nproc: int, work: Path, gpus: int, repeats: int) -> dict:
    """train_fsdp.py against bench/bare_trainer.py on zero3.yaml, in ABBA order (drift on a shared machine cancels)."""
    config = "accelerate_configs/zero3.yaml"
    runs: dict[str, list[tuple[float, float]]] = {"train_fsdp.py": [], "bare accelerate + Trainer": []}
    order = ["train_fsdp.py", "bare accelerate + Trainer"]
    for i in range(repeats):
        for name in order if i % 2 == 0 else order[::-1]:
            out = work / f"overhead-{name.split()[0].replace('.', '_')}-{i}"
            times = out.with_suffix(".times.json")
            args = common_args(model, steps, out, gpus)
            script = BENCH / "timed_run.py" if name == "train_fsdp.py" else BENCH / "bare_trainer.py"
            if name == "train_fsdp.py":
                args += ["--save_steps", str(10 * steps)]
            started, proc = launch(script, config, nproc, args, times, gpus)
            if proc.returncode != 0:
                sys.exit(f"scaling.py: error: {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            runs[name].append(step_stats(times, started, warmup + 1, steps))
    result = {"config": config, "processes": nproc, "steps": steps, "repeats": repeats}
    for name, measured in runs.items():
        step = statistics.median(m[0] for m in measured)
        result[name] = {
            "tokens_per_second": BATCH * BLOCK * nproc / step,
            "step_seconds": step,
            "time_to_first_step_seconds": statistics.median(m[1] for m in measured),
            "runs_tokens_per_second": [BATCH * BLOCK * nproc / m[0] for m in measured],
        }
    ours, bare = result["train_fsdp.py"]["tokens_per_second"], result["bare accelerate + Trainer"]["tokens_per_second"]
    result["tokens_per_second_lower_by"] = 1 - ours / bare
    return result


def spread(measured: dict) -> str:
    return ", ".join(f"{x:,.0f}" for x in measured["runs_tokens_per_second"])


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def share(record: Record) -> str:
    parts = [
        f"{label} {value:.0%}"
        for label, value in (
            ("AG", record.all_gather_share),
            ("RS", record.reduce_scatter_share),
            ("AR", record.all_reduce_share),
        )
        if value is not None and value >= 0.005
    ]
    return " / ".join(parts) or "-"


def write_markdown(path: Path, records: list[Record], over: dict | None, failures: list[str], header: str) -> None:
    lines = [
        header,
        "",
        "| strategy | config | processes | tokens/s | samples/s | model states per rank (MB) | "
        "peak memory per rank (MB) | communication share of step time | overlapped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {label(r.strategy, r.fsdp_version)} | `{r.config}` | {r.processes} | "
            f"{r.tokens_per_second:,.0f} | {r.samples_per_second:,.1f} | {mb(r.model_state_bytes)} | "
            f"{mb(r.peak_memory_bytes)} "
            f"({r.peak_memory_kind}) | {share(r)} | "
            f"{'-' if r.overlapped_share is None else f'{r.overlapped_share:.0%}'} |"
        )
    if over:
        ours, bare = over["train_fsdp.py"], over["bare accelerate + Trainer"]
        lines += [
            "",
            f"Overhead of this repository's layer (`{over['config']}`, {over['processes']} processes, "
            f"{over['steps']} steps, "
            f"{over['repeats']} runs each in ABBA order, medians):",
            "",
            "| script | tokens/s (each run) | step (s) | launch to end of first step (s) |",
            "|---|---|---|---|",
            f"| train_fsdp.py | {ours['tokens_per_second']:,.0f} ({spread(ours)}) | {ours['step_seconds']:.3f} "
            f"| {ours['time_to_first_step_seconds']:.1f} |",
            f"| bare accelerate + Trainer (bench/bare_trainer.py) | {bare['tokens_per_second']:,.0f} "
            f"({spread(bare)}) | {bare['step_seconds']:.3f} | "
            f"{bare['time_to_first_step_seconds']:.1f} |",
            "",
            f"train_fsdp.py's tokens/s is {over['tokens_per_second_lower_by']:+.1%} lower than the bare "
            "script's (target: under 3%).",
        ]
    if failures:
        lines += ["", "Runs that failed:", *[f"- {f}" for f in failures]]
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, records: list[Record]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, states, memory) = plt.subplots(1, 3, figsize=(16, 4.5))
    series = sorted(
        {(r.strategy, r.fsdp_version) for r in records}, key=lambda k: [s.name for s in STRATEGIES].index(k[0])
    )
    for name, version in series:
        rows = sorted(
            (r for r in records if (r.strategy, r.fsdp_version) == (name, version)), key=lambda r: r.processes
        )
        legend = label(name, version)
        style = "--" if version == 1 else "-"
        speed.plot([r.processes for r in rows], [r.tokens_per_second for r in rows], style, marker="o", label=legend)
        states.plot(
            [r.processes for r in rows], [r.model_state_bytes / 1e6 for r in rows], style, marker="o", label=legend
        )
        memory.plot(
            [r.processes for r in rows], [r.peak_memory_bytes / 1e6 for r in rows], style, marker="o", label=legend
        )
    kind = records[0].peak_memory_kind if records else ""
    speed.set(xlabel="processes", ylabel="tokens/s (all processes)", title="throughput")
    states.set(
        xlabel="processes", ylabel="MB per rank (largest rank)", title="model states (params + grads + optimizer)"
    )
    memory.set(xlabel="processes", ylabel=f"MB per rank ({kind}, largest rank)", title="peak memory")
    for ax in (speed, states, memory):
        ax.set_xticks(sorted({r.processes for r in records}))
        ax.grid(alpha=0.3)
    speed.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1], formatter_class=RawHelpFormatter
    )
    parser.add_argument("--output", required=True, help="folder for scaling.md, scaling.json and scaling.png")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="DDP, ZeRO-1 and the FSDP2 configs only, fewer steps: under 10 minutes on 2 CPU cores",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        action="append",
        help="process counts (repeatable; default 2 and 4 on CPU, 1 2 4 ... all GPUs)",
    )
    parser.add_argument(
        "--strategy", action="append", help="only these configs (e.g. accelerate_configs/zero3.yaml; repeatable)"
    )
    parser.add_argument("--hidden", type=int, default=512, help="model width (the Llama of assets/tiny-llama, resized)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers")
    parser.add_argument(
        "--steps", type=int, help="optimizer steps per run (default 8 with --quick, else 16; the last 2 are profiled)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument(
        "--repeats", type=int, help="runs of each script in the overhead comparison (default 3 with --quick, else 4)"
    )
    parser.add_argument(
        "--no-overhead", action="store_true", help="skip the train_fsdp.py against bare-Trainer comparison"
    )
    command = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(command)
    gpus = gpu_count()
    nprocs = sorted(set(args.nproc or default_nprocs(gpus)))
    strategies = [s for s in (QUICK if args.quick else STRATEGIES) if not args.strategy or s.config in args.strategy]
    steps = args.steps or (8 if args.quick else 16)
    if steps < args.warmup + 4:
        parser.error(
            f"--steps {steps} leaves nothing to time after {args.warmup} warm-up and 2 profiled steps: use "
            f"{args.warmup + 4} or more"
        )
    if not strategies:
        parser.error(f"--strategy matches no config; choose from {', '.join(sorted({s.config for s in STRATEGIES}))}")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    records, failures = [], []
    began = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = model_config(work / "model", args.hidden, args.layers)
        for strategy in strategies:
            for nproc in nprocs:
                # FSDP over gloo needs 2 processes; ZeRO-1 shards over 2+
                if nproc < 2 and (not gpus or strategy.args):
                    continue
                print(f"[{time.time() - began:5.0f} s] {strategy.label}, {nproc} processes", flush=True)
                result = run_one(strategy, nproc, model, steps, args.warmup, work, gpus)
                if isinstance(result, str):
                    failures.append(result)
                    print(f"  {result}", flush=True)
                    continue
                records.append(result)
                print(
                    f"  {result.tokens_per_second:,.0f} tokens/s, {mb(result.peak_memory_bytes)} MB peak "
                    f"({result.peak_memory_kind}), "
                    f"{mb(result.model_state_bytes)} MB model states per rank",
                    flush=True,
                )
        over = None
        if not args.no_overhead:
            # every GPU; on CPU the 2 processes the shipped configs launch
            nproc = max(nprocs) if gpus else 2
            repeats = args.repeats or (3 if args.quick else 4)
            print(
                f"[{time.time() - began:5.0f} s] overhead: train_fsdp.py against bench/bare_trainer.py, {nproc} "
                "processes, "
                f"{repeats} runs each",
                flush=True,
            )
            over = overhead(model, max(steps, 10), args.warmup, nproc, work, gpus, repeats)
            print(f"  train_fsdp.py tokens/s lower by {over['tokens_per_second_lower_by']:+.1%}", flush=True)
    from fsdp_recipes.compat.cpu_fsdp import cpu_name, native_bf16, read_cpuinfo

    cpuinfo = read_cpuinfo()
    device = (
        f"{gpus} x {__import__('torch').cuda.get_device_name()}"
        if gpus
        else f"CPU ({os.cpu_count()} cores, {cpu_name(cpuinfo)}), FSDP over gloo"
    )
    # train_fsdp.py and bench/bare_trainer.py compute in fp32 on a CPU without native bf16
    # (fsdp_recipes.compat.cpu_fsdp)
    precision = (
        "fp32 (this CPU has no native bf16)" if not gpus and native_bf16(cpuinfo) is False else "bf16 mixed precision"
    )
    params = records[0].parameters if records else 0
    header = (
        f"# Scaling: {device}\n\nLlama {params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers), "
        f"{BATCH} x {BLOCK} tokens per process per step, {precision}, {steps} steps per run "
        f"({args.warmup} warm-up and 2 profiled steps not timed). "
        f"`{shlex.join(['python', 'bench/scaling.py', *command])}` "
        f"took {time.time() - began:.0f} s."
    )
    (output / "scaling.json").write_text(
        json.dumps(
            {"device": device, "records": [asdict(r) for r in records], "overhead": over, "failures": failures},
            indent=2,
        )
        + "\n"
    )
    write_markdown(output / "scaling.md", records, over, failures, header)
    if records:
        write_plot(output / "scaling.png", records)
    print(f"wrote {output / 'scaling.md'}, scaling.json, scaling.png ({time.time() - began:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
