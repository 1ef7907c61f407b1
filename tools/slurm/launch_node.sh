#!/usr/bin/env bash
# One node's part of a SLURM job (train_fsdp.sbatch runs it once per node through srun): derives this node's
# machine rank and the main address from SLURM's environment and starts accelerate's own multi-node launch.
#   bash tools/slurm/launch_node.sh ACCELERATE_CONFIG [RECIPE.yaml] [--flag value ...]
# Reads SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST (the first host is the main process), GPUS_PER_NODE
# (default 8) and MAIN_PROCESS_PORT (default 29500). MAIN_PROCESS_IP, if set, replaces the first host's name
# (a cluster whose host names do not resolve between nodes; tests on one machine). With an HSDP config
# (hybrid_shard.yaml) the mesh is set to one replica per node and one shard per GPU of a node.
set -euo pipefail
config=${1:?usage: launch_node.sh ACCELERATE_CONFIG [RECIPE.yaml] [--flag value ...]}
shift
nnodes=${SLURM_NNODES:?not inside a SLURM job: SLURM_NNODES is unset}
node_rank=${SLURM_NODEID:?not inside a SLURM job: SLURM_NODEID is unset}
per_node=${GPUS_PER_NODE:-8}
main_ip=${MAIN_PROCESS_IP:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:?}" | head -n 1)}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mesh=()
if grep -q '^parallelism_config:' "$config"; then
    # FSDP2 HSDP (hybrid_shard.yaml): shard inside each node, one replica per node, whatever the file says
    mesh=(--parallelism_config_dp_replicate_size "$nnodes" --parallelism_config_dp_shard_size "$per_node")
fi
echo "node ${node_rank}/${nnodes} on $(hostname): ${per_node} processes, main process ${main_ip}:${MAIN_PROCESS_PORT:-29500}"
exec accelerate launch --config_file "$config" \
    --num_machines "$nnodes" --machine_rank "$node_rank" --num_processes $((nnodes * per_node)) \
    --main_process_ip "$main_ip" --main_process_port "${MAIN_PROCESS_PORT:-29500}" \
    --rdzv_backend static --same_network "${mesh[@]}" \
    "$repo/train_fsdp.py" "$@"
