#!/usr/bin/env bash
# First checks on a bare CUDA machine with its own Python 3.12 + torch (no network): installs the wheelhouse
# built by scripts/gpu_wheels.sh, then runs megaflow.testing.gpu's checks, each in its own process with its own
# timeout (the whole run stays under ~8 min). Run from a copy of the repository, gpu_wheels/ carried along:
#   OUT=/some/dir bash scripts/gpu_check.sh
# Writes $OUT/gpu_check.jsonl (one JSON record per line: the env record first, then one per check, status
# pass | fail | skipped with the numbers, error or reason), $OUT/gpu_check_summary.txt, $OUT/logs/<check>.log and
# $OUT/install.log. Exits 0 whatever the checks say (non-zero only if the driver itself cannot start).
# Environment: PYTHON (default: the first of python3 / python that imports torch), GPU_WHEELS (default <repo>/gpu_wheels; absent = install nothing),
# GPU_CHECK_BUDGET_S (seconds for the checks together, default 400), GPU_CHECK_ONLY (comma-separated check names
# or groups: trainer, engine; see megaflow/testing/gpu/run.py).
#
# GPU_CHECK_INSTALL_ONLY=1: install the wheelhouse, print the site directory and stop (scripts/gpu_mirror_check.sh).
# GPU_CHECK_PACK=1: pack logs/ into logs.tgz afterwards ($OUT then holds 4 files: a device call returns at most 8).
# The prepared run of a lease (the engine group, ~8 min, most wanted check first; what the budget leaves out skips):
#   GPU_CHECK_ONLY=engine GPU_CHECK_BUDGET_S=480 GPU_CHECK_PACK=1 bash scripts/gpu_check.sh   (carry gpu_wheels)
#
# Install: pip --target into a fresh directory put first on PYTHONPATH (works with any base interpreter, venv or
# not, and leaves the image's own packages untouched): megatron-core, diffusers, sglang (slim), the sgl_kernel
# stand-in and megaflow always; the small dependencies only where the image cannot import them already (its torch,
# transformers, numpy, huggingface-hub stay in charge); see megaflow/testing/gpu/wheelhouse.py. Without pip, the
# wheels are unzipped there instead.
set -uo pipefail
START=$(date +%s)
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then  # the image's interpreter: the first of python3 / python that imports torch
  for c in python3 python; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" >/dev/null 2>&1; then PY="$c"; break; fi
  done
  PY="${PY:-python3}"
fi
WHEELS="${GPU_WHEELS:-$REPO/gpu_wheels}"
SITE="${TMPDIR:-/tmp}/megaflow-gpu-site"
INSTALL_LOG="$OUT/install.log"
: >"$INSTALL_LOG"

install_wheels() {
  rm -rf "$SITE" && mkdir -p "$SITE"
  # megaflow/testing/gpu/wheelhouse.py decides (standard library only, run from this checkout): ALWAYS, plus the
  # dependencies this interpreter cannot import, of those the wheelhouse holds
  local wanted
  wanted="$("$PY" -m megaflow.testing.gpu.wheelhouse wanted "$WHEELS" 2>>"$INSTALL_LOG")"
  wanted=($wanted)
  echo "install: ${wanted[*]} (from $WHEELS into $SITE)" | tee -a "$INSTALL_LOG"
  if "$PY" -m pip --version >>"$INSTALL_LOG" 2>&1; then
    "$PY" -m pip install --no-index --find-links "$WHEELS" --no-deps --no-compile --disable-pip-version-check \
      --target "$SITE" "${wanted[@]}" >>"$INSTALL_LOG" 2>&1 && return 0
    echo "install: pip failed (see install.log); unzipping the wheels instead" | tee -a "$INSTALL_LOG"
  fi
  "$PY" - "$WHEELS" "$SITE" "${wanted[@]}" >>"$INSTALL_LOG" 2>&1 <<'PYEOF'
import sys, zipfile
from pathlib import Path
wheels, site, wanted = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
for name in wanted:
    found = sorted(wheels.glob(f"{name}-*.whl"), key=lambda p: p.name.lower())
    if not found:
        print(f"no wheel for {name}")
        continue
    zipfile.ZipFile(found[-1]).extractall(site)
    print(f"unzipped {found[-1].name}")
PYEOF
}

if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  install_wheels
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "install: no wheelhouse at $WHEELS: nothing installed (checks needing a missing package skip)" \
    | tee -a "$INSTALL_LOG"
fi
if [ "${GPU_CHECK_INSTALL_ONLY:-0}" = 1 ]; then
  echo "$SITE"
  exit 0
fi
SPENT=$(( $(date +%s) - START ))
BUDGET="${GPU_CHECK_BUDGET_S:-400}"
echo "install took ${SPENT} s; checks get ${BUDGET} s" | tee -a "$INSTALL_LOG"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [ "${GPU_CHECK_PACK:-0}" != 1 ]; then
  exec "$PY" -m megaflow.testing.gpu all --out "$OUT" --budget "$BUDGET" --only "${GPU_CHECK_ONLY:-}"
fi
"$PY" -m megaflow.testing.gpu all --out "$OUT" --budget "$BUDGET" --only "${GPU_CHECK_ONLY:-}"
RC=$?
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
exit $RC
