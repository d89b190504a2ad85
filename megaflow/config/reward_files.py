"""The local files a model-based reward reads, checked with the standard library only, by preflight and again by
the reward before it loads: a missing or malformed directory is one line. Design notes: docs/design/config.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from megaflow.config.files import check_safetensors, read_json
from megaflow.config.load import ConfigError

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
HEAD_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
IMAGEREWARD_FILES = ("ImageReward.pt", "med_config.json")
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json")
BERT_DOWNLOAD = "hf download google-bert/bert-base-uncased --local-dir TOK"
HPS_CHECKPOINT = "hf download xswu/HPSv2 HPS_v2.1_compressed.pt --local-dir DIR (path = DIR/HPS_v2.1_compressed.pt)"
CLIP_H_TOKENIZER = "hf download laion/CLIP-ViT-H-14-laion2B-s32B-b79K --local-dir DIR"
# reward name -> (kwarg naming the model dir, kwarg naming the processor dir or None, kwarg naming a head file
# or None, what the user downloads)
MODEL_REWARDS: dict[str, tuple[str, str | None, str | None, str]] = {
    "clipscore": ("path", None, None, "hf download openai/clip-vit-large-patch14 --local-dir DIR"),
    "pickscore": ("path", "processor_path", None,
                  "hf download yuvalkirstain/PickScore_v1 --local-dir DIR (processor: "
                  "laion/CLIP-ViT-H-14-laion2B-s32B-b79K)"),
    "aesthetic": ("clip_path", None, "head_path",
                  "hf download openai/clip-vit-large-patch14 --local-dir DIR, and the LAION aesthetic head file"),
    "imagereward": ("path", "tokenizer_path", None, "hf download THUDM/ImageReward --local-dir DIR"),
    "hpsv2": ("path", "tokenizer_path", None, f"{HPS_CHECKPOINT}; tokenizer: {CLIP_H_TOKENIZER}"),
}
# Rewards whose model argument names an OpenCLIP checkpoint FILE and whose processor argument a tokenizer
# directory (megaflow.rewards.hps): name -> (the checkpoint's download, the tokenizer's download).
CHECKPOINT_REWARDS: dict[str, tuple[str, str]] = {"hpsv2": (HPS_CHECKPOINT, CLIP_H_TOKENIZER)}


def check_model_dir(path: object, key: str, *, processor: bool = True, hint: str = "") -> Path:
    """A transformers model directory: ``config.json`` (a JSON object) and, with ``processor``, a processor
    config; ConfigError naming ``key`` and the path otherwise."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{key}: expected the path of a local model directory, got {path!r}")
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{key}: {p} is not a directory")
    if not (p / "config.json").is_file():
        raise ConfigError(f"{key}: {p} has no config.json (not a transformers model directory)")
    read_json(p / "config.json", key)
    if processor:
        check_processor_dir(path, key, hint)
    return p


