"""train_fsdp.py with a fault injected, for the fault-injection tests: the real script, launched for real,
and a real SIGKILL at a chosen point.

    FSDP_FAULT="<ranks>:<point>:<step>"   ranks: all | 0 | 1 | 0,1 ...
      point step      rank(s) die before the first micro-batch after <step> optimizer steps
      point optimizer rank(s) die while checkpoint-<step> is written: model shards done, optimizer shards not begun
      point rng       rank(s) die while checkpoint-<step> is written: all shards done, their RNG state file not begun
      point final     rank(s) die as the final model folder is about to be written (<step> is ignored)
      point slowexport rank(s) sleep <step> seconds before writing their part of the final model folder (after the
                      export's last collective): a conversion slower than --ddp_timeout
      point heldsave  rank(s)' background writes of checkpoint-<step> (asynchronous checkpoints) wait until training
                      has reached step <step> + 2: the write can only finish while training goes on
      point killheldsave  the same, and rank(s) die at step <step> + 2, checkpoint-<step> still being written
      point raiseheldsave the same, and rank(s) release the write and raise an error in that step
      point sigtermheldsave the same, and rank 0 releases it and sends SIGTERM to the launcher and every rank then
      point sigterm   rank(s) send SIGTERM to the launcher and every rank at once (as SLURM does to a job step)
                      before the first micro-batch after <step> optimizer steps
      point usr1      rank(s) send SIGUSR1 to themselves only, at the same moment (the others must stop alike)
      point early     rank(s) send <step> (TERM or USR1) to themselves while the model loads (before training)
      point sigint    rank(s) send SIGINT to the launcher's process group, as Ctrl-C at a terminal does (torch
                      elastic starts each rank in a session of its own: the launcher forwards it to them)
    FSDP_SLOW_SAVE=<step>:<seconds>  every rank's background write of checkpoint-<step> sleeps <seconds> before it
                                reads or writes anything (combines with FSDP_FAULT)
    FSDP_EXPORT_PART_MIN=<bytes>  the final export's smallest shard (export_parts.PART_MIN_BYTES): the tiny model in
                                  shards for every rank
    FSDP_NOTE_BEFORE_CLEANUP=<name>  rank 0 writes a file <name> into the newest checkpoint-N just before the Trainer's
                                end-of-training cleanup, as a user's tool that keeps its notes beside a checkpoint would
    FSDP_DUMP_OPTIMIZER=<dir>[:<name>,...]  after resuming, save the optimizer as loaded (accelerate's own save)
                                into <dir>/<output_dir's name>; with names, only the runs whose output_dir has one
                                (the other runs of a sequence load as train_fsdp.py does, nothing added)
    FSDP_DUMP_EVAL=<dir>        each rank writes the metrics of each evaluation to <dir>/rank<R>-step<S>.json
    FSDP_RANK_CWD=<rank>:<dir>  that rank works in <dir>: a relative --output_dir is another folder for it, as for a
                                node whose filesystem shows other contents at the same path (a stale network mount)
    FSDP_COUNT_LOADS=<dir>      each rank appends the file of every torch.load from a file to <dir>/rank<R>.txt
"""

import os
import runpy
import signal
import sys
from pathlib import Path

from transformers import Trainer

from fsdp_recipes.compat import internals
from fsdp_recipes.train.trainer import FSDPTrainer

REPO = Path(__file__).resolve().parents[2]


def _dies(ranks: str) -> bool:
    return ranks == "all" or os.environ["RANK"] in ranks.split(",")


