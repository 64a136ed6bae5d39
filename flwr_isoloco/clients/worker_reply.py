"""The DiLoCo worker's reply: ``theta_i`` or the delta ``theta - theta_i`` (fp32 on the wire),
privatised with local DP and compressed with error feedback when the server asks.

The error-feedback residual stays on the node, in ``context.state[RESIDUAL_STATE_KEY]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.common.logger import log

from flwr_isoloco.compression import ErrorFeedback, compress
from flwr_isoloco.merging.dp import CLIP_KEY, NOISE_KEY, privatize

from .record_io import pack_record

__all__ = ["RESIDUAL_STATE_KEY", "reply_content"]

RESIDUAL_STATE_KEY = "diloco.residual"


def fp32_record(sd: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """``sd`` as an ArrayRecord, bf16 as fp32 (an ArrayRecord has no bf16), one copy."""
    return pack_record(sd)


def compressed_delta(
    delta: dict[str, torch.Tensor], request: tuple[str, dict, bool], state: RecordDict
) -> ArrayRecord:
    """``delta`` encoded as asked; with error feedback the residual round-trips ``state``.

    A stored residual whose keys or shapes do not match the delta is discarded (warning), as a
    mismatched AdamW state is; without error feedback any stored residual is removed.
    """
    codec, options, use_ef = request
    if not use_ef:
        if RESIDUAL_STATE_KEY in state:
            del state[RESIDUAL_STATE_KEY]
        return compress(delta, codec, **options)
    ef = ErrorFeedback(codec, **options)
    rec = state.get(RESIDUAL_STATE_KEY)
    if isinstance(rec, ArrayRecord):
        saved = rec.to_torch_state_dict()
        bad = [k for k, v in saved.items() if k not in delta or v.shape != delta[k].shape]
        if bad:
            log(WARNING, "DiLoCo worker: residual for %r does not match the model; dropped", bad[0])
        else:
            ef.load_state_dict({"residual": saved})
    out = ef.compress(delta)
    state[RESIDUAL_STATE_KEY] = ArrayRecord(ef.state_dict()["residual"])
    return out


def reply_content(
    theta, new, request, payload: str, state: RecordDict, key: str, dp=None
) -> RecordDict:
    """The model part of the reply: ``theta_i``, or ``theta - theta_i`` (compressed if asked).

    With local DP (``dp = (C, z)``) the delta is clipped and noised first (:func:`privatize`),
    before compression and error feedback (which then only see the private delta)."""
    content = RecordDict()
    if request is None and payload == "weights" and dp is None:
        content[key] = fp32_record(new)
        return content
    deltas = ((k, theta[k].to(new[k].dtype) - new[k]) for k in new)  # made one at a time
    if request is None and payload == "delta" and dp is None:  # packed as they are made
        content[key] = pack_record(deltas)
        content["config"] = ConfigRecord({"payload": "delta"})
        return content
    delta = dict(deltas)
    echo: dict[str, Any] = {}
    if dp is not None:
        delta = privatize(delta, *dp)
        echo = {CLIP_KEY: dp[0], NOISE_KEY: dp[1]}
    if request is not None:
        content[key] = compressed_delta(delta, request, state)
    elif payload == "weights":  # theta_i = theta - private delta
        content[key] = fp32_record({k: theta[k].to(d.dtype) - d for k, d in delta.items()})
        content["config"] = ConfigRecord({"payload": "weights", **echo})
        return content
    else:
        content[key] = fp32_record(delta)
    content["config"] = ConfigRecord({"payload": "delta", **echo})
    return content
