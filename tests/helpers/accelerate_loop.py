"""A plain accelerate training loop, as users write one without the Trainer: Accelerator, prepare, one AdamW step,
``accelerator.save_state(OUT)``; the true weights, gathered by torch from the live model, go to OUT.truth.safetensors.

    accelerate launch --config_file accelerate_configs/fsdp1/zero3.yaml tests/helpers/accelerate_loop.py OUT

fsdp_recipes.compat.cpu_fsdp only makes accelerate's FSDP real on a machine without a GPU (elsewhere it does nothing);
what save_state writes is accelerate's own.
"""

import sys
import warnings
from pathlib import Path

import torch

from fsdp_recipes.compat import cpu_fsdp

cpu_fsdp.enable()
warnings.filterwarnings("ignore")

from accelerate import Accelerator  # noqa: E402 (after the CPU patch, which must precede accelerate's state)
from safetensors.torch import save_file  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "assets" / "tiny-llama"

out = Path(sys.argv[1])
accelerator = Accelerator()
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
batch = torch.randint(
    0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(accelerator.process_index)
)
accelerator.backward(model(input_ids=batch, labels=batch).loss)
optimizer.step()
accelerator.save_state(str(out))
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
if accelerator.is_main_process:
    save_file({k: v.contiguous() for k, v in full.items()}, str(out) + ".truth.safetensors")
accelerator.wait_for_everyone()
# destroys the process group: gloo threads left to interpreter teardown can SIGABRT
accelerator.end_training()
