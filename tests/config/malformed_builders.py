"""The harness of the malformed-input tables (test_malformed_inputs.py: configs, --set values, prompt files,
pipelines, checkpoints; test_malformed_files.py: run dirs, image folders, reward inputs): builders that make each
broken input in a temp dir, and the one check every row passes (exit 2, one stderr line, nothing written, no heavy
import)."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "assets" / "shapeeval-sd3"
HEAVY = ("torch", "megatron", "sglang", "diffusers", "transformers")
# Runs the entry point exactly as its __main__ does, then reports which heavy packages got imported.
WRAPPER = """
import importlib.util, sys
target, argv = sys.argv[1], sys.argv[2:]
if target == "cli":
    from megaflow.cli import main
else:
    spec = importlib.util.spec_from_file_location("convert_checkpoint", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main = module.main
try:
    rc = main(argv)
finally:
    print("HEAVY=" + ",".join(m for m in %r if m in sys.modules))
sys.exit(rc)
""" % (HEAVY,)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]], *, cut: int = 0) -> None:
    """A safetensors file written with the standard library (zero-filled data); ``cut`` drops trailing bytes."""
    size = {"F32": 4, "F16": 2}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = size[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    blob = len(raw).to_bytes(8, "little") + raw + bytes(offset)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob[:len(blob) - cut])


def fake_pipeline(root: Path, *, shards: int = 0) -> Path:
    """A diffusers SD3 pipeline layout with the shipped model's configs and small, well-formed weights."""
    root.mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "SD3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"], "text_encoder_3": [None, None]}))
    for comp in ("transformer", "vae"):
        (root / comp).mkdir()
        (root / comp / "config.json").write_text((SHIPPED / comp / "config.json").read_text())
    write_safetensors(root / "vae" / "diffusion_pytorch_model.safetensors", {"w": ("F32", [4, 4])})
    t = root / "transformer"
    if not shards:
        write_safetensors(t / "diffusion_pytorch_model.safetensors", {"a": ("F32", [8, 8]), "b": ("F16", [3])})
        return root
    weight_map = {}
    for i in range(1, shards + 1):
        name = f"diffusion_pytorch_model-{i:05d}-of-{shards:05d}.safetensors"
        write_safetensors(t / name, {f"w{i}": ("F32", [16, 16])})
        weight_map[f"w{i}"] = name
    (t / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


def fake_megatron_checkpoint(root: Path) -> Path:
    """The files of a megaflow dist checkpoint that are checked before torch loads it."""
    root.mkdir(parents=True)
    (root / "megaflow_model.json").write_text(json.dumps({"format": 1, "family": "sd3", "diffusers_config": {}}))
    (root / ".metadata").write_bytes(b"\x80\x04")
    (root / "__0_0.distcp").write_bytes(bytes(64))
    return root


# --- the inputs: each builds its files in tmp and returns the command line (after `python -m megaflow.cli`,
# or "tool" + tools/convert_checkpoint.py arguments).

def _cfg(tmp: Path, text: str) -> Path:
    (tmp / "run.toml").write_bytes(text.encode("latin-1") if "\xe9" in text else text.encode())
    return tmp / "run.toml"


def _based(tmp: Path, make_base) -> list[str]:
    """``config show`` of ``run.toml`` whose ``base = "base.toml"`` is what ``make_base(<tmp>/base.toml)`` made."""
    make_base(tmp / "base.toml")
    return ["config", "show", "-c", str(_cfg(tmp, 'base = "base.toml"\n[run]\nname = "x"\n'))]


def _chain(tmp: Path, files: int) -> list[str]:
    """``config show`` of a chain of ``files`` run files, each the base of the one before."""
    for i in range(files):
        (tmp / f"c{i}.toml").write_text(f'base = "c{i + 1}.toml"\n' if i + 1 < files else "[run]\n")
    return ["config", "show", "-c", str(tmp / "c0.toml")]


def _prompts(tmp: Path, data: bytes | None, *, as_dir: bool = False, name: str = "prompts.txt",
             size: int = 0) -> list[str]:
    path = tmp / name
    if as_dir:
        path.mkdir()
    elif size:  # a sparse file: no disk written, no memory used
        with open(path, "wb") as fh:
            fh.truncate(size)
    elif data is not None:
        path.write_bytes(data)
    return ["--set", f'data.prompts="{path}"']


def _parquet_prompts(tmp: Path, prompts: list[str]) -> list[str]:
    """``data.prompts`` a zstd parquet file of ``prompts`` (a long repeated string compresses to a few KB)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"prompt": prompts}), tmp / "p.parquet", compression="zstd")
    return ["--set", f'data.prompts="{tmp / "p.parquet"}"']


def _test_prompts(tmp: Path, data: bytes | None, name: str = "held.txt") -> list[str]:
    if data is not None:
        (tmp / name).write_bytes(data)
    return ["--set", f'data.test_prompts="{tmp / name}"']


def _pipe_dir(tmp: Path, damage=None, *, shards: int = 0) -> Path:
    root = fake_pipeline(tmp / "pipe", shards=shards)
    if damage:
        damage(root)
    return root


def _pipe(tmp: Path, damage=None, *, shards: int = 0) -> list[str]:
    return ["--set", f'model.pretrained="{_pipe_dir(tmp, damage, shards=shards)}"']


MARKER = "payload-ran"  # what a payload module writes into the row's temp dir when it is imported


def payload_source(marker: Path, base: str = "object") -> str:
    """A module that writes ``marker`` when imported and defines PayloadConfig / PayloadModel (subclasses of ``base``,
    e.g. ``transformers.CLIPTextModelWithProjection``, so that a trusted load can go on)."""
    module, _, name = base.rpartition(".")
    head = f"from {module} import {name} as _Base\n" if module else f"_Base = {name}\n"
    return (f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n{head}"
            "class PayloadConfig(_Base):\n    pass\n\n\nclass PayloadModel(_Base):\n    pass\n")


def add_remote_code(root: Path, kind: str, *, marker: Path, folder: str = "text_encoder",
                    base: str = "object") -> Path:
    """Make the pipeline ``root`` name code in a ``payload.py``: ``kind`` "auto_map" (``root/<folder>``'s
    config.json maps the Auto classes to its payload.py; ``folder`` "" = ``root`` is one model's folder),
    "component" (model_index.json's ``folder`` entry is ["payload", "PayloadModel"], from ``root/<folder>/payload.py``)
    or "pipeline" (model_index.json's _class_name is ["payload", "PayloadModel"], from ``root/payload.py``)."""
    target = root / folder if folder and kind != "pipeline" else root
    target.mkdir(parents=True, exist_ok=True)
    (target / "payload.py").write_text(payload_source(marker, base))
    if kind == "auto_map":
        conf = json.loads((target / "config.json").read_text()) if (target / "config.json").is_file() else {}
        conf["auto_map"] = {"AutoConfig": "payload.PayloadConfig", "AutoModel": "payload.PayloadModel"}
        (target / "config.json").write_text(json.dumps(conf))
    if (root / "model_index.json").is_file():
        index = json.loads((root / "model_index.json").read_text())
        if kind == "pipeline":
            index["_class_name"] = ["payload", "PayloadModel"]
        elif folder:
            index[folder] = (["payload", "PayloadModel"] if kind == "component" else
                             index.get(folder, ["transformers", "CLIPTextModelWithProjection"]))
        (root / "model_index.json").write_text(json.dumps(index))
    return root


def _remote(tmp: Path, kind: str, **kwargs) -> Path:
    """fake_pipeline with ``add_remote_code(kind)``; its payload would write ``<tmp>/MARKER``."""
    return add_remote_code(fake_pipeline(tmp / "pipe"), kind, marker=tmp / MARKER, **kwargs)


def _truncate(path: Path, keep: int | None = None, cut: int = 0) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep is not None else data[:len(data) - cut])


def _tool(tmp: Path, command: str, src: Path) -> list[str]:
    return ["tool", command, "--src", str(src), "--dst", str(tmp / "converted")]


def _transformer(tmp: Path, damage=None, *, shards: int = 0) -> Path:
    t = fake_pipeline(tmp / "pipe", shards=shards) / "transformer"
    if damage:
        damage(t)
    return t


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height RGB pixels and holds none (signature, IHDR, IEND): what a reader sees
    before it decodes anything."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")
    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def _images(tmp: Path, files: dict[str, bytes]) -> list[str]:
    d = tmp / "images"
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    return ["eval", "shapes", "--images", str(d)]


def _reward_images(tmp: Path, manifest: bytes | None, *, reward: str = "ocr", kwargs: str | None = None) -> list[str]:
    """``megaflow eval reward`` on a folder holding one real PNG (a.png) and ``manifest`` (None: no manifest)."""
    d = tmp / "images"
    d.mkdir()
    (d / "a.png").write_bytes(bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de"
                                            "0000000c4944415408d763f8ffff3f0005fe02fea7d6a4a00000000049454e44ae426082"))
    if manifest is not None:
        (d / "manifest.jsonl").write_bytes(manifest)
    return ["eval", "reward", "--reward", reward, "--images", str(d), *(["--kwargs", kwargs] if kwargs else [])]


def _clip_dir(tmp: Path, *, config: bool = True) -> Path:
    """A folder that looks like a CLIP model directory to the checks (config files only, no weights)."""
    d = tmp / "clip"
    d.mkdir()
    (d / "preprocessor_config.json").write_text("{}")
    if config:
        (d / "config.json").write_text("{}")
    return d


def _imagereward_dir(tmp: Path) -> Path:
    """A folder that looks like an ImageReward download to the checks (a dummy checkpoint, no weights)."""
    d = tmp / "imagereward"
    d.mkdir()
    (d / "ImageReward.pt").write_bytes(b"not read by the checks")
    (d / "med_config.json").write_text("{}")
    return d


# --- run dirs: each row's run is `train` with run.name = "r" in <tmp>/runs (the harness sets run.output_dir).

def _runs(tmp: Path, make=None, *extra: str) -> list[str]:
    """``train`` of run "r" after ``make(<tmp>/runs)`` (None: no runs folder)."""
    if make is not None:
        make(tmp / "runs")
    return [*TRAIN, "--set", 'run.name="r"', *extra]


def _read_only(runs: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes into a chmod 0o555 folder; tests/run/test_rundir.py covers an unwritable one")
    runs.mkdir()
    runs.chmod(0o555)


def _link(runs: Path, target: str, *, at: str = "r") -> None:
    """``runs/<at>`` a symlink to ``runs/../<target>`` (``at`` = "": ``runs`` itself is the link)."""
    link = runs / at if at else runs
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(runs.parent / target)


def _lost_config(runs: Path) -> None:
    """A run dir as a run of model.family sd3 left it at iteration 2, its config.toml lost."""
    ckpt = runs / "r" / "checkpoints" / "iter_000002"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "megaflow_model.json").write_text(json.dumps({"format": 1, "family": "sd3"}))
    (ckpt / "state.json").write_text(json.dumps({**STATE, "iteration": 2}))
    (runs / "r" / "metrics.jsonl").write_text('{"iteration": 1}\n{"iteration": 2}\n')


def _saved_config(make):
    """A run dir at iteration 2 whose ``config.toml`` is what ``make(<run dir>/config.toml)`` made."""
    def build(runs: Path) -> None:
        _lost_config(runs)
        make(runs / "r" / "config.toml")
    return build


def _in_run_dir(name: str, kind: str):
    """A run dir (no checkpoint) holding ``name`` as ``kind``: "file", "dir", "dangling" (a symlink to nothing)
    or "read-only" (a directory of mode 0o555; skipped as root, who writes there anyway)."""
    def make(runs: Path) -> None:
        if kind == "read-only" and os.geteuid() == 0:
            pytest.skip("root writes into a chmod 0o555 folder")
        path = runs / "r" / name
        path.parent.mkdir(parents=True)
        if kind == "file":
            path.write_text("not a directory")
        elif kind == "dangling":
            path.symlink_to("nowhere")
        else:
            path.mkdir(mode=0o555 if kind == "read-only" else 0o777)
    return make


def _elsewhere(runs: Path) -> None:
    (runs.parent / "elsewhere").mkdir()
    _link(runs, "elsewhere")


# A state.json as megaflow.rundir.checkpoint_io.save writes it (one rank's RNG states: python's as random gives
# it, numpy's and torch's of the sizes they have, zero bytes).
RNG = {"python": repr(random.Random(0).getstate()), "torch": base64.b64encode(bytes(5056)).decode(),
       "numpy": ["MT19937", base64.b64encode(bytes(4 * 624)).decode(), 624, 0, 0.0]}
STATE = {"iteration": 2, "prompts_consumed": 0, "rng": [RNG], "metrics": [], "layout": {"tp": 1, "pp": 1}}


def _resume_state(**changes):
    """A run dir at iteration 2 (config lost) whose state.json has ``changes``."""
    def make(runs: Path) -> None:
        _lost_config(runs)
        (runs / "r" / "checkpoints" / "iter_000002" / "state.json").write_text(json.dumps({**STATE, **changes}))
    return make


def _resume_state_text(text: str):
    """A run dir at iteration 2 (config lost) whose state.json is ``text``."""
    def make(runs: Path) -> None:
        _lost_config(runs)
        (runs / "r" / "checkpoints" / "iter_000002" / "state.json").write_text(text)
    return make


def rng_with(**changes) -> list[dict]:
    """``STATE``'s RNG states with ``changes`` (python: a change of its repr; numpy: {index: value})."""
    numpy = list(RNG["numpy"])
    for i, value in changes.pop("numpy", {}).items():
        numpy[i] = value
    return [{**RNG, "numpy": numpy, **changes}]


def _png_text_chunk(megabytes: int) -> bytes:
    """A 1x1 PNG with a zTXt chunk that inflates to ``megabytes`` MB (compressed in pieces: little memory)."""
    png = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de0000000c4944415408d763"
                        "f8ffff3f0005fe02fea7d6a4a00000000049454e44ae426082")
    z = zlib.compressobj()
    text = b"".join(z.compress(b"x" * (1 << 20)) for _ in range(megabytes)) + z.flush()
    data = b"comment\x00\x00" + text
    chunk = len(data).to_bytes(4, "big") + b"zTXt" + data + zlib.crc32(b"zTXt" + data).to_bytes(4, "big")
    return png[:33] + chunk + png[33:]


