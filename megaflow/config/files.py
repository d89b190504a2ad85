"""Cheap checks of the files a run or a tool reads, standard library only: each raises ONE ConfigError line
naming the file and what is wrong, before any heavy import. Design notes: docs/design/config.md.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from megaflow.config.load import ConfigError

# Bytes per element of the safetensors dtypes (sub-byte and future dtypes are not size-checked).
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8}
_MAX_HEADER = 100_000_000  # the safetensors library's own limit
MAX_TEXT_BYTES = 64 << 20  # a prompt file larger than this is refused before it is read
# What the metrics backends write in a run dir (megaflow.report.tensorboard_backend, wandb_backend): the event
# files, W&B's files, the W&B run id.
TENSORBOARD_DIR, WANDB_DIR, WANDB_ID_FILE = "tensorboard", "wandb", "wandb_id"
CKPT_META = "megaflow_model.json"  # family + diffusers config of a megaflow checkpoint (trainer/checkpoint, run/checkpoints)


def shown(path: object) -> str:
    """A path as a one-line message shows it: whole up to 160 characters, else its two ends and its length."""
    text = str(path)
    return text if len(text) <= 160 else f"{text[:60]}...{text[-40:]} ({len(text)} characters)"


def os_error(key: str, path: object, error: OSError) -> ConfigError:
    """The one line for a path the file system refuses (too long, a symlink loop, no permission)."""
    return ConfigError(f"{key}: {shown(path)}: {error.strerror or type(error).__name__}")


def check_text_file(path: str | Path, key: str, *, max_line: int | None = None) -> list[str]:
    """The non-blank lines of a UTF-8 text file; ConfigError (``key: path: why``) when it has none, is over
    ``MAX_TEXT_BYTES`` or (``max_line``) has a line longer than ``max_line`` characters."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{key}: no such file {path}")
    if not path.is_file():
        raise ConfigError(f"{key}: {path} is not a file")
    size = path.stat().st_size
    if size > MAX_TEXT_BYTES:
        raise ConfigError(f"{key}: {path} is {size / 2**20:.0f} MiB, larger than the {MAX_TEXT_BYTES >> 20} MiB "
                          "a prompt file may be")
    data = path.read_bytes()
    if b"\0" in data:
        raise ConfigError(f"{key}: {path} is a binary file (NUL bytes), expected text, one prompt a line")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{key}: {path} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})") from None
    if max_line is not None:
        for n, line in enumerate(text.splitlines(), 1):
            if len(line.strip()) > max_line:
                raise ConfigError(f"{key}: {path} line {n}: {len(line.strip())} characters, longer than the "
                                  f"{max_line} a prompt may have")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ConfigError(f"{key}: {path} is empty (no non-blank line)")
    return lines


def read_json(path: Path, key: str) -> dict:
    """A JSON object file; ConfigError naming the file when missing, unreadable or not an object."""
    if not path.is_file():
        raise ConfigError(f"{key}: {path} not found")
    try:
        obj = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(f"{key}: {path} is not valid JSON ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{key}: {path} is not a JSON object")
    return obj


def _tensor_range(path: Path, key: str, name: str, info: object) -> tuple[int, int]:
    bad = f"{key}: {path}: corrupt safetensors header entry {name!r}"
    if not isinstance(info, dict):
        raise ConfigError(bad)
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    ints = (lambda xs, n=None: isinstance(xs, list) and (n is None or len(xs) == n)
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs))
    if not isinstance(dtype, str) or not ints(shape) or not ints(offsets, 2) or offsets[0] > offsets[1]:
        raise ConfigError(bad)
    if dtype in _DTYPE_BYTES and offsets[1] - offsets[0] != math.prod(shape) * _DTYPE_BYTES[dtype]:
        raise ConfigError(f"{bad}: {offsets[1] - offsets[0]} bytes for {dtype} {shape}")
    return offsets[0], offsets[1]


