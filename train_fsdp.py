"""Train a causal language model with Fully Sharded Data Parallel, through accelerate and the Trainer.

    accelerate launch --config_file accelerate_configs/zero3.yaml train_fsdp.py [recipe.yaml] [--flag value ...]

With no recipe it trains the embedded default (a tiny Llama built from assets/, no hub, no GPU needed).
A recipe YAML sets the defaults of ModelArguments, DataArguments and TrainingArguments; flags override
it. `python train_fsdp.py --help` lists every argument.

The run, in the order below (fsdp_recipes.train.run.Run):

- parse:     read and check the recipe and flags; nothing is moved, patched or joined (fsdp_recipes.config)
- preflight: join the process group, decide the resume, take output_dir, write run_args.json
- build:     tokenizer, data, model and the FSDPTrainer, checked against the checkpoint it resumes
- train:     train, evaluate, save the metrics and loss.png; SIGTERM or SIGUSR1 saves a checkpoint and stops
- export:    output_dir/model/, the model alone (and output_dir/adapter/ for LoRA); --push_to_hub uploads it
- close:     a stop that came after the last step changed nothing: exit 0

Every error, stop and exit code is decided in one place: fsdp_recipes/train/exits.py.
"""

from fsdp_recipes.train import exits

# Before the seconds-long imports of torch and transformers: a stop or Ctrl-C during them gives the one line of
# any stop before training, not a bare exit 143 or an import traceback.
exits.catch_stops_while_importing()

from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.train.run import Run


def main(model_args, data_args, plan) -> None:
    run = Run(model_args, data_args, plan)

    # ---------- preflight: the process group, the resume decision, output_dir held ----------
    run.preflight()

    # ---------- build and train (a resumed checkpoint already at max_steps has nothing left to train) ----------
    if not run.finished:
        run.build()
        run.train()

    # ---------- export: output_dir/model/, then the upload ----------
    run.export()
    run.close()


if __name__ == "__main__":
    exits.run_as_script(lambda: main(*parse_args()))
