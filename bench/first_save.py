"""What the first background save stalls training for: its host copy made on the training thread at the save (torch's
helper, as before) against built around buffers made ahead on a thread (fsdp_recipes.compat.host_copy.HostBuffers,
what background saves do now), each kind in fresh processes, alternated ``--repeats`` times (the pinned-memory cache
of one would serve the other in one process).

    PYTHONPATH=. python bench/first_save.py                      # on a GPU: 1 GB of fp32 weights + Adam, ~1 minute
    PYTHONPATH=. python bench/first_save.py --gigabytes 0.01 --repeats 1   # a check on CPU: seconds
    PYTHONPATH=. python bench/first_save.py --kinds at-save,ahead,ahead-allocator,ahead-pageable   # the ways compared

One process, one rank's shards as FSDP2 holds them (DTensors on a one-rank mesh; Llama-3.2-1B's layer shapes,
``--gigabytes`` of fp32 weights and twice that of Adam's moments), staged as a background checkpoint stages them
(ReusedHostCopy for the model's save, one for the optimizer's). Reported per kind: the first save's staging on the
training thread, a later save's (the reused copy: the floor), and for "ahead" how long its thread took and how much
slower a fixed run of matrix multiplications on the training thread went while it worked (its interference). Every
staged copy is checked against the live tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fsdp_recipes.console import HelpFormatter  # noqa: E402

# Llama-3.2-1B
HIDDEN, KV, MLP = 2048, 512, 8192
LAYER = [
    (HIDDEN, HIDDEN),
    (KV, HIDDEN),
    (KV, HIDDEN),
    (HIDDEN, HIDDEN),
    (MLP, HIDDEN),
    (MLP, HIDDEN),
    (HIDDEN, MLP),
    (HIDDEN,),
    (HIDDEN,),
]


def shapes(gigabytes: float) -> list[tuple]:
    """Whole layers of weights up to ``gigabytes`` of fp32 (at least one tensor)."""
    out, total = [], 0
    while True:
        for shape in LAYER:
            size = 4 * (shape[0] * (shape[1] if len(shape) > 1 else 1))
            if out and total + size > gigabytes * 1e9:
                return out
            out.append(shape)
            total += size


def synchronize(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def child(kind: str, gigabytes: float) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp_recipes.compat.host_copy import HostBuffers, ReusedHostCopy

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, device_id=device if cuda else None)
    mesh = init_device_mesh(device.type, (1,))
    torch.manual_seed(0)
    dtensor = lambda shape: distribute_tensor(torch.randn(shape, device=device), mesh, [Shard(0)])  # noqa: E731
    params = [dtensor(s) for s in shapes(gigabytes)]
    moments = [(dtensor(p.shape), dtensor(p.shape)) for p in params]
    model = {"model": {f"w{i}": p for i, p in enumerate(params)}}
    optim = {
        "optimizer": {
            "state": {
                f"w{i}": {"exp_avg": a, "exp_avg_sq": b, "step": torch.tensor(1.0)} for i, (a, b) in enumerate(moments)
            },
            "param_groups": [{"lr": 1e-5, "params": [f"w{i}" for i in range(len(params))]}],
        }
    }
    # on CPU a check of the machinery, not a measurement: a stretch of work 64x smaller (2048^3 took ~1.5 s a call)
    side = 2048 if cuda else 512
    x = torch.randn(side, side, device=device)

    # a fixed stretch of training-like work on this thread
    def work(n: int = 40 if cuda else 4) -> float:
        synchronize(torch, device)
        began = time.perf_counter()
        for _ in range(n):
            y = x @ x
        del y
        synchronize(torch, device)
        return time.perf_counter() - began

    work()
    alone = statistics.median(work() for _ in range(5))
    ahead, during = None, None
    # as after the first optimizer step: the thread starts, training goes on
    if kind.startswith("ahead"):
        began = time.perf_counter()
        pin = None if not cuda or kind == "ahead-pageable" else "allocator" if kind == "ahead-allocator" else "register"
        ahead = HostBuffers(HostBuffers.shapes_of(params + [t for pair in moments for t in pair]), pin=pin)
        timed = []
        while ahead.busy() and time.perf_counter() - began < 120:
            timed.append(work())
        during = statistics.median(timed) if timed else None
    stagers = [ReusedHostCopy(ahead=ahead), ReusedHostCopy(ahead=ahead)]

    def save() -> tuple[float, list]:
        synchronize(torch, device)
        began = time.perf_counter()
        staged = [stagers[0].stage(model), stagers[1].stage(optim)]
        synchronize(torch, device)
        return time.perf_counter() - began, staged

    first, staged = save()
    report = ahead.close() if ahead is not None else None
    for p in params[:3]:
        p.to_local().add_(1.0)
    later, again = save()
    for copy, live in (
        (again[0]["model"], model["model"]),
        (again[1]["optimizer"]["state"], optim["optimizer"]["state"]),
    ):
        for name in list(live)[:4] + list(live)[-2:]:
            pairs = (
                [(copy[name], live[name])]
                if not isinstance(live[name], dict)
                else [(copy[name][k], live[name][k]) for k in ("exp_avg", "exp_avg_sq")]
            )
            for c, v in pairs:
                assert c.to_local().device.type == "cpu" and torch.equal(c.to_local(), v.to_local().cpu()), name
    # reused
    assert staged[0]["model"]["w0"].to_local().data_ptr() == again[0]["model"]["w0"].to_local().data_ptr()
    dist.destroy_process_group()
    staged_bytes = sum(t.numel() * t.element_size() for t in params + [t for pair in moments for t in pair])
    return {
        "kind": kind,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "staged_bytes": staged_bytes,
        "first_save_seconds": round(first, 4),
        "later_save_seconds": round(later, 4),
        "work_seconds_alone": round(alone, 5),
        "work_seconds_while_ahead": None if during is None else round(during, 5),
        "ahead": report,
    }


def launch(kind: str, gigabytes: float) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, "--gigabytes", str(gigabytes)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"bench/first_save.py: the {kind} run failed (exit status {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


KINDS = {
    "at-save": "made at the save (before)",
    "ahead": "made ahead (now): faulted in on 4 threads, then page-locked (cudaHostRegister) on a GPU",
    "ahead-allocator": "made ahead by torch's pinned allocator (GPU)",
    "ahead-pageable": "made ahead, faulted in, not page-locked",
}


def table(runs: list[dict]) -> str:
    kinds = {k: [r for r in runs if r["kind"] == k] for k in KINDS if any(r["kind"] == k for r in runs)}
    med = lambda k, key: statistics.median(r[key] for r in kinds[k])  # noqa: E731
    lines = [
        f"First background save's staging on the training thread, {runs[0]['staged_bytes'] / 2**30:.2f} GiB of "
        "one rank's "
        f"shards (weights + Adam), {runs[0]['device']}, torch {runs[0]['torch']}; medians of "
        f"{len(kinds['at-save'])} fresh "
        "process(es) per kind, alternated:",
        "",
        "| host copy | first save (s) | later save (s) | buffers made ahead in (s) | training-thread work "
        "while they were made / alone |",
        "|---|---|---|---|---|",
    ]
    for kind, rows in kinds.items():
        if kind == "at-save":
            lines.append(
                f"| {KINDS[kind]} | {med(kind, 'first_save_seconds'):.3f} | "
                f"{med(kind, 'later_save_seconds'):.3f} | - | - |"
            )
            continue
        slowdown = [
            r["work_seconds_while_ahead"] / r["work_seconds_alone"] for r in rows if r["work_seconds_while_ahead"]
        ]
        lines.append(
            f"| {KINDS[kind]} | {med(kind, 'first_save_seconds'):.3f} | {med(kind, 'later_save_seconds'):.3f} | "
            f"{statistics.median(r['ahead']['seconds'] for r in rows):.3f} | "
            f"{(f'{statistics.median(slowdown):.2f}x' if slowdown else 'finished before the first measurement')} |"
        )
    lines.append("")
    for kind, rows in kinds.items():
        if kind != "at-save":
            ratio = med(kind, "first_save_seconds") / med("at-save", "first_save_seconds")
            lines.append(
                f"First save, {KINDS[kind]}, against made at the save: {ratio:.2f}x. Buffers taken / made at the save: "
                f"{rows[0]['ahead']['tensors_taken']} / {rows[0]['ahead']['tensors_made_at_save']}."
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1], formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--gigabytes", type=float, default=1.0, help="fp32 weights of the rank's shards (Adam adds twice that)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per kind, alternated")
    parser.add_argument("--output", type=Path, help="folder for README.md and results.json (else printed only)")
    parser.add_argument(
        "--kinds", default="at-save,ahead", help=f"comma-separated, of: {', '.join(KINDS)} (page-locking: GPU only)"
    )
    parser.add_argument("--child", choices=tuple(KINDS), help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.gigabytes <= 0 or a.repeats < 1:
        parser.error("--gigabytes must be above 0 and --repeats at least 1")
    if a.child:
        print(json.dumps(child(a.child, a.gigabytes)))
        return 0
    kinds = a.kinds.split(",")
    if "at-save" not in kinds or any(k not in KINDS for k in kinds):
        parser.error(f"--kinds: at-save (the baseline) and any of {', '.join(KINDS)}")
    runs = [launch(kind, a.gigabytes) for _ in range(a.repeats) for kind in kinds]
    text = table(runs)
    print(text, end="")
    if a.output:
        a.output.mkdir(parents=True, exist_ok=True)
        (a.output / "README.md").write_text(
            text + f"\n    PYTHONPATH=. python bench/first_save.py --gigabytes {a.gigabytes} --repeats {a.repeats} "
            f"--kinds {a.kinds}\n"
        )
        (a.output / "results.json").write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