def check_safetensors(path: str | Path, key: str) -> None:
    """Parse a safetensors file's header and check that the tensors exactly cover the data that follows."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ConfigError(f"{key}: {path} is truncated ({size} bytes, not even the 8-byte header length)")
        n = int.from_bytes(head, "little")
        if n == 0 or n > min(size - 8, _MAX_HEADER):
            raise ConfigError(f"{key}: {path}: corrupt or truncated safetensors file "
                              f"(header length {n}, file size {size} bytes)")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ConfigError(f"{key}: {path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{key}: {path}: corrupt safetensors header (not a JSON object)")
    ranges = sorted(_tensor_range(path, key, name, info) for name, info in header.items() if name != "__metadata__")
    end = 0
    for start, stop in ranges:
        if start != end:
            raise ConfigError(f"{key}: {path}: corrupt safetensors header (tensor data not contiguous at byte {end})")
        end = stop
    data = size - 8 - n
    if end > data:
        raise ConfigError(f"{key}: {path} is truncated (tensor data ends at byte {8 + n + end}, the file has {size})")
    if end < data:
        raise ConfigError(f"{key}: {path}: {data - end} unexpected bytes after the last tensor (corrupt file)")


def check_weights_dir(directory: Path, key: str, *, required: bool = True) -> list[Path]:
    """The safetensors files of a diffusers model folder, each header-checked; a sharded model's index
    must name only shards that exist. ConfigError when the folder has no safetensors weights and
    ``required``."""
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = read_json(indexes[0], key).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{key}: {indexes[0]} has no weight_map")
        files = [directory / name for name in sorted(set(map(str, weight_map.values())))]
        for f in files:
            if not f.is_file():
                raise ConfigError(f"{key}: shard {f} listed in {indexes[0].name} not found")
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files and required:
        raise ConfigError(f"{key}: no safetensors weights in {directory} (expected diffusion_pytorch_model"
                          ".safetensors or a *.safetensors.index.json with its shards)")
    for f in files:
        check_safetensors(f, key)
    return files


def check_pipeline(path: str | Path, key: str) -> dict[str, dict]:
    """Check a diffusers pipeline directory; returns the JSON configs of its ``transformer`` and (when it
    has one) its ``vae`` as ``{"transformer": ..., "vae": ...}``."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{key}: {path} is not a directory")
    if not (path / "model_index.json").is_file():
        raise ConfigError(f"{key}: {path} has no model_index.json (not a diffusers pipeline directory)")
    index = read_json(path / "model_index.json", key)
    components = [name for name, spec in index.items() if not name.startswith("_") and isinstance(spec, list)
                  and len(spec) == 2 and None not in spec]
    if "transformer" not in components:
        raise ConfigError(f"{key}: {path / 'model_index.json'} lists no transformer")
    for name in components:
        if not (path / name).is_dir():
            raise ConfigError(f"{key}: component folder {path / name} (listed in model_index.json) not found")
    configs = {"transformer": read_json(path / "transformer" / "config.json", key)}
    if (path / "vae" / "config.json").is_file():
        configs["vae"] = read_json(path / "vae" / "config.json", key)
    check_weights_dir(path / "transformer", key)
    for name in components:
        if name != "transformer":
            check_weights_dir(path / name, key, required=False)
    return configs


def check_megatron_checkpoint(path: str | Path, key: str) -> dict:
    """A megaflow dist checkpoint directory (torch DCP ``.metadata`` + ``megaflow_model.json``); returns the
    latter (``family``, ``diffusers_config``)."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{key}: {path} is not a directory")
    if not (path / CKPT_META).is_file():
        raise ConfigError(f"{key}: {path} is not a megaflow checkpoint ({CKPT_META} not found)")
    if not (path / ".metadata").is_file():
        raise ConfigError(f"{key}: {path} is not a megatron dist checkpoint (.metadata not found)")
    meta = read_json(path / CKPT_META, key)
    for field, kind in (("family", str), ("diffusers_config", dict)):
        if not isinstance(meta.get(field), kind):
            raise ConfigError(f"{key}: {path / CKPT_META} has no {field!r}")
    return meta


def check_backend_paths(run_dir: Path, *, wandb: bool, tensorboard: bool) -> None:
    """ConfigError when what a metrics backend writes in ``run_dir`` is there and unusable: ``tensorboard/`` or
    ``wandb/`` not a directory or not writable, ``wandb_id`` not a regular file or not writable (absent: each is
    made by the backend, in a run dir the claim checks)."""
    wanted = [(TENSORBOARD_DIR, True, "logging.tensorboard")] if tensorboard else []
    if wandb:
        wanted += [(WANDB_DIR, True, "logging.wandb"), (WANDB_ID_FILE, False, "logging.wandb")]
    for name, is_dir, key in wanted:
        path = Path(run_dir) / name
        try:
            exists = os.path.exists(path)
        except OSError as e:
            raise os_error(key, path, e) from None
        if not exists:
            if os.path.islink(path):
                raise ConfigError(f"{key}: {shown(path)} is a dangling symlink")
            continue
        if is_dir != path.is_dir() or not (is_dir or path.is_file()):
            kind = "a directory" if is_dir else "a regular file"
            raise ConfigError(f"{key}: {shown(path)} is not {kind} (the backend writes there; move it away)")
        if not os.access(path, os.W_OK | (os.X_OK if is_dir else 0)):
            raise ConfigError(f"{key}: {shown(path)} is not writable (the backend writes there)")
