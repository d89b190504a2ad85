"""Clips on disk for video ShapeEval: a folder of clips read back as uint8 [F, H, W, 3] (MP4 / GIF as
``report/video.py`` writes them, a folder of PNG frames, or a ``.npy`` array), and clips written as PNG-frame
folders with a manifest. Invariant: every bad file is one ValueError line naming it; nothing is unpickled.
Folder format: docs/design/video_shapeeval.md.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from megaflow.shapeeval.score import MANIFEST, load_image, open_image, prompt_from_filename, read_manifest_pairs

VIDEO_SUFFIXES = (".mp4", ".gif", ".npy")
MAX_FRAMES = 512  # a longer clip is refused (video ShapeEval clips have a handful of frames)


def _is_clip(path: Path) -> bool:
    if path.is_dir():
        return any(p.suffix.lower() == ".png" for p in path.iterdir())
    return path.suffix.lower() in VIDEO_SUFFIXES


def list_clips(clips_dir: Path) -> list[tuple[Path, str]]:
    """(clip path, prompt) pairs of a folder: from its manifest.jsonl, else every clip in it (a .mp4 / .gif / .npy
    file, or a sub-folder of PNG frames) with its prompt in its name, as for images."""
    clips_dir = Path(clips_dir)
    if not clips_dir.is_dir():
        raise ValueError(f"video ShapeEval clips dir does not exist: {clips_dir}")
    if (clips_dir / MANIFEST).is_file():
        items = read_manifest_pairs(clips_dir)
    else:
        items = [(p, prompt_from_filename(p)) for p in sorted(clips_dir.iterdir()) if _is_clip(p)]
    if not items:
        raise ValueError(f"no clips (.mp4, .gif, .npy, folders of PNG frames) or empty {MANIFEST} in {clips_dir}")
    return items


def _npy(path: Path) -> np.ndarray:
    """uint8 [F, H, W, 3] from an array saved as uint8 [F, H, W, 3] or float in [0, 1] as [F, H, W, 3] or
    [F, 3, H, W] (the rewards' layout)."""
    arr = np.load(path, allow_pickle=False)
    if arr.ndim == 4 and arr.shape[1] == 3 and arr.shape[-1] != 3 and arr.dtype.kind == "f":
        arr = arr.transpose(0, 2, 3, 1)
    if arr.ndim != 4 or arr.shape[-1] != 3 or not (arr.dtype == np.uint8 or arr.dtype.kind == "f"):
        raise ValueError(f"want uint8 [F, H, W, 3] or float [F, 3, H, W] / [F, H, W, 3] in [0, 1], got {arr.dtype} "
                         f"{tuple(arr.shape)}")
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all():
            raise ValueError("float frames hold NaN or inf")
        arr = np.round(np.clip(arr, 0.0, 1.0) * 255).astype(np.uint8)
    return arr


def _gif(path: Path, num_frames: int | None) -> np.ndarray:
    """A GIF's frames, each repeated as its duration says: Pillow merges equal consecutive frames into one longer
    one, so a frame lasting k base durations is k frames. The base: the clip's length over ``num_frames`` when
    that many frames are expected and every duration is a whole number of it, else the durations' greatest common
    divisor."""
    from PIL import ImageSequence

    frames, durations = [], []
    with open_image(path) as im:
        for frame in ImageSequence.Iterator(im):
            frames.append(load_rgb(frame))
            durations.append(max(1, int(frame.info.get("duration", 0) or 1)))
            if len(frames) > MAX_FRAMES:
                break
    base = float(math.gcd(*durations))
    if num_frames and len(frames) < num_frames:
        even = sum(durations) / num_frames
        if all(abs(d / even - round(d / even)) < 0.25 for d in durations):
            base = even
    return np.stack([f for f, d in zip(frames, durations) for _ in range(max(1, round(d / base)))])


def load_rgb(frame) -> np.ndarray:
    """A PIL frame as uint8 [H, W, 3], transparency composited onto the white background (``score.load_image``'s
    rule)."""
    from PIL import Image

    from megaflow.data.shapes import BACKGROUND
    rgba = frame.convert("RGBA")
    return np.asarray(Image.alpha_composite(Image.new("RGBA", rgba.size, BACKGROUND + (255,)), rgba).convert("RGB"),
                      dtype=np.uint8).copy()


def _read(path: Path, num_frames: int | None) -> np.ndarray:
    if path.is_dir():
        pngs = sorted(p for p in path.iterdir() if p.suffix.lower() == ".png")
        frames = [load_image(p) for p in pngs[:MAX_FRAMES + 1]]
        if len({f.shape for f in frames}) > 1:
            raise ValueError(f"frames of different sizes: {sorted({f.shape[:2] for f in frames})}")
        return np.stack(frames)
    suffix = path.suffix.lower()
    if suffix == ".npy":
        return _npy(path)
    if suffix == ".gif":
        return _gif(path, num_frames)
    if suffix == ".mp4":
        import imageio.v2 as iio2  # the writer's plugin (report/video.py): imageio's ffmpeg
        frames = iio2.mimread(path, format="FFMPEG", memtest=False)
        return np.stack([np.asarray(f, dtype=np.uint8)[..., :3] for f in frames[:MAX_FRAMES + 1]])
    raise ValueError(f"not a clip (want {', '.join(VIDEO_SUFFIXES)} or a folder of PNG frames)")


def load_clip(path: Path, *, num_frames: int | None = None) -> np.ndarray:
    """uint8 [F, H, W, 3] of a clip file or PNG-frame folder; ValueError naming the file when it cannot be read, is
    not a clip of at least 2 frames (at most ``MAX_FRAMES``), or has other than ``num_frames`` frames (when given)."""
    path = Path(path)
    try:
        clip = _read(path, num_frames)
    except ValueError as e:
        raise ValueError(f"clip {path}: {e}") from None
    except Exception as e:  # noqa: BLE001 - whatever a decoder raises on a damaged file: one line naming it
        raise ValueError(f"cannot read clip {path}: {type(e).__name__}: {str(e)[:200]}") from None
    if not 2 <= clip.shape[0] <= MAX_FRAMES:
        raise ValueError(f"clip {path}: {clip.shape[0]} frames, want 2 to {MAX_FRAMES}")
    if num_frames is not None and clip.shape[0] != num_frames:
        raise ValueError(f"clip {path}: {clip.shape[0]} frames, want {num_frames} (--frames)")
    return clip


def save_clips(clips: np.ndarray, prompts: list[str], out_dir: Path) -> None:
    """Each uint8 clip [F, H, W, 3] as a folder of PNG frames (lossless: ``0007/00.png`` ...) and
    ``manifest.jsonl`` listing them with their prompts: a folder ``list_clips`` reads back."""
    from PIL import Image

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (clip, prompt) in enumerate(zip(clips, prompts)):
        name = f"{i:04d}"
        (out_dir / name).mkdir(exist_ok=True)
        for f, frame in enumerate(clip):
            Image.fromarray(frame).save(out_dir / name / f"{f:02d}.png")
        rows.append(json.dumps({"file": name, "prompt": prompt}))
    (out_dir / MANIFEST).write_text("\n".join(rows) + "\n")
