#!/usr/bin/env bash
# The GPU wheelhouse proven on CPU, before any GPU minute: a fresh venv that mirrors the GPU image (Python 3.12,
# torch 2.11.0, triton 3.6.0, transformers 5.17.0 and the image's other packages the engine path may import, at the
# versions docs/gpu/image-packages.txt names; whatever pip pulls in beyond that list is removed again) plus ONLY the
# wheelhouse of scripts/gpu_wheels.sh, installed by scripts/gpu_check.sh's own install step, samples a rollout from the
# tiny SD3 engine; the project's venv samples the same pipeline with the same requests; the log-probs (and latents,
# velocities, images) must agree to megaflow.testing.gpu.mirror.TOLERANCE relative, and the sgl_kernel stand-in must
# never be reached (without CUDA it refuses to import, as the real CUDA package does here). It downloads torch
# (~5 GB with its CUDA libraries), so it is a script and not a test.
#   bash scripts/gpu_mirror_check.sh [RECORD]   # default RECORD: docs/gpu/cpu-mirror-<date>.json; exit 1 on failure
# Environment: GPU_MIRROR_DIR (the mirror venv and the scratch files; default ~/.cache/megaflow/gpu-mirror; the venv
# is reused while the package list is unchanged).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
RECORD="${1:-$REPO/docs/gpu/cpu-mirror-$(date +%F).json}"
DIR="${GPU_MIRROR_DIR:-$HOME/.cache/megaflow/gpu-mirror}"
VENV="$(bash scripts/setup_env.sh | tail -n 1)"
PROJECT_PY="$VENV/bin/python"
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false

# The image's packages the engine, trainer and megaflow may import (every one is in docs/gpu/image-packages.txt);
# pinned where that list names a version.
MIRROR_SET=(torch triton torchvision torchaudio transformers accelerate huggingface-hub numpy safetensors tokenizers
  sentencepiece tiktoken peft pillow psutil requests pyyaml jinja2 aiohttp msgpack cloudpickle xxhash einops scipy
  imageio opencv-python-headless packaging tqdm regex filelock fsspec httpx anyio click rich uvloop protobuf
  prometheus-client timm numba scikit-image h5py six python-dateutil)
mapfile -t SPECS < <("$PROJECT_PY" - docs/gpu/image-packages.txt "${MIRROR_SET[@]}" <<'PYEOF'
import sys
from pathlib import Path
from megaflow.testing.gpu.wheelhouse import image_packages, normalize
image = image_packages(Path(sys.argv[1]))
for name in sys.argv[2:]:
    if normalize(name) not in image:
        sys.exit(f"gpu_mirror_check: {name} is not in {sys.argv[1]}")
    version = image[normalize(name)]
    print(f"{name}=={version}" if version else name)
PYEOF
)
KEY="$(printf '%s\n' "${SPECS[@]}" | cat - docs/gpu/image-packages.txt | sha256sum | cut -c1-12)"
MIRROR="$DIR/venv-$KEY"
if [ ! -f "$MIRROR/.complete" ]; then
  echo "gpu_mirror_check: building the mirror of the GPU image at $MIRROR" >&2
  rm -rf "$MIRROR"
  PY312="$("$PROJECT_PY" -c 'import sys; print(sys._base_executable)')"  # the project's base Python 3.12
  "$PY312" -m venv "$MIRROR"
  "$MIRROR/bin/pip" install -q --upgrade pip >&2
  "$MIRROR/bin/pip" install -q "${SPECS[@]}" >&2
  # what pip pulled in that the image does not have (pydantic, through typer, ...) goes again
  mapfile -t EXTRA < <("$MIRROR/bin/python" - docs/gpu/image-packages.txt <<'PYEOF'
import importlib.metadata as md, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n.strip()).lower()
image = {norm(l.split("==")[0]) for l in open(sys.argv[1]) if l.strip() and not l.startswith("#")}
print("\n".join(sorted({norm(d.metadata["Name"]) for d in md.distributions()} - image)))
PYEOF
)
  if [ "${#EXTRA[@]}" -gt 0 ] && [ -n "${EXTRA[0]}" ]; then
    echo "gpu_mirror_check: removing what the image lacks: ${EXTRA[*]}" >&2
    "$MIRROR/bin/pip" uninstall -q -y "${EXTRA[@]}" >&2
  fi
  touch "$MIRROR/.complete"
fi

WORK="$DIR/work"
rm -rf "$WORK" && mkdir -p "$WORK"
bash scripts/gpu_wheels.sh >"$WORK/gpu_wheels.log"
tail -n 1 "$WORK/gpu_wheels.log" >&2
SITE="$(PYTHON="$MIRROR/bin/python" TMPDIR="$WORK" OUT="$WORK/install" GPU_CHECK_INSTALL_ONLY=1 \
  bash scripts/gpu_check.sh | tail -n 1)"
echo "gpu_mirror_check: wheelhouse installed into $SITE ($(grep '^install:' "$WORK/install/install.log" | head -1))" >&2
"$PROJECT_PY" tools/make_tiny_pipeline.py --family sd3 --out "$WORK/tiny-sd3" --seed 0 >&2
echo "gpu_mirror_check: sampling in the project's venv" >&2
"$PROJECT_PY" -m megaflow.testing.gpu.mirror sample "$WORK/tiny-sd3" "$WORK/reference.pt" >"$WORK/reference.log" 2>&1
echo "gpu_mirror_check: sampling in the mirror (only the wheelhouse on top of the image's packages)" >&2
# from outside the checkout, so that the megaflow imported is the wheelhouse's, not this tree
(cd "$WORK" && PYTHONPATH="$SITE" SGL_KERNEL_STANDIN_LOG="$WORK/standin.log" \
  "$MIRROR/bin/python" -m megaflow.testing.gpu.mirror sample "$WORK/tiny-sd3" "$WORK/mirror.pt" \
  >"$WORK/mirror.log" 2>&1) || { tail -n 30 "$WORK/mirror.log" >&2; exit 1; }
(cd "$WORK" && PYTHONPATH="$SITE" "$MIRROR/bin/python" - "$SITE" <<'PYEOF'
import sys
import megaflow, sglang  # noqa: F401
assert all(m.__file__.startswith(sys.argv[1]) for m in (megaflow, sglang)), (megaflow.__file__, sglang.__file__)
PYEOF
)
"$PROJECT_PY" -m megaflow.testing.gpu.mirror compare "$WORK/reference.pt" "$WORK/mirror.pt" --result "$RECORD" \
  --wheels "$REPO/gpu_wheels" --install-log "$WORK/install/install.log"
