#!/usr/bin/env bash
# Set up (or reuse) megaflow's Python 3.12 venv, then run the test suite.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -m "not slow"   # skip multi-process / real-engine tests (the fast tier)
# Every run ends with pytest's table of the 15 slowest tests (--durations=15; pass --durations=N to change it),
# so a change that slows the suite shows in CI's own log.
# Tests run on MEGAFLOW_TEST_WORKERS pytest-xdist workers (default 2: one a core on the 2-core machines CI runs on;
# most tests keep one core busy), each test file whole on one worker so its module-scoped runs are shared, the
# longest files first (tests/conftest.py orders them; --no-loadscope-reorder keeps that order instead of xdist's
# most-tests-first, which started the few-test multi-minute files last and could leave a worker idle at the end);
# passing -n N (-n 0, or -p no:xdist: this process only) overrides it.
# Extra arguments go to pytest; its exit code is the script's (a mistyped -m or path that collects nothing
# exits 5, a failure).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
VENV="$(bash scripts/setup_env.sh | tail -n 1)"
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
WORKERS=(-n "${MEGAFLOW_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
for arg in "$@"; do
  case "$arg" in -n|-n[0-9]*|--numprocesses|--numprocesses=*|no:xdist) WORKERS=() ;; esac
done
exec "$VENV/bin/python" -m pytest --durations=15 "${WORKERS[@]}" "$@"
