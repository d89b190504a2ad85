"""End to end: `megaflow train` (tiny SD3, a real SGLang engine) with logging.tensorboard, logging.wandb
(WANDB_MODE=offline) and eval.every = 1 on test prompts, then --resume from an older checkpoint.

Read back independently of megaflow: the TensorBoard event files with TensorBoard's EventAccumulator, the W&B
offline run file (<run dir>/wandb/offline-run-*/run-*.wandb: leveldb-log blocks of wandb's protobuf Records) with
a small reader here and wandb's own Record class. Checked: every number of every metrics.jsonl row at step =
iteration (TensorBoard: as float32; W&B: exactly), every eval.jsonl figure at its iteration (0 = before
training), the samples and the eval images with their captions at their steps (a TensorBoard sample image equal
to its cell of samples/iterNNNNN.png); after a resume from iteration 1's checkpoint (iteration 2's removed, as
if the run died writing it) TensorBoard shows each step once, with the resumed session's values, and the resumed
W&B session logs steps 2.. only, in order; --resume continues the same W&B run (the id in <run dir>/wandb_id),
whose offline files hold the metrics and the captioned sample images of both sessions.
Needs: CPU; two `megaflow train` sessions of one run, shared by the tests here (a real SGLang engine each, ~1 min
each; slow)."""
from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megaflow.report import tensorboard_backend

pytestmark = [pytest.mark.slow, pytest.mark.engine]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TINY = ["rollout.prompts_per_iter=2", "rollout.group_size=3", "rollout.num_steps=3", "rollout.height=32",
        "rollout.width=32", "train.micro_batch_size=3"]
PROMPTS = ["a red circle", "a green square", "a blue triangle"]


def _train(tmp_path: Path, name: str, *sets: str, resume: bool = False) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}
    env.pop("WANDB_API_KEY", None)
    env.pop("WORLD_SIZE", None)
    cmd = [str(BIN / "megaflow"), "train", "-c", "configs/cpu_demo.toml", *(["--resume"] if resume else [])]
    for s in [f'run.output_dir="{tmp_path}"', f'run.name="{name}"', *TINY, *sets]:
        cmd += ["--set", s]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def expected_series(rows: list[dict], evals: list[dict], cast=float) -> dict[str, list[tuple[int, float]]]:
    """name -> [(step, value)] of every number in the metrics rows and the eval rows (the last of a step)."""
    out: dict[str, dict[int, float]] = {}
    for row in rows + evals:
        for k, v in row.items():
            if k not in ("iteration", "when") and isinstance(v, (int, float)):
                out.setdefault(k, {})[row["iteration"]] = cast(v)
    return {k: sorted(v.items()) for k, v in out.items()}


