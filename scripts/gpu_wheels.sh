#!/usr/bin/env bash
# Build gpu_wheels/ (git-ignored): the wheels scripts/gpu_check.sh installs on a bare GPU machine that has its own
# Python 3.12 + torch 2.11 + triton 3.6 + transformers 5.17 (docs/gpu/image-packages.txt lists the image) but no
# network. Run it HERE (registry access), then carry gpu_wheels/ to the GPU machine with the working tree.
#   bash scripts/gpu_wheels.sh    # prints the contents and the carried total; fails if tree + wheels > 64 MiB
#
# Contents (cp312 / manylinux x86_64 or pure Python; the lists live in megaflow/testing/gpu/wheelhouse.py):
#   megatron-core and sglang at the versions pyproject.toml pins, diffusers at sglang[diffusion]'s pin (named in
#   pyproject.toml's comment), megaflow (this checkout, --no-deps), and megaflow's sgl_kernel stand-in
#   (tools/sgl_kernel_standin: importable, raises on any kernel use);
#   sglang itself WITHOUT its dependencies and slimmed: its Rust extension modules (41 MiB: the LLM server's gRPC /
#   HTTP front, benchmarks), tests and docs dropped; imageio-ffmpeg without its bundled ffmpeg binary;
#   the pure-Python (or small compiled) modules megatron-core, diffusers and sglang's diffusion engine import that
#   the image lacks (pydantic, pyzmq, fastapi/starlette/uvicorn, msgspec, orjson, IPython, openai, ...), at the
#   versions of this checkout's venv (the tested stack). Wheels of what the image already has are not carried.
# Why not sglang[diffusion] itself: its sglang-kernel 0.4.10 wheel alone is 356 MiB (installed: ~1.1 GB sgl_kernel
# + 0.6 GB flashinfer + 0.5 GB nvidia-cutlass-dsl) and it pins torch 2.14.1 (the image has 2.11). A user's GPU
# install keeps the real sglang[diffusion]; the stand-in exists only for these bare check machines.
# scripts/gpu_mirror_check.sh proves this set on CPU: a mirror of the image plus only these wheels samples the
# tiny SD3 engine to the same log-probs as the full venv.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
DEST="${GPU_WHEELS_DIR:-$REPO/gpu_wheels}"
LIMIT_MIB=64  # what one GPU call carries: the working tree and the wheelhouse together
VENV="$(bash scripts/setup_env.sh | tail -n 1)"
PY="$VENV/bin/python"
WH=(-m megaflow.testing.gpu.wheelhouse)

mapfile -t PINS < <("$PY" "${WH[@]}" pins pyproject.toml docs/gpu/image-packages.txt)
rm -rf "$DEST"
mkdir -p "$DEST"
echo "gpu_wheels: downloading ${#PINS[@]} wheels into $DEST" >&2
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 --platform any -d "$DEST" "${PINS[@]}"
"$PY" "${WH[@]}" slim "$DEST" >&2
"$PY" "${WH[@]}" standin tools/sgl_kernel_standin "$DEST" >/dev/null
echo "gpu_wheels: building megaflow's wheel" >&2
NEW=()  # setuptools' in-tree build leftovers that this run creates (and removes)
for d in build megaflow.egg-info; do [ -e "$d" ] || NEW+=("$d"); done
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" . >&2
for d in "${NEW[@]}"; do rm -rf "$d"; done

ls -1 "$DEST"
read -r TREE WHEELS TOTAL < <("$PY" "${WH[@]}" carried "$REPO" "$DEST")
echo "gpu_wheels: $(ls "$DEST" | wc -l) wheels, $((WHEELS / 1048576)) MiB ($WHEELS bytes); with the tree" \
  "($((TREE / 1048576)) MiB) $((TOTAL / 1048576)) MiB carried ($TOTAL bytes; limit $LIMIT_MIB MiB)"
if [ "$TOTAL" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "gpu_wheels: the tree and the wheelhouse together are over the ${LIMIT_MIB} MiB a GPU call carries" >&2
  exit 1
fi
