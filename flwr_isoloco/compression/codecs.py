"""Per-tensor encoders and decoders of the upload codecs (pure torch; no Flower inside).

Every encoder takes a flat fp32 tensor ``x`` of ``n`` entries and returns named parts (1-D torch
tensors); every decoder takes those parts (already checked for dtype and length by
:mod:`flwr_isoloco.compression.record`) and returns the flat fp32 reconstruction ``x_hat``.

Block scales (``B = block_size``, block ``b`` = entries ``bB .. (b+1)B - 1``, the last block
may be short), symmetric, round to nearest:

- ``int8``: ``s_b = max|x_b| / 127``, ``q = round(x / s_b)`` in [-127, 127],
  ``x_hat = q s_b``, so ``|x - x_hat| <= s_b / 2 = max|x_b| / 254``.
- ``fp8`` (e4m3, max 448): ``s_b = max|x_b| / 448``, ``y = fp8(x / s_b)`` (round to nearest
  even), ``x_hat = y s_b``. e4m3 has 3 mantissa bits, so ``|x - x_hat| <= 2^-4 |x|`` for
  ``|x / s_b| >= 2^-6`` (normal) and ``<= 2^-10 s_b`` below (subnormal spacing 2^-9).
- ``topk``: the ``k = max(1, round(fraction n))`` entries of largest ``|x|``, indices sorted
  ascending (int32), values fp32 or int8 with block scales over the k values.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8 e4m3fn
INT8_MAX = 127.0
# Largest scale whose products with the codes stay finite in fp32.
MAX_SCALE = torch.finfo(torch.float32).max / FP8_MAX


def n_blocks(n: int, block_size: int) -> int:
    """``ceil(n / block_size)``."""
    return -(-n // block_size)


def topk_count(n: int, fraction: float) -> int:
    """``k = max(1, round(fraction * n))``, at most ``n``."""
    return min(n, max(1, round(fraction * n)))


def blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` flattened, zero-padded to whole blocks, as ``(n_blocks, block_size)``."""
    nb = n_blocks(x.numel(), block_size)
    pad = nb * block_size - x.numel()
    return torch.nn.functional.pad(x, (0, pad)).view(nb, block_size)


def block_scales(xb: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block scales ``max|x_b| / top`` and a divisor safe for all-zero blocks."""
    scale = xb.abs().amax(dim=1) / top
    return scale, torch.where(scale > 0, scale, torch.ones_like(scale))


def encode_int8(x: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
    """Symmetric int8 with one fp32 scale per block: parts ``q`` (int8, n), ``s`` (fp32)."""
    xb = blocks(x, block_size)
    scale, safe = block_scales(xb, INT8_MAX)
    q = torch.round(xb / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return {"q": q.reshape(-1)[: x.numel()].contiguous(), "s": scale.contiguous()}


def decode_int8(q: torch.Tensor, s: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x_hat = q * s_b`` (fp32)."""
    n = q.numel()
    full = torch.nn.functional.pad(q.to(torch.float32), (0, s.numel() * block_size - n))
    return (full.view(-1, block_size) * s[:, None]).reshape(-1)[:n]


def encode_fp8(x: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
    """float8 e4m3 of ``x / s_b`` carried as its uint8 bit pattern: parts ``q``, ``s``."""
    xb = blocks(x, block_size)
    scale, safe = block_scales(xb, FP8_MAX)
    y = (xb / safe[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"q": y.view(torch.uint8).reshape(-1)[: x.numel()].contiguous(), "s": scale}


def fp8_nan_count(q: torch.Tensor) -> int:
    """Number of e4m3fn NaN codes (``0x7F``, ``0xFF``) in a uint8 tensor."""
    return int(((q & 0x7F) == 0x7F).sum())


def decode_fp8(q: torch.Tensor, s: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x_hat = fp8(q) * s_b`` (fp32)."""
    n = q.numel()
    y = q.view(torch.float8_e4m3fn).to(torch.float32)
    full = torch.nn.functional.pad(y, (0, s.numel() * block_size - n))
    return (full.view(-1, block_size) * s[:, None]).reshape(-1)[:n]


def encode_topk(
    x: torch.Tensor, fraction: float, values: str, block_size: int
) -> dict[str, torch.Tensor]:
    """Top-k by magnitude: parts ``i`` (int32, sorted) and ``v`` (fp32) or ``q``/``s`` (int8)."""
    k = topk_count(x.numel(), fraction)
    idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values
    vals = x[idx]
    out = {"i": idx.to(torch.int32)}
    if values == "int8":
        out.update(encode_int8(vals, block_size))
    else:
        out["v"] = vals.contiguous()
    return out


def decode_topk(n: int, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """Zeros except ``x_hat[idx] = vals`` (indices already checked: sorted, in [0, n))."""
    out = torch.zeros(n, dtype=torch.float32)
    out[idx.long()] = vals
    return out


def check_sorted_indices(idx: torch.Tensor, n: int) -> str | None:
    """Why ``idx`` is not strictly increasing in ``[0, n)``, or None."""
    if idx.numel() == 0:
        return "has no indices"
    lo, hi = int(idx[0]), int(idx[-1])
    if lo < 0 or hi >= n:
        return f"has indices outside [0, {n}) (first {lo}, last {hi})"
    if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
        return "has indices that are not strictly increasing (duplicates or unsorted)"
    return None


def check_scales(s: torch.Tensor) -> str | None:
    """Why block scales are unusable (non-finite, negative, or so large the codes overflow)."""
    if not bool(torch.isfinite(s).all()):
        return f"has {int((~torch.isfinite(s)).sum())} non-finite scales"
    if s.numel() and float(s.min()) < 0:
        return "has negative scales"
    if s.numel() and float(s.max()) > MAX_SCALE:
        return f"has scales above {MAX_SCALE:.3g} (the decoded values would overflow fp32)"
    return None


def fp8_bound(x: torch.Tensor, scale_per_entry: torch.Tensor) -> torch.Tensor:
    """Per-entry error bound of the fp8 codec: ``max(2^-4 |x|, 2^-10 s_b)``."""
    return torch.maximum(x.abs() * 2.0**-4, scale_per_entry * 2.0**-10)


def ideal_bytes(n: int, codec: str, options: dict) -> int:
    """Payload bytes of one encoded tensor of ``n`` entries (sum of its parts' nbytes)."""
    b = options.get("block_size", 256)
    if codec in ("int8", "fp8"):
        return n + 4 * n_blocks(n, b)
    if codec == "topk":
        k = topk_count(n, options["fraction"])
        vals = k + 4 * n_blocks(k, b) if options.get("values") == "int8" else 4 * k
        return 4 * k + vals
    return 4 * n


__all__ = [
    "FP8_MAX",
    "INT8_MAX",
    "n_blocks",
    "blocks",
    "block_scales",
    "topk_count",
    "encode_int8",
    "decode_int8",
    "encode_fp8",
    "decode_fp8",
    "fp8_nan_count",
    "encode_topk",
    "decode_topk",
    "check_sorted_indices",
    "check_scales",
    "fp8_bound",
    "ideal_bytes",
]
