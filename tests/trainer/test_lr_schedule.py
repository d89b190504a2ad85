"""The trainer's learning-rate schedule (megaflow.trainer.settings.LRSchedule, applied by ``Trainer.schedule_lr``
before an iteration's optimizer steps) against torch's own schedulers: linear warm-up then cosine to 0, or
constant. The reference steps a torch optimizer through ``SequentialLR(LinearLR, CosineAnnealingLR)`` once per
iteration; the lr of every iteration agrees within 1e-12 relative (torch's chained cosine recursion vs the
closed form). Needs: CPU, no process group (< 1 s)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megaflow.config import load_config
from megaflow.trainer.runner import Trainer
from megaflow.trainer.settings import LRSchedule, lr_schedule


def torch_lrs(lr: float, warmup: int, total: int, schedule: str) -> list[float]:
    """The lr of iterations 1..total from torch's schedulers (one scheduler step per iteration)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = []
    if warmup > 1:
        sched.append(torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0,
                                                       total_iters=warmup - 1))
    if schedule == "cosine":
        sched.append(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - max(warmup, 1) + (warmup == 0),
                                                                eta_min=0.0))
    else:
        sched.append(torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0))
    chain = torch.optim.lr_scheduler.SequentialLR(opt, sched, milestones=[warmup]) if len(sched) > 1 else sched[0]
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        chain.step()
    return out


@pytest.mark.parametrize("warmup,total,schedule", [(4, 20, "cosine"), (0, 12, "cosine"), (5, 9, "constant"),
                                                   (0, 6, "constant")])
def test_schedule_matches_torchs_schedulers(warmup, total, schedule):
    ours = LRSchedule(3e-4, warmup=warmup, total=total, schedule=schedule)
    want = torch_lrs(3e-4, warmup, total, schedule)
    assert [ours.at(k) for k in range(1, total + 1)] == pytest.approx(want, rel=1e-12, abs=1e-18)


def test_schedule_comes_from_the_train_section():
    cfg = load_config(None, ["train.lr=2e-4", "train.warmup_iterations=3", "train.iterations=10",
                             'train.lr_schedule="cosine"'])
    assert lr_schedule(cfg) == LRSchedule(2e-4, warmup=3, total=10, schedule="cosine")


def test_trainer_sets_every_param_group_and_reports_the_lr():
    groups = [{"lr": 1.0}, {"lr": 1.0}]
    trainer = SimpleNamespace(lr_schedule=LRSchedule(1e-3, warmup=4, total=8), optimizer=SimpleNamespace(param_groups=groups))
    assert Trainer.schedule_lr(trainer, 2) == {"lr": pytest.approx(5e-4, rel=1e-15)}
    assert [g["lr"] for g in groups] == [pytest.approx(5e-4, rel=1e-15)] * 2
    unscheduled = SimpleNamespace(lr_schedule=None, optimizer=SimpleNamespace(param_groups=groups))
    assert Trainer.schedule_lr(unscheduled, 7) == {} and groups[0]["lr"] == pytest.approx(5e-4, rel=1e-15)
