#!/usr/bin/env bash
# Launch `megaflow train` on one or many nodes with torchrun. Run the same command on every node (or let
# scripts/slurm/train.sbatch do it). `bash scripts/launch.sh --help` prints the usage below.
usage() {
  cat <<'EOF'
Usage: [VAR=value ...] bash scripts/launch.sh [megaflow train arguments]

Starts torchrun on this node with `-m megaflow.cli train ARGS` (`megaflow train --help` lists ARGS: -c CONFIG,
--set KEY=VALUE, --resume [auto], ...). Run the same command on every node; only NODE_RANK differs.

Variables (all optional):
  NNODES            nodes of the launch (1)
  NODE_RANK         this node's rank, 0 .. NNODES-1 (0)
  NPROC             processes on this node (its GPUs when CUDA is present, else 1)
  MASTER_ADDR       host of node 0, reachable from every node (127.0.0.1)
  MASTER_PORT       a free TCP port on node 0 (29500)
  SHUTDOWN_TIMEOUT  seconds the ranks get after Ctrl-C / SIGTERM to finish the iteration and write the
                    checkpoint before torchrun kills them (600)
  VENV              the project venv (default: what scripts/setup_env.sh prints)
  HF_HUB_OFFLINE    1 unless set: models are local directories
  OMP_NUM_THREADS   1 unless set
  DRY_RUN           1: print the torchrun command, check the config against NNODES x NPROC processes
                    (parallel.gpus, the parallel layout) and exit without starting anything

Every node needs the same repository and the run dir (run.output_dir) on a shared filesystem: rank 0 writes the
run's config and, without model.pretrained, the tiny pipeline every engine loads. A config with parallel.gpus
refuses a launch of NNODES x NPROC processes of another size.

Examples:
  # 1 node, 2 trainer ranks (TP=2), engines on rank 0:
  NPROC=2 bash scripts/launch.sh -c configs/cpu_demo.toml --set parallel.tp=2
  # 2 nodes x 8 GPUs (on each node; NODE_RANK differs), engines on every rank, a requeued job resumes:
  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NPROC=8 bash scripts/launch.sh -c configs/flux_dev_2x8xh100.toml \
      --resume auto
  # disaggregated: node 0 trains (8 ranks), node 1 only samples (8 engine ranks, one engine per GPU):
  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NPROC=8 bash scripts/launch.sh -c configs/sd3_medium_8xh100.toml \
      --set parallel.gpus=16 --set rollout.placement=disaggregated --set rollout.engine_ranks=8 \
      --set bridge.mode=distributed
  # two "nodes" on one CPU host (as tests/run/test_launch_multinode.py does; run both, NODE_RANK 0 and 1):
  NNODES=2 NODE_RANK=0 NPROC=1 MASTER_PORT=29611 bash scripts/launch.sh -c configs/cpu_demo.toml \
      --set rollout.engine_hosts=node
The script starts only torchrun; it never kills anything.
EOF
}
for arg in "$@"; do
  case "$arg" in -h|--help) usage; exit 0 ;; esac
done
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

# --- the variables checked before anything starts: one line and exit 2 (torchrun would trace back, or a node
# rank beyond the launch would wait for a rendezvous that never comes) ---------------------------------------
refuse() { echo "launch.sh: $*" >&2; exit 2; }
whole() {  # whole NAME VALUE MIN: VALUE a whole number >= MIN (at most 9 digits: no overflow in bash)
  [[ "$2" =~ ^[0-9]{1,9}$ ]] && (( 10#$2 >= $3 )) || refuse "$1=$(printf %q "$2"): want a whole number >= $3"
}
whole NNODES "${NNODES:-1}" 1
whole NODE_RANK "${NODE_RANK:-0}" 0
(( 10#${NODE_RANK:-0} < 10#${NNODES:-1} )) \
  || refuse "NODE_RANK=${NODE_RANK} is beyond NNODES=${NNODES:-1} (node ranks are 0 .. $(( 10#${NNODES:-1} - 1 )))"
[ -z "${NPROC:-}" ] || whole NPROC "$NPROC" 1
whole MASTER_PORT "${MASTER_PORT:-29500}" 1
(( 10#${MASTER_PORT:-29500} <= 65535 )) || refuse "MASTER_PORT=${MASTER_PORT}: want a TCP port, 1 .. 65535"
whole SHUTDOWN_TIMEOUT "${SHUTDOWN_TIMEOUT:-600}" 0
[[ "${MASTER_ADDR:-127.0.0.1}" =~ ^[A-Za-z0-9.:_-]+$ ]] \
  || refuse "MASTER_ADDR=$(printf %q "${MASTER_ADDR}"): want a host name or an IP address"

# --- environment -------------------------------------------------------------------------
VENV="${VENV:-$(bash scripts/setup_env.sh | tail -n 1)}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# --- topology ----------------------------------------------------------------------------
if [ -z "${NPROC:-}" ]; then  # this node's GPUs, else 1
  GPUS="$("$VENV/bin/python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
  NPROC=$(( GPUS > 0 ? GPUS : 1 ))
fi
TOPOLOGY=(
  --nnodes "${NNODES:-1}"
  --node-rank "${NODE_RANK:-0}"
  --nproc-per-node "$NPROC"
  --master-addr "${MASTER_ADDR:-127.0.0.1}"
  --master-port "${MASTER_PORT:-29500}"
  --shutdown-timeout "${SHUTDOWN_TIMEOUT:-600}"
)

# --- run ---------------------------------------------------------------------------------
echo "launch.sh: torchrun ${TOPOLOGY[*]} -m megaflow.cli train $*" >&2
if [ "${DRY_RUN:-0}" = "1" ]; then  # the config against NNODES x NPROC (parallel.gpus, TP x PP, engine ranks)
  exec env WORLD_SIZE=$(( ${NNODES:-1} * NPROC )) LOCAL_WORLD_SIZE="$NPROC" RANK=0 \
    "$VENV/bin/python" -m megaflow.cli train --dry-run "$@"
fi
exec "$VENV/bin/torchrun" "${TOPOLOGY[@]}" -m megaflow.cli train "$@"
