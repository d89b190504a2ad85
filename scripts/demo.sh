#!/usr/bin/env bash
# The CPU demo: FlowGRPO end to end on a tiny SD3-family model built offline.
#   SGLang diffusion engine (embedded) samples groups with per-step log-probs
#   -> rewards -> megatron-core trainer recomputes log-probs, PPO-clip step
#   -> weight bridge streams the new weights into the engine, verified by SHA-256.
# Extra arguments are passed to `megaflow train` (e.g. --set train.iterations=8).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
VENV="$(bash scripts/setup_env.sh | tail -n 1)"
# This checkout first on the path, even if the shared venv's editable install points at another clone.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/megaflow" demo -c configs/shapes_demo.toml "$@"
