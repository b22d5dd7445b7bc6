#!/bin/bash
# PipelineRL on several SLURM nodes. UNTESTED under SLURM (there is no SLURM where this project
# is developed); the steps are docs/scaling.md's two-host recipe, which runs in the tests on two
# hosts made of network namespaces (tools/two_hosts.sh), here run by srun.
#
#   IFACE=ib0 sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 --exclusive \
#       tools/slurm_multihost.sh TRAINERS [main.py flags...]
#
# IFACE: the network interface the nodes share (the same name on every node). Each node's
#   address is read from it and given to Ray (`--node-ip-address`, `cluster.node_ip`); JAX's and
#   the weights' gloo listen on it (`cluster.interface`). Unset: each node's address is what its
#   host name resolves to, which must then not be a loopback address (Debian's /etc/hosts maps
#   the host name to 127.0.1.1).
# HEARTBEAT_S (30): train.distributed.heartbeat_timeout_s and
#   generation.remote.heartbeat_timeout_s: a trainer process or generator silent this long is
#   lost, and the run stops with one line naming it and its host; processes cut off from the
#   driver stop themselves after as long.
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
HEARTBEAT_S=${HEARTBEAT_S:-30}
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head=${nodes[0]}

# A node's address as the others reach it: its IPv4 on $IFACE, else what its name resolves to.
address_of() {
  if [[ -n ${IFACE:-} ]]; then
    srun --nodes=1 --ntasks=1 -w "$1" ip -4 -o addr show dev "$IFACE" \
        | awk '{split($4, a, "/"); print a[1]; exit}'
  else
    srun --nodes=1 --ntasks=1 -w "$1" hostname --ip-address | awk '{print $1}'
  fi
}

network=(--config.train.distributed.heartbeat_timeout_s="$HEARTBEAT_S")
[[ -n ${IFACE:-} ]] && network+=(--config.cluster.interface="$IFACE")

if [[ $MODE == jax ]]; then
  exec srun --ntasks-per-node=1 "$PYTHON" -m pipelinerl_jax.main \
      --config.train.num_processes=0 "${network[@]}" "$@"
fi

if (( ${#nodes[@]} <= TRAINERS )); then
  echo "error: $TRAINERS trainer nodes leave none of the ${#nodes[@]} nodes to generate" >&2
  exit 2
fi
head_ip=$(address_of "$head")
[[ -n $head_ip && $head_ip != 127.* ]] || {
  echo "error: the head node's address is '${head_ip}': set IFACE to the nodes' interface" >&2
  exit 2
}

# Ray marks a node dead after 10 missed health checks, 1 s apart, each given 2 s (a loaded node
# answers late), so that a node lost for good leaves the cluster before a run started again
# places its actors there.
system_config='{"health_check_period_ms": 1000, "health_check_timeout_ms": 2000,
                "health_check_failure_threshold": 10}'
# The head: trainer process 0's node, so none of its GPUs go to Ray's actors.
srun --nodes=1 --ntasks=1 -w "$head" ray start --head --node-ip-address="$head_ip" \
    --port="$PORT" --num-gpus=0 --disable-usage-stats --system-config="$system_config" --block &
# Every other node joins with all its GPUs, at its own address (`ray start` retries until the
# head answers): Ray puts trainer actors and generators on them.
for node in "${nodes[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" ray start --address="$head_ip:$PORT" \
      --node-ip-address="$(address_of "$node")" --block &
done
until (( $(ray status --address="$head_ip:$PORT" 2>/dev/null | grep -c ' node_') >= ${#nodes[@]} ))
do
  sleep 5
done

# The driver, on the head node (this batch script runs there).
status=0
# (Weights go the config's way: its weight_transport, nccl in the GPU presets; the flags may
# override it, e.g. --config.generation.remote.weight_transport=object_store.)
"$PYTHON" -m pipelinerl_jax.main --config.cluster.address="$head_ip:$PORT" \
    --config.cluster.node_ip="$head_ip" --config.generation.placement=ray \
    --config.generation.remote.heartbeat_timeout_s="$HEARTBEAT_S" \
    --config.train.num_processes="$TRAINERS" "${network[@]}" "$@" || status=$?
kill $(jobs -p) 2>/dev/null || true  # every node's `ray start --block` stops its Ray
wait || true
exit $status
