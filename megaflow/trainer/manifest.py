"""A checkpoint's integrity manifest: ``MANIFEST.json``, every file with its size and digest (``megaflow.checksum``).

Invariant: written last (temp file, fsync, rename) and checked before anything in the checkpoint is read; a
sub-directory with its own manifest is listed as that manifest only. Design notes: docs/design/trainer.md.
"""
from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath

from megaflow.checksum import ALGORITHMS, DEFAULT, file_digest

MANIFEST = "MANIFEST.json"
FORMAT = 1
TRUST_HINT = "pass --trust-checkpoint to load it unchecked, only if you trust where it came from"


def _files(directory: Path) -> list[str]:
    """Relative POSIX paths of the files to list: everything under ``directory`` except its own manifest,
    with a sub-directory that has a manifest represented by that manifest alone."""
    found = []
    for root, dirs, names in os.walk(directory):
        here = Path(root)
        if here != directory and MANIFEST in names:
            found.append((here / MANIFEST).relative_to(directory).as_posix())
            dirs[:] = []
            continue
        dirs.sort()
        found += [(here / n).relative_to(directory).as_posix() for n in names
                  if not (here == directory and (n == MANIFEST or n.startswith(f".{MANIFEST}.")))]
    return sorted(found)


def write_manifest(directory: str | Path, checksum: str = DEFAULT) -> Path:
    """Write ``directory/MANIFEST.json`` (atomically: temp file, fsync, rename) listing every file's size and
    ``checksum`` digest; call it when every other file is written."""
    if checksum not in ALGORITHMS:
        raise ValueError(f"unknown checksum {checksum!r}; expected one of {', '.join(ALGORITHMS)}")
    directory = Path(directory)
    files = {rel: {"size": (directory / rel).stat().st_size, "digest": file_digest(directory / rel, checksum)}
             for rel in _files(directory)}
    tmp = directory / f".{MANIFEST}.tmp"
    try:
        with open(tmp, "w") as fh:
            json.dump({"format": FORMAT, "checksum": checksum, "files": files}, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    final = directory / MANIFEST
    os.replace(tmp, final)
    return final


def _read(path: Path) -> tuple[str, dict]:
    try:
        manifest = json.loads(path.read_text())
        checksum, files = manifest["checksum"], manifest["files"]
        if manifest.get("format") != FORMAT or checksum not in ALGORITHMS or not isinstance(files, dict):
            raise ValueError
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError):
        raise ValueError(f"{path}: unreadable or unsupported checkpoint manifest") from None
    for rel, entry in files.items():
        parts = PurePosixPath(rel)
        if not rel or parts.is_absolute() or ".." in parts.parts or "\0" in rel:
            raise ValueError(f"{path}: lists {rel[:80]!r}, which is not a file inside the checkpoint")
        if not isinstance(entry, dict) or type(entry.get("size")) is not int or type(entry.get("digest")) is not str:
            raise ValueError(f"{path}: the entry of {rel[:80]!r} is not {{size, digest}}")
    return checksum, files


def verify_manifest(directory: str | Path, *, trust: bool = False) -> None:
    """Check ``directory`` against its manifest (and sub-manifests); ValueError of one line naming the first
    file that is missing, of the wrong size, modified or not listed, or the missing manifest (unless ``trust``)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        if trust:
            return
        raise ValueError(f"{path}: missing (a checkpoint from an older megaflow, or not one megaflow wrote "
                         f"whole); {TRUST_HINT}")
    checksum, files = _read(path)
    for rel, entry in sorted(files.items()):
        f = directory / rel
        if not f.is_file():
            raise ValueError(f"{f}: missing (listed in {path})")
        size = f.stat().st_size
        if size != entry.get("size"):
            raise ValueError(f"{f}: {size} bytes, {entry.get('size')} in {path} (truncated or altered)")
        if file_digest(f, checksum) != entry.get("digest"):
            raise ValueError(f"{f}: contents differ from its {checksum} digest in {path} (corrupted or modified)")
    extra = sorted(set(_files(directory)) - set(files))
    if extra:
        raise ValueError(f"{directory / extra[0]}: not listed in {path} (an unexpected file in the checkpoint)")
    for rel in files:
        if Path(rel).name == MANIFEST:
            verify_manifest((directory / rel).parent)