def _launcher_and_ranks() -> list[int]:
    """This rank's parent (the launcher, which runs torch elastic's agent in-process) and the parent's children."""
    launcher = os.getppid()
    children = []
    for task in Path(f"/proc/{launcher}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    return [launcher, *children]


def _before_checkpoint_write(step: str, before) -> None:
    """``before()`` runs in DCP's writing thread ahead of each write of checkpoint-<step>'s shard files."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def write_data_after(self, *args, **kwargs):
        if Path(str(self.path)).parent.name == f"checkpoint-{step}":
            before()
        return write_data(self, *args, **kwargs)

    FileSystemWriter.write_data = write_data_after


def _die() -> None:
    print(
        f"fault injection: SIGKILL rank {os.environ['RANK']} ({os.environ['FSDP_FAULT']})", file=sys.stderr, flush=True
    )
    os.kill(os.getpid(), signal.SIGKILL)


if os.environ.get("FSDP_FAULT"):
    ranks, point, step = os.environ["FSDP_FAULT"].split(":")
    if point in ("sigterm", "usr1", "sigint"):
        training_step = Trainer.training_step
        sent = []

        def training_step_then_signal(self, *args, **kwargs):
            if self.state.global_step == int(step) and _dies(ranks) and not sent:
                sent.append(point)
                print(f"fault injection: {point} from rank {os.environ['RANK']}", file=sys.stderr, flush=True)
                if point == "sigterm":
                    for pid in _launcher_and_ranks():
                        os.kill(pid, signal.SIGTERM)
                elif point == "sigint":
                    os.killpg(os.getpgid(os.getppid()), signal.SIGINT)
                else:
                    os.kill(os.getpid(), signal.SIGUSR1)
            return training_step(self, *args, **kwargs)

        Trainer.training_step = training_step_then_signal
    elif point == "step":
        training_step = Trainer.training_step

        def training_step_or_die(self, *args, **kwargs):
            if self.state.global_step == int(step) and _dies(ranks):
                _die()
            return training_step(self, *args, **kwargs)

        Trainer.training_step = training_step_or_die
    elif point == "optimizer":
        import transformers.trainer

        # the Trainer saves model shards just before
        save_optimizer = transformers.trainer.save_fsdp_optimizer

        def save_optimizer_or_die(*args, **kwargs):
            if Path(args[4]).name == f"checkpoint-{step}" and _dies(ranks):
                _die()
            return save_optimizer(*args, **kwargs)

        transformers.trainer.save_fsdp_optimizer = save_optimizer_or_die
    elif point == "rng":

        def save_rng_state_or_die(self, output_dir):
            if Path(output_dir).name == f"checkpoint-{step}" and _dies(ranks):
                _die()
            return save_rng_state(self, output_dir)

        save_rng_state = internals.patch("transformers.trainer.Trainer._save_rng_state", save_rng_state_or_die)
    elif point == "early":
        import fsdp_recipes.train.modeling

        def load_model_after_signal(*args, **kwargs):
            if _dies(ranks):
                print(
                    f"fault injection: SIG{step} to rank {os.environ['RANK']} while loading",
                    file=sys.stderr,
                    flush=True,
                )
                os.kill(os.getpid(), getattr(signal, f"SIG{step}"))
            return load_model(*args, **kwargs)

        # run.py imports it by name after this
        load_model = fsdp_recipes.train.modeling.load_model
        fsdp_recipes.train.modeling.load_model = load_model_after_signal
    elif point == "final":
        import fsdp_recipes.train.export

        def save_final_model_or_die(*args, **kwargs):
            if _dies(ranks):
                _die()
            return save_final_model(*args, **kwargs)

        # run.py imports it by name after this
        save_final_model = fsdp_recipes.train.export.save_final_model
        fsdp_recipes.train.export.save_final_model = save_final_model_or_die
    elif point == "slowexport":
        import time

        import fsdp_recipes.train.export_parts

        # save_final_model calls it through the module
        write_part = fsdp_recipes.train.export_parts.write_part

        def slow_write_part(*args, **kwargs):
            if _dies(ranks):
                print(
                    f"fault injection: rank {os.environ['RANK']} writes its part of the final model {step} s late",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(float(step))
            return write_part(*args, **kwargs)

        fsdp_recipes.train.export_parts.write_part = slow_write_part
    elif point in ("heldsave", "killheldsave", "raiseheldsave", "sigtermheldsave"):
        import threading

        released = threading.Event()
        training_step = Trainer.training_step
        if _dies(ranks):
            _before_checkpoint_write(step, released.wait)

        def training_step_then_release(self, *args, **kwargs):
            if self.state.global_step == int(step) + 2 and _dies(ranks):
                print(
                    f"fault injection: checkpoint-{step} still being written at step {self.state.global_step}",
                    file=sys.stderr,
                    flush=True,
                )
                if point == "killheldsave":
                    _die()
                released.set()
                # as SLURM signals a job step
                if point == "sigtermheldsave" and os.environ["RANK"] == "0":
                    for pid in _launcher_and_ranks():
                        os.kill(pid, signal.SIGTERM)
                if point == "raiseheldsave":
                    raise RuntimeError(f"fault injection: an error in step {self.state.global_step + 1}")
            return training_step(self, *args, **kwargs)

        Trainer.training_step = training_step_then_release
    else:
        raise SystemExit(
            f"FSDP_FAULT point {point!r}: use step, optimizer, rng, final, slowexport, early, sigterm, usr1, sigint, "
            "heldsave, killheldsave, raiseheldsave or sigtermheldsave"
        )

if os.environ.get("FSDP_SLOW_SAVE"):
    import time

    slow_step, slow_seconds = os.environ["FSDP_SLOW_SAVE"].split(":")
    _before_checkpoint_write(slow_step, lambda: time.sleep(float(slow_seconds)))

if os.environ.get("FSDP_EXPORT_PART_MIN"):
    import fsdp_recipes.train.export_parts

    fsdp_recipes.train.export_parts.PART_MIN_BYTES = int(os.environ["FSDP_EXPORT_PART_MIN"])

if os.environ.get("FSDP_NOTE_BEFORE_CLEANUP"):
    # FSDPTrainer's override calls it through super()
    finalize_training = Trainer._finalize_training

    def note_then_finalize(self, *args, **kwargs):
        if os.environ["RANK"] == "0":
            newest = max(Path(self.args.output_dir).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
            (newest / os.environ["FSDP_NOTE_BEFORE_CLEANUP"]).write_text("a user's notes\n")
        return finalize_training(self, *args, **kwargs)

    Trainer._finalize_training = note_then_finalize

if os.environ.get("FSDP_DUMP_OPTIMIZER"):
    load = FSDPTrainer._load_optimizer_and_scheduler

    dump_dir, _, dumped = os.environ["FSDP_DUMP_OPTIMIZER"].partition(":")

    def load_then_dump(self, checkpoint):
        load(self, checkpoint)
        if checkpoint is not None and (not dumped or Path(self.args.output_dir).name in dumped.split(",")):
            from accelerate.utils import save_fsdp_optimizer

            save_fsdp_optimizer(
                self.accelerator.state.fsdp_plugin,
                self.accelerator,
                self.optimizer,
                self.model,
                str(Path(dump_dir) / Path(self.args.output_dir).name),
            )

    FSDPTrainer._load_optimizer_and_scheduler = load_then_dump

if os.environ.get("FSDP_DUMP_EVAL"):
    evaluate = FSDPTrainer.evaluate

    def evaluate_then_dump(self, *args, **kwargs):
        import json

        metrics = evaluate(self, *args, **kwargs)
        path = Path(os.environ["FSDP_DUMP_EVAL"]) / f"rank{os.environ['RANK']}-step{self.state.global_step}.json"
        path.write_text(json.dumps(metrics))
        return metrics

    FSDPTrainer.evaluate = evaluate_then_dump

if os.environ.get("FSDP_RANK_CWD"):
    rank, folder = os.environ["FSDP_RANK_CWD"].split(":", 1)
    if os.environ["RANK"] == rank:
        os.chdir(folder)

if os.environ.get("FSDP_COUNT_LOADS"):
    import torch

    torch_load = torch.load

    def load_counted(f, *args, **kwargs):
        # a file (DCP also loads from memory)
        if isinstance(name := getattr(f, "name", f), (str, os.PathLike)):
            with open(Path(os.environ["FSDP_COUNT_LOADS"]) / f"rank{os.environ['RANK']}.txt", "a") as record:
                record.write(f"{os.path.abspath(name)}\n")
        return torch_load(f, *args, **kwargs)

    torch.load = load_counted

sys.argv[0] = str(REPO / "train_fsdp.py")
runpy.run_path(str(REPO / "train_fsdp.py"), run_name="__main__")
