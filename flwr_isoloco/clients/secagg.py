"""Client side of secure aggregation: a ClientApp mod that runs a DiLoCo worker under SecAgg+,
and the config keys the server shim (:mod:`flwr_isoloco.strategies.diloco.secagg`) and it share.

``ClientApp(mods=[secagg_mod])``: a train message that carries SecAgg+'s stage config
(``secaggplus_configs``, sent by :mod:`flwr_isoloco.strategies.diloco.secagg`) goes through Flower's
``secaggplus_mod``; every other message (plain train rounds, evaluation, queries) reaches the
handler unchanged, so an app with the mod behaves bit for bit as without it when SecAgg+ is off.

At SecAgg+'s "collect masked vectors" stage the mod translates between the two layouts: the
FitIns (the model as a list of arrays, their names in the config) becomes the train message the
worker expects (``arrays`` + ``config``); the worker's reply (weights ``theta_i`` or its delta)
becomes a FitRes whose parameters are the pseudo-gradient ``delta_i = theta - theta_i`` of the
float tensors, in the order the server named, and whose ``num_examples`` is the merge weight
(1 with uniform weighting, else the worker's ``num-examples``). ``secaggplus_mod`` then clips
it to ``+-clipping_range``, quantises, masks and uploads it; the reply's metrics (and its
config echoes: payload, local-DP keys) travel in clear, plus :data:`CLIPPED_METRIC`, the number
of entries beyond the clipping range.

SecAgg+'s own state (its key pair, the shares) lives in ``context.state`` between stages; it is
taken out while the worker runs, so node-state files (``with_node_state``) never hold it and a
resumed node's state is restored as without SecAgg+.

This module imports only Flower's client side at load time: in a deployment every message
starts a fresh client process, and three of SecAgg+'s four stages need no torch.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context, Message
from flwr.app.message_type import MessageType
from flwr.client.mod import secaggplus_mod

__all__ = [
    "CLIPPED_METRIC",
    "FLOAT_KEYS_KEY",
    "KEYS_KEY",
    "RANGE_KEY",
    "WEIGHTING_KEY",
    "secagg_mod",
]

RECORD_KEY_CONFIGS = "secaggplus_configs"  # Flower's secaggplus_constants (checked in a test)
RECORD_KEY_STATE = "secaggplus_state"
KEYS_KEY = "secagg-keys"
"""Train config: the names of the model's arrays, newline-joined, in the order sent."""
FLOAT_KEYS_KEY = "secagg-float-keys"
"""Train config: the float tensors whose deltas the reply carries, newline-joined, in order."""
WEIGHTING_KEY = "secagg-weighting"
"""Train config: ``"uniform"`` (reply weight 1) or ``"examples"`` (the worker's num-examples)."""
RANGE_KEY = "secagg-clipping-range"
"""Train config: SecAgg+'s clipping range, so the client can count the entries it clips."""
CLIPPED_METRIC = "secagg-clipped-entries"
"""Reply metric: entries of the delta outside ``+-clipping_range`` (clipped by SecAgg+)."""


Handler = Callable[[Message, Context], Message]


def secagg_mod(msg: Message, context: Context, call_next: Handler) -> Message:
    """``secaggplus_mod`` for SecAgg+ train stages; any other message passes through."""
    if (
        msg.metadata.message_type != MessageType.TRAIN
        or RECORD_KEY_CONFIGS not in msg.content.config_records
    ):
        return call_next(msg, context)
    return secaggplus_mod(msg, context, lambda m, c: _train_as_fitres(m, c, call_next))


def _train_as_fitres(msg: Message, context: Context, call_next: Handler) -> Message:
    """Run the worker on the FitIns and reply its pseudo-gradient as a FitRes (the heavy
    imports are here: the other three SecAgg+ stages start a client process without them)."""
    import numpy as np
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.compat.common import recorddict_compat as compat

    from flwr_isoloco.compression import decompress, is_compressed
    from flwr_isoloco.strategies.core.wire import record_tensors

    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    config = dict(fitins.config)
    names = str(config.pop(KEYS_KEY, "")).split("\n")
    floats = str(config.pop(FLOAT_KEYS_KEY, "")).split("\n")
    weighting = str(config.pop(WEIGHTING_KEY, "uniform"))
    clip = float(config.pop(RANGE_KEY, 8.0))
    arrays = parameters_to_ndarrays(fitins.parameters)
    if len(names) != len(arrays) or not set(floats) <= set(names):
        raise ValueError(
            f"SecAgg+ train message: {len(arrays)} arrays for {len(names)} names "
            f"({KEYS_KEY!r}), or float keys not among them"
        )
    theta = {k: torch.from_numpy(np.array(a)) for k, a in zip(names, arrays, strict=True)}
    msg.content = RecordDict({"arrays": ArrayRecord(theta), "config": ConfigRecord(config)})
    state = context.state.config_records.pop(RECORD_KEY_STATE, None)
    try:
        reply = call_next(msg, context)
    finally:
        if state is not None:
            context.state.config_records[RECORD_KEY_STATE] = state
    if reply.has_error():
        raise RuntimeError(f"the worker failed: {reply.error.reason}")
    content = reply.content
    rec = content.array_records["arrays"]
    got = decompress(rec) if is_compressed(rec) else record_tensors(rec)
    echo = dict(content.config_records.get("config", {}))
    if echo.get("payload", "weights") == "delta":
        delta = [got[k].double().numpy() for k in floats]
    else:
        delta = [(theta[k].double() - got[k].double()).numpy() for k in floats]
    metrics = dict(content.metric_records.get("metrics", {}))
    weight = 1 if weighting == "uniform" else int(metrics.get("num-examples", 0))
    clipped = int(sum(int((np.abs(d) > clip).sum()) for d in delta))
    extra = {k: v for k, v in echo.items() if isinstance(v, (int, float, str, bool))}
    fitres = FitRes(
        status=Status(Code.OK, "ok"),
        parameters=ndarrays_to_parameters([d.astype(np.float32) for d in delta]),
        num_examples=weight,
        metrics={**_scalar_metrics(metrics), **extra, CLIPPED_METRIC: clipped},
    )
    return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)


def _scalar_metrics(metrics: dict) -> dict:
    return {
        k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
