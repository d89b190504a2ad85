#!/usr/bin/env bash
# Set up (or reuse) megaflow's Python 3.12 venv, then run the test suite.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -m "not slow"   # skip multi-process / real-engine tests (the fast tier)
# Every run ends with pytest's table of the 15 slowest tests (--durations=15; pass --durations=N to change it),
# so a change that slows the suite shows in CI's own log.
# Extra arguments go to pytest; its exit code is the script's (a mistyped -m or path that collects nothing
# exits 5, a failure).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
VENV="$(bash scripts/setup_env.sh | tail -n 1)"
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest --durations=15 "$@"
