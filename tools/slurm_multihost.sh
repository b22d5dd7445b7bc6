#!/bin/bash
# PipelineRL on several SLURM nodes. UNTESTED: there is no SLURM (and no GPU) where this project
# is developed; the steps are docs/scaling.md's "Several trainer processes", run by srun.
#
#   sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 --exclusive \
#       tools/slurm_multihost.sh TRAINERS [main.py flags...]
#
# MODE=ray (default): a Ray cluster over the allocation. The first node is the head, offers no
#   GPUs to Ray and runs the driver: trainer process 0. The driver places trainer processes
#   1..TRAINERS-1 as Ray actors, one per other node (their jax.distributed address and ids come
#   from the driver, not from SLURM), and the generator actors on the GPUs of the remaining nodes.
# MODE=jax: one trainer process per node started by srun, joined by jax.distributed from SLURM's
#   environment (train.num_processes=0 takes SLURM's task count); generation stays inline on
#   process 0 (the JAX engine): no Ray.
#
# The package, the model directory and the workdir must be at the same path on every node.
set -euo pipefail

TRAINERS=${1:?usage: slurm_multihost.sh TRAINERS [main.py flags...]}
shift
MODE=${MODE:-ray}
PORT=${RAY_PORT:-6379}
PYTHON=${PYTHON:-python}
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head=${nodes[0]}

if [[ $MODE == jax ]]; then
  exec srun --ntasks-per-node=1 "$PYTHON" -m pipelinerl_jax.main \
      --config.train.num_processes=0 "$@"
fi

if (( ${#nodes[@]} <= TRAINERS )); then
  echo "error: $TRAINERS trainer nodes leave none of the ${#nodes[@]} nodes to generate" >&2
  exit 2
fi
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | awk '{print $1}')

# The head: trainer process 0's node, so none of its GPUs go to Ray's actors.
srun --nodes=1 --ntasks=1 -w "$head" ray start --head --node-ip-address="$head_ip" \
    --port="$PORT" --num-gpus=0 --disable-usage-stats --block &
sleep 10
# Every other node joins with all its GPUs: Ray puts trainer actors and generators on them.
for node in "${nodes[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" ray start --address="$head_ip:$PORT" --block &
done
sleep 10

# The driver, on the head node (this batch script runs there).
status=0
# (Weights go the config's way: its weight_transport, nccl in the GPU presets; the flags may
# override it, e.g. --config.generation.remote.weight_transport=object_store.)
"$PYTHON" -m pipelinerl_jax.main --config.cluster.address="$head_ip:$PORT" \
    --config.generation.placement=ray --config.train.num_processes="$TRAINERS" "$@" || status=$?
ray stop  # on the head; the other nodes' `ray start --block` end with the job step
kill $(jobs -p) 2>/dev/null || true
exit $status
