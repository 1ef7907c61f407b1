"""Per-GPU memory of FSDP (and DDP, ZeRO-1) training, from the ZeRO formulas plus activations.

Model states with mixed precision keep fp32 master weights: per parameter 4 bytes of weights, 4 of gradients
and, with Adam, 8 of optimizer state (m and v): 16 bytes, divided over the S processes that shard them
(S = N for FULL_SHARD and SHARD_GRAD_OP, S = processes per node for HYBRID_SHARD, S = 1 for NO_SHARD and DDP).
ZeRO-1 (DDP + ZeroRedundancyOptimizer) shards only the optimizer state: 8P + 8P/N.
On top: the bf16 all-gather working set (the unit being computed and the one prefetched), bf16 parameters held
from forward to backward (2 bytes per parameter: SHARD_GRAD_OP's gathered ones, and DDP's and ZeRO-1's autocast
copies of the fp32 weights, which the matmuls save for backward), and activations.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from fsdp_recipes.compat import internals
from fsdp_recipes.config.strategy import shipped_configs

GiB = 1024**3
# state bytes per parameter
OPTIMIZER_BYTES = {"adamw": 8, "adamw_8bit": 2, "sgd_momentum": 4, "sgd": 0}
STRATEGIES = ["DDP", "ZERO1", "NO_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "FULL_SHARD"]
# no FSDP: whole parameters and gradients on every process
REPLICATED = ("DDP", "ZERO1")
# Per-step communication, cheapest first: the order in which --gpu-memory lists the shipped configs.
COMMUNICATION_ORDER = ["DDP", "NO_SHARD", "ZERO1", "SHARD_GRAD_OP", "HYBRID_SHARD", "FULL_SHARD"]


@dataclass
class ModelShape:
    params: int
    hidden: int | None = None
    layers: int | None = None
    vocab: int | None = None
    heads: int | None = None
    # parameters of the largest FSDP unit (a decoder layer or the embeddings)
    largest_unit: int | None = None
    # the MLP's width
    intermediate: int | None = None
    # key/value heads x head dim (GQA: less than hidden)
    kv_width: int | None = None
    # a gated MLP (down(act(gate(x)) * up(x)): Llama, Mistral, Qwen), RMSNorm decoders
    gated: bool | None = None
    # query heads x head dim (Qwen3, Gemma: not the hidden size); None: hidden
    q_width: int | None = None
    kv_heads: int | None = None
    # an RMSNorm on each query and key head (Qwen3, OLMo2)
    qk_norm: bool = False
    # config.model_type: whether Liger has kernels for the family
    model_type: str | None = None


@dataclass
class Setup:
    strategy: str = "FULL_SHARD"
    nproc_per_node: int = 8
    nnodes: int = 1
    offload: bool = False
    # bf16/fp16 mixed precision with fp32 master weights, or fp32
    precision: str = "bf16"
    optimizer: str = "adamw"
    micro_batch: int = 1
    seq_len: int = 2048
    activation_checkpointing: bool = False
    # use_liger_kernel: Liger's fused linear cross-entropy computes the loss chunk by chunk, never the whole
    # [tokens, vocab] logits, so the logits term is left out (an upper bound then: bench/results/h200/gpu-check-11)
    fused_loss: bool = False


@dataclass
class Estimate:
    shard_group: int
    params: float
    grads: float
    optimizer: float
    gathered_params: float
    all_gather_working_set: float
    activations: float
    gpu_total: float
    cpu_offload_per_node: float
    cpu_loading_per_node: float
    cpu_merging: float
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


# What a parameter count looks like, valid or not ('7B', '-5', '1e999B', 'nan'): such a text is never taken for a
# hub id or a folder, so a bad count is refused as one rather than looked up.
COUNT_LIKE = re.compile(r"\s*[-+]?(\d[\d.]*|\.\d+|nan|inf(inity)?)(e[-+]?\d+)?\s*[kmbt]?\s*", re.IGNORECASE)


# 100T: over ten times the largest model trained; a count beyond it is a typo, not a model
MAX_PARAMS = 10**14


def parse_count(text: str) -> int:
    """'7B', '175b', '350M', '1.5e9' or '124000000' -> an integer parameter count (from 1 to MAX_PARAMS)."""
    m = re.fullmatch(r"\s*([-+]?(?:[\d.]+(?:e[-+]?\d+)?|nan|inf(?:inity)?))\s*([kmbt]?)\s*", text, re.IGNORECASE)
    try:
        count = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()] if m else None
    # '1.2.3'
    except ValueError:
        count = None
    if count is None:
        raise ValueError(f"{text!r} is not a parameter count: give one such as 7B, 350M or 1.5e9")
    if count != count or count in (float("inf"), float("-inf")):
        raise ValueError(f"{text!r} is not a finite number: give a parameter count such as 7B or 350M")
    if count < 0:
        raise ValueError(
            f"{text!r} is not a parameter count: it is negative (a model has at least 1 parameter, e.g. 7B, 350M)"
        )
    if count < 1:
        raise ValueError(f"{text!r} is not a parameter count: it is less than 1 (give one such as 7B or 350M)")
    if count > MAX_PARAMS:
        raise ValueError(
            f"{text!r} is not the size of any model: {count:.3g} parameters is more than 100T (1e14), ten times "
            "the largest trained; check the number and its suffix (K, M, B, T)"
        )
    return int(count)


def _local_config(model: str):
    """The config.json a model text names on this machine (a folder holding one, or the file itself), checked to
    be a readable JSON file within bounds; None for a hub id. A text is taken as a path when it exists or is written
    as one (absolute, ./, ../, ~): /dev/zero or a FIFO would otherwise reach transformers' reader (or be sent to the
    hub as a repo id, with an error about repo names)."""
    import os
    from pathlib import Path

    from fsdp_recipes.bounded import JSON_LIMIT, load_json

    # a str, as given: Path would drop a leading ./ from the messages
    path = os.path.expanduser(model)
    if not (os.path.lexists(path) or os.path.isabs(path) or model.startswith((".", "~"))):
        return None
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(
                f"model folder {model!r} holds no config.json: give a folder save_pretrained wrote, its "
                "config.json, or a hub id"
            )
        path = os.path.join(path, "config.json")
    # UnreadableFile (a ValueError) names the file and what is wrong
    load_json(path, "model config", JSON_LIMIT)
    return Path(path)


def model_shape(model: str, revision: str | None = None) -> ModelShape:
    """From a parameter count ('7B'), or a hub id (its config at ``revision``, None: main) / folder / config.json
    (only the config is read: meta device)."""
    if COUNT_LIKE.fullmatch(model):
        return ModelShape(params=parse_count(model))
    # 7,000,000,000: a count, written with separators
    if COUNT_LIKE.fullmatch(model.replace(",", "").replace("_", "")):
        raise ValueError(f"{model!r}: write the parameter count without separators, e.g. 7e9 or 7B")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_recipes.config.model_source import config_size_problem, hub_config_problem, one_line, remote_code_problem

    local = _local_config(model)
    source = model if local is None else str(local.parent if local.name == "config.json" else local)
    if (
        problem := (local is None and hub_config_problem(model, revision))
        or remote_code_problem(source, trust_remote_code=False, revision=revision)
        or config_size_problem(source, revision)
    ):
        raise ValueError(f"{model} {one_line(problem)}")
    # never prompts, never runs a folder's code
    config = AutoConfig.from_pretrained(source, trust_remote_code=False, revision=revision)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    params = sum(p.numel() for p in skeleton.parameters())
    layer_types = set(internals.attr(skeleton, "transformers.PreTrainedModel._no_split_modules") or [])
    units = [sum(p.numel() for p in m.parameters()) for m in skeleton.modules() if type(m).__name__ in layer_types]
    embed = skeleton.get_input_embeddings().weight.numel()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    names = {n for n, _ in skeleton.named_parameters()}
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ModelShape(
        params=params,
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        vocab=config.vocab_size,
        heads=heads,
        largest_unit=max(units + [embed]),
        intermediate=getattr(config, "intermediate_size", None),
        kv_width=kv_heads * head_dim,
        q_width=heads * head_dim,
        kv_heads=kv_heads,
        gated=any(n.endswith(("mlp.gate_proj.weight", "mlp.gate_up_proj.weight")) for n in names),
        qk_norm=any(n.endswith("self_attn.q_norm.weight") for n in names),
        model_type=config.model_type,
    )


# bytes per token and vocabulary entry at the loss's peak: three fp32 [tokens, vocab] tensors (activation_bytes)
LOGITS_PEAK_BYTES = 12

# CUDA's fused attention kernels keep four tensors of the key/value width per layer beyond what the model saves
# (bench/results/h200/gpu-check-8: 0.26 GiB in sdpa_attention_forward over 16 layers of 4,096 tokens x 512 wide, bf16)
CUDA_ATTENTION_KV_TENSORS = 4


def saved_per_token(shape: ModelShape, width: int) -> float:
    """Bytes one decoder layer of a gated-MLP, RMSNorm model (transformers' Llama family) saves for backward per
    token, computing in ``width``-byte floats, as its code does it: each RMSNorm its input upcast to fp32 (the input
    itself in fp32), the normalized and the scaled output and its fp32 rsqrt (2 x (4h + 2wh + 4)); the rotated query
    and the attention output reshaped for o_proj (2wq, q the query heads' width); gate, up, act(gate) and their product
    (4wI); the rotated key and the value (2w kv); attention's fp32 log-sum-exp per head (4 heads); with a norm on each
    query and key head (Qwen3) its fp32 upcast, output and rsqrt ((4 + w)(q + kv) + 4 (heads + kv heads)). Counted
    with autograd's saved-tensor hooks on CPU over generated shapes (tests/unit/config/test_memory_activations.py)."""
    h, w = shape.hidden, width
    q = shape.q_width or h
    body = (
        2 * (4 * h + 2 * w * h + 4) + 2 * w * q + 4 * w * shape.intermediate + 2 * w * shape.kv_width + 4 * shape.heads
    )
    if shape.qk_norm:
        body += (4 + w) * (q + shape.kv_width) + 4 * (shape.heads + (shape.kv_heads or shape.heads))
    return body


def activation_bytes(shape: ModelShape, setup: Setup) -> tuple[float, list[str]]:
    """Activation memory of one micro-batch: for a gated-MLP RMSNorm decoder what its layers save
    (saved_per_token, plus CUDA attention's key/value copies), else Korthikanti et al. 2022's 34*s*b*h bytes per
    layer in 16-bit (GPT's MLP, a fused attention kernel); with checkpointing only each layer's input (2*s*b*h), plus
    one layer being recomputed; plus the final norm and the loss's peak over the logits, 12*s*b*V: backward starts
    with log_softmax's fp32 output (saved), its incoming gradient and the gradient it makes, all three alive at
    once (CPU-measured: tests/unit/config/test_logits_memory.py; a fifth of Llama-3.2-1B's at 4 x 1024 tokens)."""
    if not (shape.hidden and shape.layers and shape.vocab):
        return 0.0, ["activations unknown for a bare parameter count: give a model config"]
    tokens = setup.seq_len * setup.micro_batch
    width = 2 if setup.precision != "fp32" else 4
    notes = []
    if shape.gated and shape.intermediate and shape.kv_width and shape.heads:
        per_layer = tokens * (saved_per_token(shape, width) + CUDA_ATTENTION_KV_TENSORS * width * shape.kv_width)
    else:
        per_layer = 34 * tokens * shape.hidden * width // 2
        notes.append(
            "activations by the GPT formula (34*s*b*h per layer): measured only for gated-MLP decoders (Llama family)"
        )
    body = (
        (width * tokens * shape.hidden * shape.layers + per_layer)
        if setup.activation_checkpointing
        else per_layer * shape.layers
    )
    logits = 0 if setup.fused_loss else LOGITS_PEAK_BYTES * shape.vocab
    final = tokens * (4 * shape.hidden + 2 * width * shape.hidden + logits)
    return float(body + final), notes


def estimate(shape: ModelShape, setup: Setup) -> Estimate:
    if setup.strategy not in STRATEGIES:
        raise ValueError(f"strategy {setup.strategy!r} is not one of {', '.join(STRATEGIES)}")
    if setup.optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer {setup.optimizer!r} is not one of {', '.join(OPTIMIZER_BYTES)}")
    world = setup.nproc_per_node * setup.nnodes
    shard = {"NO_SHARD": 1, "DDP": 1, "ZERO1": 1, "HYBRID_SHARD": setup.nproc_per_node}.get(setup.strategy, world)
    P = shape.params
    # fp32 weights, also with bf16/fp16 mixed precision
    master = 4
    compute = 4 if setup.precision == "fp32" else 2
    params, grads, optim = master * P / shard, master * P / shard, OPTIMIZER_BYTES[setup.optimizer] * P / shard
    if setup.strategy == "ZERO1":
        # ZeroRedundancyOptimizer: 1/N of the state per rank
        optim = OPTIMIZER_BYTES[setup.optimizer] * P / world
    unit = shape.largest_unit or P / max(shape.layers or 32, 1)
    # the unit in use and the prefetched one; nothing is gathered without sharded parameters
    working = 0.0 if setup.strategy in ("NO_SHARD", *REPLICATED) else 2 * unit * compute
    # held from forward to backward: SHARD_GRAD_OP's gathered parameters; a replicated model's autocast copies (on one
    # H200, DDP's peak was 2.1 GiB over the estimate without them, 1.82 GiB being 2P: bench/results/h200/gpu-check-4)
    held = setup.strategy == "SHARD_GRAD_OP" or (setup.strategy in REPLICATED and setup.precision != "fp32")
    gathered = compute * P if held else 0.0
    acts, notes = activation_bytes(shape, setup)
    if setup.strategy in REPLICATED:
        notes.append("DDP also keeps its gradient buckets (about 4P bytes more unless gradient_as_bucket_view)")
    offload_node = 0.0
    if setup.offload and setup.strategy in REPLICATED:
        raise ValueError(f"offload is an FSDP setting; {setup.strategy} keeps every state on the GPU")
    if setup.offload:
        offload_node = (params + grads + optim) * setup.nproc_per_node
        params = grads = optim = 0.0
        notes.append("offload: parameters, gradients and the optimizer step live in CPU RAM")
    if shape.largest_unit is None:
        notes.append(f"largest unit taken as P/{shape.layers or 32} for a bare parameter count")
    # gradients and activations do not peak together: backward frees each layer's activations as it makes that
    # layer's gradients, and the step's zero_grad freed the last ones before forward; the larger of the two is
    # counted (on an H200 every shipped config's peak came within 5% of this: tests/unit/config/test_memory.py)
    total = params + optim + gathered + working + max(grads, acts)
    if grads and acts:
        notes.append(
            f"gradients ({human(grads)}) and activations ({human(acts)}) do not peak together: the total counts "
            "the larger"
        )
    return Estimate(
        shard_group=shard,
        params=params,
        grads=grads,
        optimizer=optim,
        gathered_params=gathered,
        all_gather_working_set=working,
        activations=acts,
        gpu_total=total,
        cpu_offload_per_node=offload_node,
        # cpu_ram_efficient_loading: only rank 0 of the node holds the full checkpoint (in its saved dtype,
        # fp32 assumed)
        cpu_loading_per_node=4.0 * P,
        cpu_merging=0.5 * GiB,
        notes=notes,
    )


def shipped_table(world: int | None = None, per_node: int | None = None) -> list[tuple[str, str, bool]]:
    """(config, strategy, offload) for each distinct estimate among the shipped configs (fsdp_recipes.config.strategy
    reads them from accelerate_configs/; of an FSDP1 and an FSDP2 config with the same estimate, the FSDP2 one),
    cheapest communication first. On ``world`` processes (``per_node`` a node) each as it runs there: FSDP1 in a
    shard group of one is NO_SHARD; FSDP2's HSDP needs 2+ processes per node (accelerate refuses a shard of 1)."""
    configs = [
        (label, strategy, strategy.memory_strategy if world is None else strategy.memory_strategy_on(world, per_node))
        for label, strategy in shipped_configs().items()
        if not (per_node == 1 and strategy.fsdp_version == 2 and strategy.memory_strategy == "HYBRID_SHARD")
    ]
    rows: dict[tuple[str, bool], str] = {}
    # FSDP2 first, then a config that names the strategy it runs (fsdp1/no_shard.yaml for NO_SHARD on one process)
    for label, strategy, runs_as in sorted(
        configs, key=lambda c: (c[1].fsdp_version == 1, c[2] != c[1].memory_strategy, c[0])
    ):
        rows.setdefault((runs_as, strategy.offload), label)
    rank = {name: i for i, name in enumerate(COMMUNICATION_ORDER)}
    return sorted(
        ((label, name, offload) for (name, offload), label in rows.items()),
        key=lambda row: (rank.get(row[1], len(rank)), row[2]),
    )


def fitting_configs(shape: ModelShape, setup: Setup, gpu_bytes: float) -> list[tuple[str, float, bool]]:
    """(config, GPU bytes, fits) for every shipped config (DDP, ZeRO-1, FSDP1, FSDP2), cheapest in communication
    first, each as it runs on the setup's processes."""
    rows = []
    for name, strategy, offload in shipped_table(setup.nproc_per_node * setup.nnodes, setup.nproc_per_node):
        est = estimate(shape, Setup(**{**asdict(setup), "strategy": strategy, "offload": offload}))
        rows.append((name, est.gpu_total, est.gpu_total <= gpu_bytes))
    return rows


def parse_bytes(text: str) -> float:
    """'80GiB', '40GB', '512MiB' or a number of bytes -> bytes (more than 0, finite)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*(GiB|GB|MiB|MB|TiB|TB)?\s*", text)
    try:
        size = (
            float(m.group(1))
            * {"GiB": GiB, "GB": 1e9, "MiB": 1024**2, "MB": 1e6, "TiB": 1024**4, "TB": 1e12, None: 1}[m.group(2)]
            if m
            else None
        )
    # '1.2.3GiB'
    except ValueError:
        size = None
    if size is None or not 0 < size < float("inf"):
        raise ValueError(f"{text!r} is not a size above 0 such as 80GiB")
    return size


def human(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= 0.01 * GiB or n == 0 else f"{n / 1024**2:.2f} MiB"
