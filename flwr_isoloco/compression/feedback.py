"""Error feedback for compressed uploads, and the train-config keys that request a codec.

Error feedback (EF; Seide et al. 2014, Karimireddy et al. 2019): a worker keeps the part of its
pseudo-gradients that compression lost and adds it to the next upload::

    c_t = delta_t + beta e_{t-1};   sent_t = decode(encode(c_t));   e_t = c_t - sent_t

with ``beta = ef_decay`` (a codec option; default 1.0, sparseloco 0.95 as SparseLoCo). With
``beta = 1`` after T rounds ``sum_t sent_t = sum_t delta_t - e_T`` (telescoping, up to fp32
rounding): the server has received every coordinate except the last round's residual. With
``beta < 1`` it also forgets ``(1 - beta) sum_{t<T} e_t``: a residual entry that is never sent
decays geometrically (``beta^t``) instead of growing without bound, which is what SparseLoCo
(``e <- 0.95 e + delta``) and MuLoCo (0.9) use.

Nothing here assumes a client: a server can keep an ``ErrorFeedback`` for compressed downloads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord

from flwr_isoloco.compression.record import (
    CODECS,
    compress,
    decompress,
    encoding,
    normalize_options,
)

# Train-config (ConfigRecord) keys: what the server asks of a worker. The codec options map to
# flat keys so they fit a ConfigRecord and Flower's run config.
CODEC_KEY = "upload-codec"
EF_KEY = "upload-error-feedback"
EF_DECAY_KEY = "upload-ef-decay"  # the ``ef_decay`` option; not a codec parameter (no header)
OPTION_KEYS = {
    "codec-block-size": "block_size",
    "codec-fraction": "fraction",
    "codec-values": "values",
    "codec-min-dims": "min_dims",
    "codec-chunk": "chunk",
    "codec-k": "k",
    "codec-bits": "bits",
}


class ErrorFeedback:
    """Compress with a codec, carrying the residual ``e`` across calls (see module doc).

    Only tensors the codec actually encodes carry a residual (``raw`` tensors travel exactly).
    """

    def __init__(self, codec: str, **options: Any) -> None:
        self.codec = codec
        self.options = normalize_options(codec, options)
        self.residual: dict[str, torch.Tensor] = {}

    @property
    def decay(self) -> float:
        """``beta`` of ``c = delta + beta e`` (the ``ef_decay`` option)."""
        return float(self.options.get("ef_decay", 1.0))

    def compress(self, tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
        """Encode ``c = delta + beta e`` and set ``e <- c - decode(encode(c))``."""
        beta = self.decay
        target: dict[str, torch.Tensor] = {}
        for k, t in tensors.items():
            e = self.residual.get(k)
            if e is not None and e.shape != t.shape:
                raise ValueError(
                    f"residual of {k!r} has shape {tuple(e.shape)}, delta {tuple(t.shape)}"
                )
            enc = encoding(t, self.codec, self.options)
            if e is None or enc == "raw":
                target[k] = t.detach()
            else:
                target[k] = t.detach().float() + (e if beta == 1.0 else beta * e)
        record = compress(target, self.codec, **self.options)
        decoded = decompress(record)
        residual = {}
        for k, c in target.items():
            if encoding(c, self.codec, self.options) != "raw":
                residual[k] = c.float() - decoded[k].float()
        self.residual = residual
        return record

    def state_dict(self) -> dict[str, Any]:
        """``{"codec", "options", "residual": {name: fp32 tensor}}``."""
        return {
            "codec": self.codec,
            "options": dict(self.options),
            "residual": {k: v.clone() for k, v in self.residual.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a residual (a codec change keeps it: it is still what was not sent)."""
        res = state.get("residual", {}) if isinstance(state, Mapping) else None
        if not isinstance(res, Mapping):
            raise ValueError("ErrorFeedback state has no 'residual' mapping")
        out = {}
        for k, v in res.items():
            if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                raise ValueError(f"residual {k!r} is not a floating tensor")
            if not bool(torch.isfinite(v).all()):
                raise ValueError(f"residual {k!r} has non-finite entries")
            out[k] = v.detach().float().clone()
        self.residual = out


def request_config(
    codec: str | None, options: Mapping[str, Any] | None = None, error_feedback: bool = True
) -> dict[str, Any]:
    """Flat train-config entries asking workers for ``codec`` (``{}`` for None / "none")."""
    if codec is None or codec == "none":
        normalize_options("none", options)
        return {}
    opts = normalize_options(codec, options)
    back = {v: k for k, v in OPTION_KEYS.items()}
    back["ef_decay"] = EF_DECAY_KEY
    return {CODEC_KEY: codec, EF_KEY: bool(error_feedback), **{back[k]: v for k, v in opts.items()}}


def parse_request(cfg: Mapping[str, Any]) -> tuple[str, dict[str, Any], bool] | None:
    """``(codec, options, error_feedback)`` a train config asks for, or None (plain reply).

    Raises ValueError for an unknown codec or a bad option value (naming the config key).
    """
    codec = cfg.get(CODEC_KEY)
    if codec is None or codec == "none":
        return None
    if codec not in CODECS:
        raise ValueError(f"train config {CODEC_KEY!r}={codec!r}: expected one of {CODECS}")
    defaults = normalize_options(codec)
    keys = {**OPTION_KEYS, EF_DECAY_KEY: "ef_decay"}
    opts = {keys[k]: v for k, v in cfg.items() if k in keys and keys[k] in defaults}
    try:
        opts = normalize_options(codec, opts)
    except ValueError as exc:
        raise ValueError(f"train config codec options: {exc}") from None
    ef = cfg.get(EF_KEY, True)
    if not isinstance(ef, bool):
        raise ValueError(f"train config {EF_KEY!r} must be a bool, got {ef!r}")
    return codec, opts, ef