def _loop(directory: Path, name: str) -> None:
    """``directory/name`` a symlink to itself (a loop)."""
    directory.mkdir(exist_ok=True)
    (directory / name).symlink_to(name)


def _looped_images(tmp: Path, *, manifest: bool) -> list[str]:
    _loop(tmp / "images", "a_red_circle.png")
    if manifest:
        (tmp / "images" / "manifest.jsonl").write_text('{"file": "a_red_circle.png", "prompt": "a red circle"}\n')
    return ["eval", "shapes", "--images", str(tmp / "images")]


def _text_chunk_reward_images(tmp: Path) -> list[str]:
    argv = _reward_images(tmp, _A, reward="jpeg_compressibility")
    (tmp / "images" / "a.png").write_bytes(_png_text_chunk(200))
    return argv


DEEP_JSON = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"


def _looped_reward_images(tmp: Path) -> list[str]:
    argv = _reward_images(tmp, _A + b'{"file": "loop.png", "prompt": "x"}\n', reward="jpeg_compressibility")
    _loop(tmp / "images", "loop.png")
    return argv


_A = b'{"file": "a.png", "prompt": "say \\"A\\""}\n'
TRAIN = ["train", "-c", str(REPO / "configs" / "cpu_demo.toml")]
SHOW = ["config", "show", "-c", str(REPO / "configs" / "cpu_demo.toml")]
DEMO = ["demo", "-c", str(REPO / "configs" / "shapes_demo.toml"), "--set", f'model.pretrained="{SHIPPED}"']
PRETRAIN = ["pretrain", "-c", str(REPO / "configs" / "shapes_pretrain.toml")]
T = "transformer/diffusion_pytorch_model.safetensors"


