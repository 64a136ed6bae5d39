"""Compressed pseudo-gradient uploads: codecs, self-describing records, error feedback.

See https://github.com/flwr-isoloco/flwr-isoloco/blob/main/docs/compression.md. ``compress(tensors, codec, **options) -> ArrayRecord``,
``decompress(record) -> dict[str, torch.Tensor]``, ``ErrorFeedback(codec, **options)``.
"""

from flwr_isoloco.compression.feedback import (
    CODEC_KEY,
    EF_KEY,
    OPTION_KEYS,
    ErrorFeedback,
    parse_request,
    request_config,
)
from flwr_isoloco.compression.record import (
    CODECS,
    HEADER_KEY,
    compress,
    decompress,
    encoding,
    header,
    is_compressed,
    normalize_options,
    payload_nbytes,
)

__all__ = [
    "CODECS",
    "CODEC_KEY",
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
