"""What the GPU wheelhouse holds and how it installs (lists, slimmed wheels, the ``sgl_kernel`` stand-in, call
size); standard library only. Invariant: a slimmed wheel is a valid wheel of the same name and version (dropped
files gone from archive and RECORD, the rest byte-identical). Design notes: docs/design/testing.md.
"""
from __future__ import annotations

import base64
import csv
import fnmatch
import hashlib
import importlib.util
import io
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ALWAYS = ("megatron_core", "diffusers", "megaflow", "sglang", "megaflow_sgl_kernel_standin")
"""Installed on every GPU machine (the image has none of them)."""
TRAINER_IF_MISSING = {
    "psutil": "psutil", "importlib_metadata": "importlib_metadata", "zipp": "zipp", "filelock": "filelock",
    "httpx": "httpx", "httpcore": "httpcore", "h11": "h11", "anyio": "anyio", "sniffio": "sniffio", "idna": "idna",
    "certifi": "certifi", "requests": "requests", "urllib3": "urllib3", "charset_normalizer": "charset_normalizer",
    "regex": "regex", "safetensors": "safetensors", "huggingface_hub": "huggingface_hub", "PIL": "pillow",
    "einops": "einops", "tqdm": "tqdm", "typing_extensions": "typing_extensions",
    "rapidfuzz": "rapidfuzz"}
"""import name -> distribution of what megatron-core, diffusers and megaflow import, installed only where the
image cannot import it (psutil: megatron's dist_checkpointing; rapidfuzz: the ocr reward, which megaflow's reward
registry imports; the rest: diffusers' pure-Python dependencies)."""
ENGINE_IF_MISSING = {
    "orjson": "orjson", "pybase64": "pybase64", "msgspec": "msgspec", "zmq": "pyzmq", "pydantic": "pydantic",
    "pydantic_core": "pydantic_core", "annotated_types": "annotated_types", "typing_inspection": "typing_inspection",
    "fastapi": "fastapi", "starlette": "starlette", "uvicorn": "uvicorn", "multipart": "python_multipart",
    "opentelemetry": "opentelemetry_api", "IPython": "ipython", "traitlets": "traitlets", "openai": "openai",
    "distro": "distro", "partial_json_parser": "partial_json_parser", "tvm_ffi": "apache_tvm_ffi", "dill": "dill",
    "compressed_tensors": "compressed_tensors", "loguru": "loguru", "gguf": "gguf", "addict": "addict",
    "cache_dit": "cache_dit", "imageio_ffmpeg": "imageio_ffmpeg", "setproctitle": "setproctitle"}
"""import name -> distribution of what sglang 0.5.23's diffusion engine imports (sglang's own ``__init__`` included)
and the GPU image lacks, found by running the engine in the mirror of the image (scripts/gpu_mirror_check.sh);
installed only where the image cannot import it."""
HUB_MIN = (0, 34)
"""diffusers needs huggingface-hub >= 0.34: an older one on the image is shadowed by the wheelhouse's."""
SGLANG_DROP = (
    "sglang/srt/rust_extensions/*.so",         # the Rust gRPC/HTTP server, benchmarks (41 MiB unpacked)
    "sglang/srt/mem_cache/rust_tree_core/*.so",  # the LLM radix cache
    "sglang/test/*", "sglang/multimodal_gen/test/*", "sglang/srt/*/test/*",
    "sglang/benchmark/*", "sglang/multimodal_gen/.agents/*", "sglang/multimodal_gen/docs/*",
)
"""What the engine wheelhouse drops from sglang's wheel: compiled extensions and files the diffusion engine never
imports (the mirror check, scripts/gpu_mirror_check.sh, runs the engine without them)."""
SLIM = {"sglang": SGLANG_DROP, "imageio_ffmpeg": ("imageio_ffmpeg/binaries/ffmpeg-*",)}
"""Distribution -> what its wheel drops. imageio_ffmpeg: its bundled 70 MiB ffmpeg binary (only video output, which
an image rollout never writes, runs it; the module imports without it)."""
STANDIN_NAME, STANDIN_VERSION = "megaflow_sgl_kernel_standin", "0.0.0"


def normalize(name: str) -> str:
    """A distribution's name as package indexes compare them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def image_packages(path: Path) -> dict[str, str | None]:
    """docs/gpu/image-packages.txt: normalized name -> version (None where the list gives none)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[normalize(name)] = version or None
    return out


def pins(pyproject: Path, image: dict, installed_version) -> list[str]:
    """``name==version`` of every wheel to download: megatron-core and sglang as pyproject.toml pins them,
    diffusers at the version its comment names (sglang[diffusion]'s pin), and each ``*_IF_MISSING`` distribution
    the image lacks at ``installed_version(dist)`` (the tested venv's; None: unpinned)."""
    import tomllib

    text = pyproject.read_text()
    deps = tomllib.loads(text)["project"]["dependencies"]
    found = {normalize(re.split(r"[\[=<>]", d)[0]): d for d in deps}
    m = re.search(r"diffusers (\d+\.\d+\.\d+)", text)
    if m is None or "megatron-core" not in found or "sglang" not in found:
        raise ValueError(f"{pyproject}: expected megatron-core and sglang pins and a 'diffusers X.Y.Z' comment")
    out = [found["megatron-core"], "sglang==" + found["sglang"].split("==")[1], f"diffusers=={m.group(1)}"]
    for dist in {**TRAINER_IF_MISSING, **ENGINE_IF_MISSING}.values():
        if normalize(dist) in image:
            continue
        version = installed_version(dist)
        out.append(f"{dist}=={version}" if version else dist)
    return out


