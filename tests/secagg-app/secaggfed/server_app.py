"""ServerApp: DiLoCo (uniform weights), plain or under SecAgg+, through a grid that records
every array of every reply the ServerApp receives (ArrayRecords, and the numpy arrays SecAgg+
sends as bytes in ConfigRecords) and polls for replies every 0.2 s (Flower's grid: 3 s);
writes them, the g of every round (from the momentum buffer), the final model and the
metrics to the output folder."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.common import bytes_to_ndarray
from flwr.serverapp import Grid, ServerApp

from flwr_isoloco.models.hf import load_model_arrays
from flwr_isoloco.strategies import DiLoCo, ReplyChecks
from flwr_isoloco.strategies.diloco.secagg import use_secagg
from secaggfed.task import build_model, val_loss

app = ServerApp()
POLL_S = 0.2


class RecordingGrid:
    """The ServerApp's grid, keeping every array of every reply it hands over."""

    def __init__(self, grid: Grid) -> None:
        self._grid, self.arrays = grid, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def _keep(self, replies):
        replies = list(replies)
        for m in replies:
            if not m.has_content():
                continue
            for rec in m.content.array_records.values():
                self.arrays += [a.numpy() for a in rec.values()]
            for rec in m.content.config_records.values():
                for v in rec.values():
                    for b in v if isinstance(v, list) else [v]:
                        if isinstance(b, bytes) and b[:6] == b"\x93NUMPY":
                            self.arrays.append(bytes_to_ndarray(b))
        return replies

    def send_and_receive(self, messages, *, timeout=None):
        """Flower's push-then-pull loop, polling every POLL_S instead of its fixed 3 s (SecAgg+
        makes four such exchanges a round; the test's wall time is mostly these waits)."""
        pending = set(self._grid.push_messages(messages))
        end = time.monotonic() + (timeout if timeout is not None else 0.0)
        replies = []
        while True:
            got = self._keep(self._grid.pull_messages(pending))
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            if not pending or (timeout is not None and time.monotonic() >= end):
                return replies
            time.sleep(POLL_S)

    def pull_messages(self, message_ids):
        return self._keep(self._grid.pull_messages(message_ids))


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    out, tag = Path(str(cfg["output-dir"])), str(cfg["tag"])
    strategy = DiLoCo(
        min_train_nodes=3,
        min_available_nodes=3,
        fraction_evaluate=0.0,
        checks=ReplyChecks(weighting="uniform"),
    )
    if cfg["secagg"]:
        use_secagg(strategy)
    model = build_model()
    g, prev, rows = {}, {}, []

    def evaluate(rnd, arrays):
        load_model_arrays(model, arrays)
        return {"val-loss": val_loss(model)}

    def keep(rnd, arrays, tm, em):
        buf = {k: v.clone() for k, v in strategy.outer.momentum_buffer.items()}
        for k, b in buf.items():
            g[f"r{rnd}/{k}"] = (b - strategy.outer.momentum * prev.get(k, 0)).numpy()
        prev.update(buf)
        rows.append({"round": rnd, **dict(tm or {}), **dict(em or {})})

    recording = RecordingGrid(grid)
    t0 = time.perf_counter()
    result = strategy.start(
        grid=recording,
        initial_arrays=ArrayRecord(build_model().state_dict()),
        num_rounds=int(cfg["num-server-rounds"]),
        timeout=300.0,
        evaluate_fn=evaluate,
        on_round_end=keep,
    )
    wall = time.perf_counter() - t0
    np.savez(out / f"{tag}-received.npz", *recording.arrays)
    np.savez(out / f"{tag}-g.npz", **g)
    np.savez(
        out / f"{tag}-final.npz",
        **{k: v.numpy() for k, v in result.arrays.to_torch_state_dict().items()},
    )
    initial = result.evaluate_metrics_serverapp[0]["val-loss"]
    info = {"wall-s": wall, "initial-val-loss": initial, "rounds": rows}
    (out / f"{tag}-results.json").write_text(json.dumps(info, indent=2))
