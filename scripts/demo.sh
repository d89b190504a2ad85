#!/usr/bin/env bash
# The CPU demo: RL (configs/shapes_demo.toml: DiffusionNFT) makes the shipped pretrained ShapeEval model
# (assets/shapeeval-sd3) better on held-out compositional prompts: ShapeEval before -> RL (SGLang rollouts, ShapeEval reward,
# megatron-core trainer, verified weight sync) -> ShapeEval after, same prompts and seeds.
# Writes runs/demo/summary.json. Extra arguments go to `megaflow demo` (e.g. --set train.iterations=8).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
VENV="$(bash scripts/setup_env.sh | tail -n 1)"
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/megaflow" demo -c configs/shapes_demo.toml "$@"