def _snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (symlinks not followed): a file's SHA-256, a link's target, "dir", another
    kind's mode."""
    out = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(top) / name
            if p.is_symlink():
                out[str(p.relative_to(root))] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[str(p.relative_to(root))] = "dir"
            elif not p.is_file():  # a FIFO or a device a row made: never read
                out[str(p.relative_to(root))] = f"mode {p.stat().st_mode:o}"
            else:
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def check_one_line_exit_2(argv: list[str], tmp_path: Path, needle: str) -> None:
    """Run ``argv`` (a ``megaflow`` command line, or "tool" + convert_checkpoint.py arguments) in ``tmp_path`` and
    assert: exit 2, one stderr line holding ``needle``, no traceback, no output, no heavy import, nothing written."""
    target = str(REPO / "tools" / "convert_checkpoint.py") if argv[0] == "tool" else "cli"
    argv = argv[1:] if argv[0] == "tool" else argv
    if argv[0] in ("train", "demo", "config"):
        argv += ["--set", f'run.output_dir="{tmp_path / "runs"}"']
    before, made_runs = _snapshot(tmp_path), os.path.lexists(tmp_path / "runs")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    r = subprocess.run([sys.executable, "-c", WRAPPER, target, *argv], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and lines[0].strip(), r.stderr[-2000:]
    assert needle in lines[0], lines[0]
    assert "Traceback" not in r.stderr
    assert r.stdout.splitlines() == ["HEAVY="], f"heavy imports or output: {r.stdout[-500:]}"
    assert os.path.lexists(tmp_path / "runs") == made_runs
    assert _snapshot(tmp_path) == before, "the command wrote files"
