"""ShapeEval entry points: score a folder of generated images, or the ground-truth renderer.

Image folder format (``evaluate_images``) (design notes: docs/design/shapeeval.md).
"""
from __future__ import annotations

import json
import math
import random
import re
import warnings
from pathlib import Path

import numpy as np
from PIL import Image

from megaflow.shapeeval.render import CORRUPTIONS, corrupt_scene, render_scene
from megaflow.data.shapes import BACKGROUND, Scene, parse_prompt, sample_scenes
from megaflow.shapeeval.checker import SceneScore, score_image

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
MANIFEST = "manifest.jsonl"
_INDEX_PREFIX = re.compile(r"^\d+[-_]")


def prompt_from_filename(path: Path) -> str:
    """The prompt a file name carries (see the module's design notes)."""
    return _INDEX_PREFIX.sub("", path.stem, count=1).replace("_", " ")


def read_manifest_pairs(images_dir: Path) -> list[tuple[Path, str]]:
    """(path, prompt) of each line of a folder's manifest.jsonl (``{"file", "prompt"}``; a file inside the folder);
    ValueError naming the line otherwise."""
    items = []
    try:
        lines = (images_dir / MANIFEST).read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{images_dir / MANIFEST} is not UTF-8 text (want one JSON object a line)") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            path, prompt = images_dir / row["file"], str(row["prompt"])
            inside = path.resolve().is_relative_to(images_dir.resolve())
        except (json.JSONDecodeError, KeyError, TypeError, RecursionError) as e:
            raise ValueError(f"{images_dir / MANIFEST} line {n}: want {{\"file\", \"prompt\"}} ({e!r})") from None
        except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
            raise ValueError(f"{images_dir / MANIFEST} line {n}: image {row['file']!r} cannot be opened "
                             f"({e})") from None
        if not inside:
            raise ValueError(f"{images_dir / MANIFEST} line {n}: {row['file']!r} is outside the folder")
        items.append((path, prompt))
    return items


def list_images(images_dir: Path) -> list[tuple[Path, str]]:
    """(image path, prompt) pairs of a folder, from its manifest or its file names."""
    images_dir = Path(images_dir)
    if not images_dir.is_dir():
        raise ValueError(f"ShapeEval images dir does not exist: {images_dir}")
    if (images_dir / MANIFEST).is_file():
        items = read_manifest_pairs(images_dir)
    else:
        files = sorted(p for p in images_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        items = [(p, prompt_from_filename(p)) for p in files]
    if not items:
        raise ValueError(f"no images (or empty {MANIFEST}) in {images_dir}")
    return items


MAX_SIDE = 256  # larger images are box-downscaled first (the checker needs no more; 4000 px took 115 s)
MAX_PIXELS = 8192 * 8192  # larger images are refused from their header, before decoding (PIL warns from 89 M)


def open_image(path: Path) -> Image.Image:
    """The image opened lazily (only its header read); ValueError naming the file when it is not an image or
    has more than MAX_PIXELS pixels (checked before anything is decoded)."""
    too_big = f"cannot read image {path}: more than {MAX_PIXELS} pixels (8192 x 8192), refused before decoding"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(path)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ValueError(too_big) from None
    except Exception as e:  # noqa: BLE001 - PIL's plugins raise OSError, ValueError (a huge text chunk), SyntaxError...
        raise ValueError(f"cannot read image {path}: {type(e).__name__}: {str(e)[:200]}") from None
    if im.width * im.height > MAX_PIXELS:
        im.close()
        raise ValueError(f"{too_big} ({im.width} x {im.height})")
    return im


def check_image_files(paths) -> None:
    """Each file's header read (``open_image``): ValueError naming the first that is no image this reader takes."""
    for path in paths:
        open_image(path).close()


def load_image(path: Path) -> np.ndarray:
    """uint8 [H, W, 3]; transparency is composited onto the white background (a fully transparent
    image is blank, not whatever its hidden RGB says); images larger than MAX_SIDE are box-downscaled.
    ValueError naming the file when it cannot be read or is larger than MAX_PIXELS (``open_image``)."""
    lazy = open_image(path)
    try:
        with lazy as im:
            im.load()
            if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
                rgba = im.convert("RGBA")
                canvas = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
                im = Image.alpha_composite(canvas, rgba)
            im = im.convert("RGB")
            if max(im.size) > MAX_SIDE:
                scale = MAX_SIDE / max(im.size)
                im = im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))), Image.BOX)
            return np.asarray(im, dtype=np.uint8).copy()
    except Exception as e:  # noqa: BLE001 - whatever the decoder raises on a damaged file: one line naming it
        raise ValueError(f"cannot read image {path}: {type(e).__name__}: {str(e)[:200]}") from None