def check_processor_dir(path: object, key: str, hint: str = "") -> Path:
    """A directory a ``CLIPProcessor`` loads from (one of ``PROCESSOR_FILES``); ``hint`` ends the message."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{key}: expected the path of a local processor directory, got {path!r}")
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{key}: {p} is not a directory")
    if not any((p / f).is_file() for f in PROCESSOR_FILES):
        raise ConfigError(f"{key}: {p} has no {' or '.join(PROCESSOR_FILES)} (not a CLIP processor directory){hint}")
    return p


def check_weights_file(path: object, key: str, what: str, download: str) -> Path:
    """A weights file (``HEAD_SUFFIXES``; a safetensors header is checked); ConfigError naming ``key`` and how to
    download it (``download``) otherwise, ``what`` saying what is missing when ``path`` is None."""
    if path is None:
        raise ConfigError(f"{key}: {what} ({download})")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{key}: expected the path of a local weights file, got {path!r} ({download})")
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{key}: {p} is a directory; name the weights file in it ({download})")
    if not p.is_file():
        raise ConfigError(f"{key}: no such file {p} ({download})")
    if p.suffix not in HEAD_SUFFIXES:
        raise ConfigError(f"{key}: {p} is not a weights file (expected {', '.join(HEAD_SUFFIXES)})")
    if p.suffix == ".safetensors":
        check_safetensors(p, key)
    return p


def check_tokenizer_dir(path: object, key: str, name: str, download: str) -> Path:
    """A CLIP tokenizer directory (``tokenizer.json``, or ``vocab.json`` and ``merges.txt``)."""
    if path is None:
        raise ConfigError(f"{key}: the {name} reward needs a local CLIP tokenizer directory ({download})")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{key}: expected the path of a local tokenizer directory, got {path!r} ({download})")
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{key}: {p} is not a directory ({download})")
    if not (p / "tokenizer.json").is_file() and not all((p / f).is_file() for f in ("vocab.json", "merges.txt")):
        raise ConfigError(f"{key}: {p} has no tokenizer.json or vocab.json + merges.txt (not a CLIP tokenizer "
                          f"directory; {download})")
    return p


def check_model_reward(name: str, kwargs: Mapping[str, object], where: str | None = None) -> None:
    """The files of model reward ``name`` (a key of ``MODEL_REWARDS``) its ``kwargs`` name; ``where`` comes
    before each argument's name in messages (default ``reward.kwargs.<name>.``; ``megaflow eval reward``:
    ``--kwargs ``)."""
    model_key, processor_key, head_key, download = MODEL_REWARDS[name]
    where = f"reward.kwargs.{name}." if where is None else where
    if name in CHECKPOINT_REWARDS:
        checkpoint, tokenizer = CHECKPOINT_REWARDS[name]
        check_weights_file(kwargs.get(model_key), f"{where}{model_key}", f"the {name} reward needs its checkpoint file",
                           checkpoint)
        check_tokenizer_dir(kwargs.get(processor_key), f"{where}{processor_key}", name, tokenizer)
        return
    if name == "imagereward":
        check_imagereward(kwargs, where)
        return
    if model_key not in kwargs:
        raise ConfigError(f"{where}{model_key}: the {name} reward needs a local model directory ({download})")
    separate = processor_key is not None and kwargs.get(processor_key) is not None
    hint = f"; or name one with {processor_key}" if processor_key else ""
    check_model_dir(kwargs[model_key], f"{where}{model_key}", processor=not separate, hint=hint)
    if separate:
        check_processor_dir(kwargs[processor_key], f"{where}{processor_key}")
    if head_key is not None:
        check_weights_file(kwargs.get(head_key), f"{where}{head_key}", f"the {name} reward needs its head's weights "
                           "file", download)


def _directory(path: object, key: str, what: str) -> Path:
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{key}: expected the path of {what}, got {path!r}")
    if not Path(path).is_dir():
        raise ConfigError(f"{key}: {path} is not a directory")
    return Path(path)


def check_imagereward(kwargs: Mapping[str, object], where: str) -> None:
    """``path``: a directory holding ``IMAGEREWARD_FILES``; ``tokenizer_path``: a BERT tokenizer directory (both
    required; each message names the download)."""
    download = MODEL_REWARDS["imagereward"][3]
    if kwargs.get("path") is None:
        raise ConfigError(f"{where}path: the imagereward reward needs the directory of its download ({download})")
    p = _directory(kwargs["path"], f"{where}path", "the ImageReward download")
    for name in IMAGEREWARD_FILES:
        if not (p / name).is_file():
            raise ConfigError(f"{where}path: {p} has no {name} (not an ImageReward download: {download})")
    read_json(p / "med_config.json", f"{where}path")
    if kwargs.get("tokenizer_path") is None:
        raise ConfigError(f"{where}tokenizer_path: the imagereward reward needs the bert-base-uncased tokenizer's "
                          f"directory ({BERT_DOWNLOAD})")
    t = _directory(kwargs["tokenizer_path"], f"{where}tokenizer_path", "a tokenizer directory")
    if not any((t / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{where}tokenizer_path: {t} has no {' or '.join(TOKENIZER_FILES)} (not a BERT tokenizer "
                          f"directory: {BERT_DOWNLOAD})")
