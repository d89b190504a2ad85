#!/usr/bin/env bash
# Build gpu_wheels/ (git-ignored): the wheels scripts/gpu_check.sh installs on a bare GPU machine that has its own
# Python 3.12 + torch (+ transformers, peft, accelerate) but no network. Run it HERE (registry access), then carry
# gpu_wheels/ to the GPU machine with the working tree.
#   bash scripts/gpu_wheels.sh           # prints the wheelhouse's contents and total size; fails over 60 MiB
#
# Contents (cp312 / manylinux x86_64 or pure Python; megatron-core at the version pinned in pyproject.toml,
# diffusers at the version sglang[diffusion] pins, named in pyproject.toml's comment):
#   megatron-core, diffusers, megaflow (this checkout, --no-deps), psutil (megatron's dist_checkpointing needs it);
#   and small dependencies that gpu_check.sh installs only where the image cannot import them already: the
#   pure-Python deps of diffusers (importlib_metadata, zipp, filelock, httpx stack, requests stack, regex,
#   safetensors, huggingface-hub, Pillow), einops and tqdm. Their versions are the ones of this checkout's
#   venv (the tested stack) where it has them.
# What does NOT fit (the GPU run is limited to 64 MiB of carried files): sglang[diffusion]==0.5.23. Its
# sglang-kernel 0.4.10 wheel alone is 356 MiB (PyPI); installed here its CUDA kernels take ~1.1 GB
# (sgl_kernel) + 0.6 GB (flashinfer) + 0.5 GB (nvidia-cutlass-dsl) + 0.2 GB (sglang) on top of torch, and it
# pins torch 2.14.1 (the GPU image has 2.11). So the GPU checks run without SGLang: engine checks are skipped.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
DEST="${GPU_WHEELS_DIR:-$REPO/gpu_wheels}"
LIMIT_MIB=60
VENV="$(bash scripts/setup_env.sh | tail -n 1)"
PY="$VENV/bin/python"

# name==version for each requirement: megatron-core from [project] dependencies, diffusers from the comment
# naming sglang's pin, the others from this venv (unpinned where the venv lacks them).
mapfile -t PINS < <("$PY" - pyproject.toml <<'PYEOF'
import importlib.metadata as md, re, sys, tomllib
text = open(sys.argv[1], "rb").read().decode()
deps = tomllib.loads(text)["project"]["dependencies"]
mcore = next(d for d in deps if d.startswith("megatron-core=="))
m = re.search(r"diffusers (\d+\.\d+\.\d+)", text)
if m is None:
    sys.exit("gpu_wheels: pyproject.toml names no 'diffusers X.Y.Z' pin")
print(mcore)
print(f"diffusers=={m.group(1)}")
for name in ("psutil", "importlib_metadata", "zipp", "filelock", "httpx", "httpcore", "h11", "anyio", "sniffio",
             "idna", "certifi", "requests", "urllib3", "charset_normalizer", "regex", "safetensors",
             "huggingface_hub", "pillow", "einops", "tqdm", "typing_extensions"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(name)
PYEOF
)

rm -rf "$DEST"
mkdir -p "$DEST"
echo "gpu_wheels: downloading ${#PINS[@]} wheels into $DEST" >&2
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$DEST" "${PINS[@]}"
echo "gpu_wheels: building megaflow's wheel" >&2
NEW=()  # setuptools' in-tree build leftovers that this run creates (and removes)
for d in build megaflow.egg-info; do [ -e "$d" ] || NEW+=("$d"); done
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" . >&2
for d in "${NEW[@]}"; do rm -rf "$d"; done

ls -1 "$DEST"
TOTAL_KIB="$(du -sk "$DEST" | cut -f1)"
echo "gpu_wheels: $(ls "$DEST" | wc -l) wheels, $((TOTAL_KIB / 1024)) MiB total ($TOTAL_KIB KiB)"
if [ "$TOTAL_KIB" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "gpu_wheels: over the ${LIMIT_MIB} MiB limit" >&2
  exit 1
fi