def ci95(p: float, n: int) -> list[float]:
    """Wilson 95% interval of a proportion ``p`` over ``n`` samples."""
    if n == 0:
        return [0.0, 1.0]
    z = 1.959964
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def with_intervals(summary: dict) -> dict:
    """``summarize``'s dict with Wilson 95% intervals: ``ci95`` (accuracy) and ``per_category_ci95``."""
    out = dict(summary, ci95=ci95(summary["accuracy"], summary["num"]))
    out["per_category_ci95"] = {c: ci95(a, out["per_category_num"][c]) for c, a in out["per_category"].items()}
    return out


def summarize(scores: list[SceneScore]) -> dict:
    """Aggregate verdicts into the ShapeEval result dict (categories in first-seen order)."""
    assert scores, "nothing to summarize"
    cats: dict[str, list[SceneScore]] = {}
    for s in scores:
        cats.setdefault(s.category, []).append(s)
    return {
        "accuracy": float(np.mean([s.passed for s in scores])),
        "partial_mean": float(np.mean([s.partial for s in scores])),
        "num": len(scores),
        "per_category": {c: float(np.mean([s.passed for s in v])) for c, v in cats.items()},
        "per_category_partial": {c: float(np.mean([s.partial for s in v])) for c, v in cats.items()},
        "per_category_num": {c: len(v) for c, v in cats.items()},
    }


def evaluate_images(images_dir: Path, *, details: bool = False) -> dict:
    """Score every image of a folder against its prompt (format in the module's design notes).
    Raises ValueError naming the problem: missing dir, no images, unreadable image, bad manifest
    line, or a prompt outside the ShapeEval grammar."""
    images_dir = Path(images_dir)
    items = list_images(images_dir)
    scores, samples = [], []
    for path, prompt in items:
        try:
            scene = parse_prompt(prompt)
        except ValueError as e:
            raise ValueError(f"{path.name}: {e}") from None
        score = score_image(load_image(path), scene)
        scores.append(score)
        samples.append({"file": str(path.relative_to(images_dir)) if path.is_relative_to(images_dir)
                        else str(path), "prompt": prompt, "category": score.category,
                        "passed": score.passed, "partial": score.partial})
    out = summarize(scores)
    if details:
        out["samples"] = samples
    return out


def _check_num(num: int) -> None:
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")


def evaluate_ground_truth(num: int, seed: int = 0, resolution: int = 32, *, supersample: int = 1) -> dict:
    """Render ``num`` held-out (eval split) prompts with the ground-truth renderer and score them:
    the checker's ceiling, expected >= 0.99."""
    _check_num(num)
    rng = random.Random(seed)
    scores = [score_image(render_scene(s, resolution=resolution, rng=rng, supersample=supersample), s)
              for s in sample_scenes("eval", num, seed=seed)]
    return {**summarize(scores), "resolution": resolution, "seed": seed}


def evaluate_corruption(kind: str, num: int, seed: int = 0, resolution: int = 32, *,
                        supersample: int = 1) -> dict:
    """Render a ``kind``-corrupted variant of held-out prompts (see ``corrupt_scene``) and score it
    against the ORIGINAL prompt: accuracy should be ~0. Prompts where the corruption does not
    apply (e.g. colour on a colour-free prompt) are skipped; ``num`` counts scored ones."""
    _check_num(num)
    if kind not in CORRUPTIONS:
        raise ValueError(f"unknown corruption: {kind!r} (known: {', '.join(CORRUPTIONS)})")
    rng = random.Random(seed)
    scores: list[SceneScore] = []
    pool = sample_scenes("eval", 50 * num, seed=seed)
    for scene in pool:
        bad: Scene | None = corrupt_scene(scene, kind, rng)
        if bad is None:
            continue
        image = render_scene(bad, resolution=resolution, rng=rng, supersample=supersample)
        scores.append(score_image(image, scene))
        if len(scores) == num:
            break
    return {**summarize(scores), "corruption": kind, "resolution": resolution, "seed": seed}