def wanted(wheels: Path, can_import=lambda m: importlib.util.find_spec(m) is not None,
           version_of=None) -> tuple[list[str], list[str]]:
    """(distributions to install from ``wheels`` here, distributions needed here but without a wheel there):
    ``ALWAYS``, and each ``*_IF_MISSING`` one whose module this interpreter cannot import (huggingface_hub also
    where the image's is older than ``HUB_MIN``)."""
    have = {normalize(p.name.split("-")[0]) for p in wheels.glob("*.whl")}
    need = list(ALWAYS)
    for module, dist in {**TRAINER_IF_MISSING, **ENGINE_IF_MISSING}.items():
        if not can_import(module):
            need.append(dist)
    if "huggingface_hub" not in need and _older(version_of or _version, "huggingface_hub", HUB_MIN):
        need.append("huggingface_hub")
    return [d for d in need if normalize(d) in have], [d for d in need if normalize(d) not in have]


def _version(dist: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _older(version_of, dist: str, minimum: tuple[int, ...]) -> bool:
    version = version_of(dist)
    try:
        return version is not None and tuple(int(x) for x in version.split(".")[:len(minimum)]) < minimum
    except ValueError:
        return False


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _write_wheel(path: Path, files: dict[str, bytes], record_name: str) -> None:
    """A wheel at ``path`` holding ``files`` (archive name -> bytes) plus a fresh RECORD."""
    rows = [(name, _record_hash(data), str(len(data))) for name, data in files.items() if name != record_name]
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([*rows, (record_name, "", "")])
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for name, data in files.items():
            if name != record_name:
                z.writestr(name, data)
        z.writestr(record_name, buf.getvalue())


def slim_wheel(wheel: Path, out_dir: Path, patterns: tuple[str, ...] | list[str]) -> tuple[Path, list[str]]:
    """Copy ``wheel`` into ``out_dir`` (same file name) without the members matching any fnmatch ``pattern``;
    (the new wheel, the dropped names)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files, dropped, record = {}, [], None
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if name.endswith(".dist-info/RECORD"):
                record = name
            if info.is_dir():
                continue
            if any(fnmatch.fnmatchcase(name, p) for p in patterns):
                dropped.append(name)
            else:
                files[name] = z.read(info)
    if record is None:
        raise ValueError(f"{wheel.name}: no .dist-info/RECORD (not a wheel)")
    out = out_dir / wheel.name
    _write_wheel(out, files, record)
    return out, dropped


def slim_dir(wheels: Path) -> list[str]:
    """Replace each wheel in ``wheels`` named in ``SLIM`` by its slimmed copy; one line per wheel slimmed."""
    lines = []
    for wheel in sorted(wheels.glob("*.whl")):
        patterns = SLIM.get(normalize(wheel.name.split("-")[0]).replace("-", "_"))
        if patterns:
            before = wheel.stat().st_size
            tmp = wheels / ".slim"
            out, dropped = slim_wheel(wheel, tmp, patterns)
            out.replace(wheel)
            tmp.rmdir()
            lines.append(f"{wheel.name}: dropped {len(dropped)} files, {before / 2**20:.1f} -> "
                         f"{wheel.stat().st_size / 2**20:.1f} MiB")
    return lines


def standin_wheel(src: Path, out_dir: Path) -> Path:
    """The wheel of the ``sgl_kernel`` stand-in package in ``src`` (``src/sgl_kernel/*.py``)."""
    info = f"{STANDIN_NAME}-{STANDIN_VERSION}.dist-info"
    files = {f"sgl_kernel/{p.name}": p.read_bytes() for p in sorted((src / "sgl_kernel").glob("*.py"))}
    if "sgl_kernel/__init__.py" not in files:
        raise ValueError(f"{src}: no sgl_kernel/__init__.py")
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: {STANDIN_NAME}\nVersion: {STANDIN_VERSION}\n"
                                 "Summary: megaflow's sgl_kernel stand-in for bare GPU check machines (raises on "
                                 "any kernel use)\n").encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: megaflow\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{STANDIN_NAME}-{STANDIN_VERSION}-py3-none-any.whl"
    _write_wheel(out, files, f"{info}/RECORD")
    return out


def tree_bytes(repo: Path) -> int:
    """Bytes of what a GPU call carries of the checkout: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         check=True, capture_output=True).stdout
    paths = {p for p in out.decode().split("\0") if p}
    return sum((repo / p).stat().st_size for p in paths if (repo / p).is_file())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str]) -> int:
    what, *args = argv
    if what == "pins":
        print("\n".join(pins(Path(args[0]), image_packages(Path(args[1])), _version)))
    elif what == "slim":
        print("\n".join(slim_dir(Path(args[0]))))
    elif what == "wanted":
        install, absent = wanted(Path(args[0]))
        if absent:
            print(f"wheelhouse: needed here but not in {args[0]}: {' '.join(absent)}", file=sys.stderr)
        print(" ".join(install))
    elif what == "standin":
        print(standin_wheel(Path(args[0]), Path(args[1])).name)
    elif what == "carried":
        tree, wheels = tree_bytes(Path(args[0])), dir_bytes(Path(args[1]))
        print(f"{tree} {wheels} {tree + wheels}")
    else:
        raise SystemExit(f"unknown command {what!r} (pins | slim | standin | carried | wanted)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
