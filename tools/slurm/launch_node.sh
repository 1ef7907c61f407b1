#!/usr/bin/env bash
# One node's part of a SLURM job (train_fsdp.sbatch runs it once per node through srun): derives this node's
# machine rank and the main address from SLURM's environment and starts accelerate's own multi-node launch.
#   bash tools/slurm/launch_node.sh ACCELERATE_CONFIG [RECIPE.yaml] [--flag value ...]
# Reads SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST (the first host is the main process), GPUS_PER_NODE
# (default: the GPUs SLURM gave this node, SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE, else 8) and
# MAIN_PROCESS_PORT (default 29500). MAIN_PROCESS_IP, if set, replaces the first host's name (a cluster whose host
# names do not resolve between nodes; tests on one machine). With an HSDP config (hybrid_shard.yaml) the mesh is
# set to one replica per node and one shard per GPU of a node. A requeued job (SLURM_RESTART_COUNT > 0) resumes
# from the newest complete checkpoint. SIGUSR1 is handed to the training processes (they checkpoint and stop).
set -euo pipefail
config=${1:?usage: launch_node.sh ACCELERATE_CONFIG [RECIPE.yaml] [--flag value ...]}
shift
nnodes=${SLURM_NNODES:?not inside a SLURM job: SLURM_NNODES is unset}
node_rank=${SLURM_NODEID:?not inside a SLURM job: SLURM_NODEID is unset}
# a node rank outside 0..nnodes-1 would wait for a rendezvous that never completes (a hang, not an error)
if ! [[ "$nnodes" =~ ^[1-9][0-9]*$ && "$node_rank" =~ ^[0-9]+$ ]] || (( node_rank >= nnodes )); then
    echo "launch_node.sh: error: SLURM_NODEID=${node_rank} does not fit SLURM_NNODES=${nnodes} (node ranks are 0..NNODES-1): run it through train_fsdp.sbatch's srun, one task per node" >&2
    exit 2
fi
gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-8}}
per_node=${GPUS_PER_NODE:-${gpus##*:}}  # SLURM_GPUS_PER_NODE may read "a100:8"
main_ip=${MAIN_PROCESS_IP:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:?}" | head -n 1)}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mesh=()
if grep -q '^parallelism_config:' "$config"; then
    # FSDP2 HSDP (hybrid_shard.yaml): shard inside each node, one replica per node, whatever the file says
    mesh=(--parallelism_config_dp_replicate_size "$nnodes" --parallelism_config_dp_shard_size "$per_node")
fi
resume=()
if [[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]]; then
    # a requeued job continues from the newest complete checkpoint, whatever the first run was told: the user's own
    # --resume_from_checkpoint is dropped (train_fsdp.py refuses a flag given twice with different values)
    args=()
    skip=0
    for arg in "$@"; do
        if [[ "$skip" -eq 1 ]]; then skip=0; continue; fi
        if [[ "$arg" == --resume_from_checkpoint ]]; then skip=1; continue; fi
        [[ "$arg" == --resume_from_checkpoint=* ]] && continue
        args+=("$arg")
    done
    set -- "${args[@]}"
    resume=(--resume_from_checkpoint true)
    echo "requeued job (restart ${SLURM_RESTART_COUNT}): resuming from the newest complete checkpoint"
fi
echo "node ${node_rank}/${nnodes} on $(hostname): ${per_node} processes, main process ${main_ip}:${MAIN_PROCESS_PORT:-29500}"
accelerate launch --config_file "$config" \
    --num_machines "$nnodes" --machine_rank "$node_rank" --num_processes $((nnodes * per_node)) \
    --main_process_ip "$main_ip" --main_process_port "${MAIN_PROCESS_PORT:-29500}" \
    --rdzv_backend static --same_network "${mesh[@]}" \
    "$repo/train_fsdp.py" "$@" "${resume[@]}" &
launcher=$!
# SIGUSR1 goes to the training processes only: each finishes its step, saves checkpoint-<step> and exits, and the
# launcher then ends by itself. (The launcher would die of SIGUSR1, and gives its processes 30 s after a SIGTERM.)
trap 'pkill -USR1 -P "$launcher" || true' USR1
trap 'kill -TERM "$launcher" 2>/dev/null || true' TERM
status=0
while true; do
    if wait "$launcher"; then status=0; else status=$?; fi
    kill -0 "$launcher" 2>/dev/null || break
done
exit "$status"
