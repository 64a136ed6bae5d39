"""Compressed pseudo-gradient uploads: codecs, self-describing records, error feedback.

See the repository's ``docs/compression.md`` ("Compressed pseudo-gradient uploads"). ``compress(tensors, codec, **options) -> ArrayRecord``,
``decompress(record) -> dict[str, torch.Tensor]``, ``ErrorFeedback(codec, **options)``. Codecs:
``none``, ``int8``, ``fp8``, ``topk`` (codecs.py), ``int4``, ``sparseloco`` (lowbit.py).
"""

from flwr_isoloco.compression.feedback import (
    CODEC_KEY,
    EF_DECAY_KEY,
    EF_KEY,
    OPTION_KEYS,
    ErrorFeedback,
    parse_request,
    request_config,
)
from flwr_isoloco.compression.record import (
    CODECS,
    EF_DECAY_DEFAULTS,
    HEADER_KEY,
    compress,
    decompress,
    encoding,
    header,
    is_compressed,
    normalize_options,
    payload_nbytes,
)
from flwr_isoloco.compression.step import EXACT

__all__ = [
    "CODECS",
    "EXACT",
    "CODEC_KEY",
    "EF_DECAY_DEFAULTS",
    "EF_DECAY_KEY",
    "EF_KEY",
    "HEADER_KEY",
    "OPTION_KEYS",
    "ErrorFeedback",
    "compress",
    "decompress",
    "encoding",
    "header",
    "is_compressed",
    "normalize_options",
    "parse_request",
    "payload_nbytes",
    "request_config",
]
