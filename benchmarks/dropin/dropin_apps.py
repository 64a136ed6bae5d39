"""The drop-in's cases beyond the digits app (``isoloco_dropin.py`` runs them): the byte bigram
of ``examples/swap-fedavg``, the LM app, and the running-variance case of a BatchNorm buffer;
each in-process on the fake grid (``tests/fakegrid.py``)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

REPO = common.REPO
common.on_path("tests")

from flwr.app import ArrayRecord, Context, RecordDict  # noqa: E402

from flwr_isoloco.strategies import DiLoCo, IsoLoCo  # noqa: E402


def _paper(**kw):
    return IsoLoCo(preset="isoloco-paper", **kw)


def bigram_case(factory: Callable[[], object], rounds: int = 3) -> list[float]:
    """``examples/swap-fedavg`` (byte-bigram table, Adam inner steps, 3 nodes) in-process with
    ``factory()`` as its strategy; validation loss per round (round 0 first)."""
    import importlib
    import tempfile
    import types

    common.on_path("examples/swap-fedavg")
    from fakegrid import FakeGrid

    src = (REPO / "examples" / "swap-fedavg" / "swap_fedavg" / "server_app.py").read_text()
    mod = types.ModuleType("swap_fedavg.server_app_bench")
    mod.__package__ = "swap_fedavg"
    exec(compile(src, "server_app.py", "exec"), mod.__dict__)
    mod.IsoLoCo = lambda **_: factory()  # the example's one strategy line, swapped here
    client = importlib.import_module("swap_fedavg.client_app").app
    with tempfile.TemporaryDirectory() as tmp:
        rc = {"num-server-rounds": rounds, "local-steps": 10, "lr": 0.1, "output-dir": tmp}
        grid = FakeGrid(client, num_nodes=3, run_config=rc)
        mod.main(
            grid, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
        )
        res = json.loads((Path(tmp) / "result.json").read_text())
    return [float(res["val-loss"][str(r)]) for r in range(rounds + 1)]


LM_VARIANTS = {
    "FedAvg": {"strategy.name": "fedavg"},
    # the LM app's own default is the paper preset: name each preset explicitly
    "IsoLoCo() (dropin preset)": {"strategy.name": "isoloco", "strategy.preset": "dropin"},
    "IsoLoCo(preset='isoloco-paper')": {
        "strategy.name": "isoloco",
        "strategy.preset": "isoloco-paper",
    },
}


def lm_case(rounds: int, out_dir: Path, only: list[str] | None = None) -> dict:
    """The LM app (simulations/isoloco-lm, its pyproject defaults: 4 nodes, tiny LLaMA, AdamW
    inner steps) in-process on the fake grid; final validation loss per strategy. The paper
    preset is given by its values (the app's run config has no preset key)."""
    common.on_path("simulations/isoloco-lm")
    from fakegrid import FakeGrid
    from isoloco_lm import client_app, server_app

    res = {}
    for name, keys in LM_VARIANTS.items():
        if only and not any(name.startswith(o) for o in only):
            continue
        t0 = time.perf_counter()
        rc = {"num-server-rounds": rounds, "output-dir": str(out_dir / name.split("(")[0]), **keys}
        grid = FakeGrid({"train": client_app.train}, num_nodes=4, run_config=rc)
        out = server_app.run_server(grid, rc, settle_s=0.0)
        rows = json.loads((out / "results.json").read_text())["rounds"]
        losses = [float(r["val-loss"]) for r in rows]
        res[name] = {"final": losses[-1], "val-loss": losses}
        print(
            f"[lm] {name}: val-loss {[round(x, 3) for x in losses]} "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    return res


NEGVAR_VARIANTS: dict[str, Callable[..., object]] = {
    "DiLoCo()": lambda **kw: DiLoCo(**kw),
    "IsoLoCo()": lambda **kw: IsoLoCo(**kw),
    "IsoLoCo(preset='isoloco-paper')": lambda **kw: _paper(**kw),
}


def negative_variance(rounds: int = 5, **strategy_kw) -> dict:
    """The running-variance case: a BatchNorm buffer ``running_var`` at 1.0 on the
    server, every node (3, equal weights) reports 0.2 (and ``running_mean`` 0.5) each round while
    its weight shrinks by 0.9. FedAvg gives 0.2 from round 1 on; the server's ``running_var``
    after each round is recorded per strategy (an outer step that owns it extrapolates it)."""
    from fakegrid import FakeGrid
    from flwr.app import Message, MetricRecord

    def train(msg, ctx):
        th = msg.content["arrays"].to_torch_state_dict()
        new = {
            "fc.weight": th["fc.weight"] * 0.9,
            "bn.running_var": torch.full_like(th["bn.running_var"], 0.2),
            "bn.running_mean": torch.full_like(th["bn.running_mean"], 0.5),
        }
        metrics = MetricRecord({"num-examples": 10})
        return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)

    kw = dict(min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1, fraction_evaluate=0)
    init = {"fc.weight": torch.ones(3, 4), "bn.running_var": torch.ones(4)}
    init["bn.running_mean"] = torch.zeros(4)
    res = {}
    for name, factory in NEGVAR_VARIANTS.items():
        s = factory(**kw, **strategy_kw)
        seen: list[float] = []
        step = s.outer_step

        def recorded(g, s=s, step=step, seen=seen):
            step(g)
            seen.append(round(float(s.theta["bn.running_var"][0]), 4))

        s.outer_step = recorded
        s.start(
            grid=FakeGrid({"train": train}, num_nodes=3),
            initial_arrays=ArrayRecord(init),
            num_rounds=rounds,
        )
        res[name] = seen
        print(f"[negative-variance] {name}: running_var per round {seen}", flush=True)
    return res
