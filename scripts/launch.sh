#!/usr/bin/env bash
# Launch `megaflow train` on one or many nodes with torchrun. Run the same command on every node.
#
#   # 1 node, 2 trainer ranks (TP=2), engines on rank 0:
#   NPROC=2 bash scripts/launch.sh -c configs/cpu_demo.toml --set parallel.tp=2
#   # 2 nodes x 8 GPUs (set on each node; NODE_RANK differs), engines on local rank 0 of each node:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NPROC=8 bash scripts/launch.sh -c configs/sd3_medium_8xh100.toml \
#       --set parallel.tp=2 --set rollout.engine_hosts=node
#   # disaggregated: node 0 trains (8 ranks), node 1 only samples (8 engine ranks, one engine per GPU):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NPROC=8 bash scripts/launch.sh -c configs/sd3_medium_8xh100.toml \
#       --set rollout.placement=disaggregated --set rollout.engine_ranks=8 --set bridge.mode=distributed
#   # two "nodes" on one CPU host (as tests/run/test_launch_multinode.py does; run both, NODE_RANK 0 and 1):
#   NNODES=2 NODE_RANK=0 NPROC=1 MASTER_PORT=29611 bash scripts/launch.sh -c configs/cpu_demo.toml \
#       --set rollout.engine_hosts=node
#
# Every node needs the same repository and the run dir (run.output_dir) on a shared filesystem: rank 0
# writes the run's config and, without model.pretrained, the tiny pipeline that every engine loads.
#
# Environment (all optional): NNODES (1), NODE_RANK (0), NPROC (processes per node; GPUs per node
# when CUDA is present, else 1), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500), VENV (the project venv),
# SHUTDOWN_TIMEOUT (600: seconds torchrun lets its ranks finish the iteration and write the checkpoint after
# Ctrl-C / SIGTERM before it kills them), HF_HUB_OFFLINE (1 unless set).
# Arguments are passed to `megaflow train`. The script starts only torchrun; it never kills anything.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

# --- environment -------------------------------------------------------------------------
VENV="${VENV:-$(bash scripts/setup_env.sh | tail -n 1)}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# --- topology ----------------------------------------------------------------------------
GPUS="$("$VENV/bin/python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
DEFAULT_NPROC=$(( GPUS > 0 ? GPUS : 1 ))
TOPOLOGY=(
  --nnodes "${NNODES:-1}"
  --node-rank "${NODE_RANK:-0}"
  --nproc-per-node "${NPROC:-$DEFAULT_NPROC}"
  --master-addr "${MASTER_ADDR:-127.0.0.1}"
  --master-port "${MASTER_PORT:-29500}"
  --shutdown-timeout "${SHUTDOWN_TIMEOUT:-600}"
)

# --- run ---------------------------------------------------------------------------------
echo "launch.sh: torchrun ${TOPOLOGY[*]} -m megaflow.cli train $*" >&2
exec "$VENV/bin/torchrun" "${TOPOLOGY[@]}" -m megaflow.cli train "$@"
