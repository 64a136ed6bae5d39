"""The DiLoCo worker's inner schedule against transformers' warm-up + cosine-to-min schedule
(issue 9, item 7): the decay is bitwise the library's, the warm-up is one step ahead of it, so
the library cannot replace ours without changing results (see ``inner_lr``'s docstring)."""

import pytest
import torch

from flwr_isoloco.clients.diloco_worker import inner_lr


def _hf_lrs(lr, warmup, total, min_ratio, steps):
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    sched = get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, total, min_lr_rate=min_ratio)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("lr,warmup,total,min_ratio", [(3e-3, 20, 200, 0.1), (1e-3, 7, 61, 0.0)])
def test_decay_is_the_library_schedule_and_warmup_is_one_step_ahead(lr, warmup, total, min_ratio):
    hf = _hf_lrs(lr, warmup, total, min_ratio, total)
    ours = [inner_lr(s, total, lr, warmup, min_ratio) for s in range(total)]
    assert ours[warmup:] == hf[warmup:]  # decay: bitwise equal
    for s in range(warmup - 1):  # warm-up: ours at s is the library's at s + 1
        assert ours[s] == pytest.approx(hf[s + 1], rel=1e-12, abs=0.0)
    assert hf[0] == 0.0 and ours[0] == lr / warmup  # the library wastes the first step
    assert ours[warmup - 1] == lr and hf[warmup - 1] < lr