def tensorboard_events(run: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def wandb_history(offline_dir: Path) -> list[tuple[int, dict]]:
    """(step, {key: value}) of every history record of a W&B offline run, in file order."""
    from wandb.proto import wandb_internal_pb2 as pb
    (path,) = offline_dir.glob("run-*.wandb")
    data, pos, buf, out = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"  # then a 7-byte file header; records in 32 KiB blocks, 7-byte record headers
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole Record
            record = pb.Record()
            record.ParseFromString(buf)
            if record.WhichOneof("record_type") == "history":
                out.append((record.history.step.num, {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                                      for i in record.history.item}))
            buf = b""
    return out


SETS = ["logging.tensorboard=true", "logging.wandb=true", "logging.sample_every=1", "train.save_every=1",
        "eval.every=1", "eval.num=3", 'logging.tags=["e2e"]']


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> tuple[Path, Path]:
    """(the run dir after its first session: a copy, the run dir after the resume). The first session runs 2
    iterations; then iteration 2's checkpoint is removed (as if the run died writing it) and the run resumed
    to 3 iterations."""
    tmp_path = tmp_path_factory.mktemp("logged")
    (tmp_path / "held.txt").write_text("\n".join(PROMPTS) + "\n")
    sets = [*SETS, f'data.test_prompts="{tmp_path / "held.txt"}"']
    _train(tmp_path, "tb", "train.iterations=2", *sets)
    run = tmp_path / "tb"
    first = tmp_path / "first-session"
    shutil.copytree(run, first)
    shutil.rmtree(run / "checkpoints" / "iter_000002")
    _train(tmp_path, "tb", "train.iterations=3", *sets, resume=True)
    return first, run


def test_train_logs_rows_evals_and_images_to_tensorboard_and_wandb(sessions):
    run, resumed_run = sessions
    rows, evals = _jsonl(run / "metrics.jsonl"), _jsonl(run / "eval.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1, 2] and [r["iteration"] for r in evals] == [0, 1, 2]

    acc = tensorboard_events(run)
    got = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    assert got == expected_series(rows, evals, cast=lambda v: float(np.float32(v)))
    images = acc.Tags()["images"]
    assert sorted(images) == ["eval/images", "samples"]  # one grid image per call (report/tensorboard_backend.py)
    assert [e.step for e in acc.Images("samples")] == [1, 2] and [e.step for e in acc.Images("eval/images")] == [0, 1, 2]
    grid = np.asarray(Image.open(run / "samples" / "iter00002.png"))  # 2 groups of 3, one per row, 32x32 images
    cell = grid.shape[0] // 2  # each image drawn twice its size (nearest), its caption under it
    tb = np.asarray(Image.open(io.BytesIO(acc.Images("samples")[-1].encoded_image_string)))
    pad, cols = tensorboard_backend.GRID_PADDING, tensorboard_backend.GRID_COLUMNS
    row, col = divmod(5, cols)  # the last sample, as the captions number it
    last = tb[pad + row * (32 + pad):pad + row * (32 + pad) + 32, pad + col * (32 + pad):pad + col * (32 + pad) + 32]
    assert np.array_equal(last, grid[cell:cell + 64:2, 128:192:2])
    (eval_text,) = [t for t in acc.Tensors("eval/images/captions/text_summary") if t.step == 0]
    assert [line.split(": ", 1)[1].rsplit(" | reward ", 1)[0]
            for line in eval_text.tensor_proto.string_val[0].decode().split("  \n")] == PROMPTS

    (offline,) = (run / "wandb").glob("offline-run-*")
    history = wandb_history(offline)
    assert [step for step, _ in history] == [0, 1, 2]  # one row per step: the evaluation's merged in
    logged = {}
    for step, items in history:
        for k, v in items.items():
            media = k.startswith(("samples/", "eval/images/"))  # an image list's fields (count, width, ...)
            if not k.startswith("_") and not media and isinstance(v, (int, float)):
                logged.setdefault(k, []).append((step, float(v)))
    assert logged == expected_series(rows, evals)
    for step, items in history:
        assert len(items["eval/images/captions"]) == 3 and items["eval/images/captions"][0].startswith("a red circle | reward ")
        assert len(items.get("samples/captions", [])) == (6 if step else 0)

    # resumed from iteration 1's checkpoint: iteration 2 is logged again (new values), then 3
    run = resumed_run
    resumed_rows, evals = _jsonl(run / "metrics.jsonl"), _jsonl(run / "eval.jsonl")
    assert [r["iteration"] for r in resumed_rows] == [0, 1, 2, 3]
    # metrics.jsonl restarts from the checkpoint's rows: those lack checkpoint/write_s (measured after the
    # checkpoint's state was taken); TensorBoard keeps steps 0-1 as the first session logged them
    assert [{k: v for k, v in r.items() if k != "checkpoint/write_s"} for r in rows[:2]] == resumed_rows[:2]
    acc = tensorboard_events(run)
    got = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    assert got == expected_series(rows[:2] + resumed_rows[2:], evals,  # evals: the last row of a step
                                  cast=lambda v: float(np.float32(v)))
    assert [e.step for e in acc.Images("samples")] == [1, 2, 3]
    assert [e.step for e in acc.Images("eval/images")] == [0, 1, 2, 3]
    resumed = [d for d in (run / "wandb").glob("offline-run-*") if d.name != offline.name]
    assert [step for step, _ in wandb_history(resumed[0])] == [2, 3]


def test_train_wandb_offline_images_and_resume(sessions):
    """logging.wandb with WANDB_MODE=offline (no network): metrics and captioned sample images reach the W&B
    run's files; --resume continues the same W&B run (the id in <run dir>/wandb_id)."""
    first, run = sessions
    run_id = (first / "wandb_id").read_text().strip()
    assert (run / "wandb_id").read_text().strip() == run_id
    offline = sorted(run.glob(f"wandb/offline-run-*-{run_id}"))
    assert len(offline) == 2, offline  # two sessions of one W&B run
    records = b"".join(p.read_bytes() for d in offline for p in d.glob("*.wandb"))
    assert b"reward/total" in records and b"captions" in records and b"| reward " in records
    assert len(list(run.glob("wandb/offline-run-*/files/media/images/samples_*.png"))) >= 2 * 6
