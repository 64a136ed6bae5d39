"""Low-bit codecs: ``sparseloco`` (chunked top-k, lookup-table values, bit-packed chunk-local
indices) and ``int4`` (4-bit block-scaled, dense). Pure torch, no Flower, no notion of client or
server: the same encode/decode serves uploads and downloads.

**Bit streams.** ``pack_bits(v, w)`` writes value ``j`` into bits ``[j w, (j + 1) w)`` of the
stream, bit ``b`` of the stream being bit ``b mod 8`` of byte ``b // 8`` (LSB first), so a stream
of ``m`` values takes ``ceil(m w / 8)`` bytes and the unused high bits of the last byte are zero
(checked on receipt). For ``w = 12`` two indices fill 3 bytes exactly as templar packs them.

**sparseloco** (after templar's ``src/tplr/compress.py``, the SparseLoCo compressor; rewritten,
not copied). A tensor of shape ``(R, ...)`` is viewed as ``(R, C)`` with ``C = n / R`` (1-D and
0-D as ``(1, n)``). Tiles are ``h x w`` with ``h`` the largest divisor of ``R`` that is at most
``side = isqrt(chunk)`` and ``w`` likewise for ``C`` (templar's ``_get_smaller_split``: no
padding, every tile full; a 64-multiple dimension gives 64, a prime one 1). Each tile of
``T = h w`` entries keeps its ``k_t`` entries of largest ``|x|``; their tile-local indices
(``r w + c``) go ascending, ``ceil(log2 T)`` bits each.

*Tiles and small tensors.* ``k_t`` is ``k`` scaled to the tile, rounded half up::

    k_t = floor(k T / chunk + 1/2)          (integers: (2 k T + chunk) // (2 chunk))

so every tile keeps the density ``k / chunk`` asked for, up to the rounding: ``|k_t - k T /
chunk| <= 1/2``, so ``k_t / T`` is within 2/3 and 2 times ``k / chunk`` on a tile that keeps
any (within 2/3 and 4/3 once ``k T / chunk >= 3/2``), and a full tile (``T = chunk``) keeps
exactly ``k`` (64 x 64 tiles encode bit for bit as before). Rounding to the nearest is the
smallest error either way; rounding up would keep nearly twice the density on tiles with
``k T / chunk`` just above 1, down would keep nothing on tiles with ``k T < chunk``. templar
keeps ``min(k, T)`` instead (its ``_clamp_topk``), which is right for its models (every
dimension a multiple of 64, full tiles) but on smaller tiles keeps far more than ``k / chunk``:
all of a 97 x 64 tensor (97 is prime: 1 x 64 tiles), half of a 2 x 4096 one, 2.8 % instead of
1.56 % of a 96 x 96 one (48 x 48 tiles).
A tile with ``k_t = 0`` (``2 k T < chunk``: even one entry would be more than twice the asked
density, e.g. 97 x 97 -> 1 x 1 tiles) cannot be compressed at about that density: such a
tensor is not encoded with sparseloco at all but travels raw, fp32, by the record's existing
per-tensor ``"raw"`` encoding (``record.encoding`` asks :func:`sparse_refusal`), as the
tensors below ``min_dims`` do. Raw rather than a refusal because the record format already
carries a per-tensor encoding that every decoder reads (no new format, no new option), and a
refusal would make a whole model unusable with sparseloco for one odd tensor (the only way out
being a ``min_dims`` that also sends every other tensor of those dims raw); the tensors it
sends raw are tiny or rare (at the defaults: tiles under 32 entries, i.e. a tiny tensor or
one whose two dimensions have largest divisors <= 64 that multiply to under 32: 97 x 97, 97 x
31).
:func:`sparse_geometry` is the one geometry the encoder, the decoder and the record's length
checks (:func:`sparseloco_layout`, :func:`checked_indices`, :func:`sparseloco_bytes`) all
derive from; it raises ValueError for such a shape, so a record that claims sparseloco for one
is refused, and so is one whose index / code streams are not ``tiles x k_t`` long.

The ``m`` kept values of the whole tensor share one table (templar's ``_quantize_values`` with
``L = 2^bits`` bins over a range of 6 sigma)::

    mu = mean(v);  sigma = ||v - mu|| / sqrt(m - 1);  s = 6 sigma / L  (s = 1 if 0 or not finite)
    c = clamp(round((v - mu) / s + L/2), 0, L - 1);  table[c] = mean of the v with that code

so bin ``c`` is centred on ``mu + (c - L/2) s``: for ``L = 4`` the bins are ``d < -2.25 sigma``,
``[-2.25, -0.75)``, ``[-0.75, 0.75)`` and ``d >= 0.75 sigma`` (``d = v - mu``), i.e. the signed
values are binned as they are (no sign bit) and the range is asymmetric, one open bin above and
two below the mean, as templar's. A bin nobody fell in holds ``mu``. The decoded tensor is zero
except ``x_hat[kept] = table[c]``.

**int4**: symmetric, block scales (as int8): ``s_b = max|x_b| / 7``, ``q = round(x / s_b)`` in
[-7, 7], carried as the nibble ``q + 8`` (1..15; 0 is never written and is refused), two per byte,
so ``|x - x_hat| <= s_b / 2 = max|x_b| / 14``.
"""

from __future__ import annotations

import math

import torch

from flwr_isoloco.compression import codecs as C

RANGE_SIGMAS = 6.0  # templar's quantization_range: the bins span mean +- 3 sigma
INT4_MAX = 7.0
SPARSELOCO_BITS = (2, 4)


def pack_bits(v: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 stream of the values ``0 <= v < 2^width`` (see module doc for the bit order)."""
    v = v.reshape(-1).to(torch.int64)
    m = v.numel()
    nbytes = -(-m * width // 8)
    if 8 % width == 0:  # whole values per byte: one shift per slot
        per = 8 // width
        v = torch.nn.functional.pad(v, (0, nbytes * per - m)).view(nbytes, per)
        return (v << (torch.arange(per) * width)).sum(1).to(torch.uint8)
    # Value j starts at bit p = j w and spans <= 4 bytes (w <= 25): add its shifted bits
    # byte by byte; the bits of distinct values never overlap, so a sum is an OR.
    pos = torch.arange(m, dtype=torch.int64) * width
    shifted, first = v << (pos & 7), pos >> 3
    out = torch.zeros(nbytes + 3, dtype=torch.int64)
    for j in range(4):
        out.index_add_(0, first + j, (shifted >> (8 * j)) & 0xFF)
    out = out[:nbytes]
    return out.to(torch.uint8)


def unpack_bits(buf: torch.Tensor, width: int, m: int) -> torch.Tensor:
    """The ``m`` int64 values of a :func:`pack_bits` stream (length already checked)."""
    b8 = buf.to(torch.int64)
    if 8 % width == 0:
        per = 8 // width
        mask = (1 << width) - 1
        v = (b8[:, None] >> (torch.arange(per) * width)) & mask
        return v.reshape(-1)[:m]
    # Little-endian 32-bit window at the value's first byte, shifted by its bit offset.
    pos = torch.arange(m, dtype=torch.int64) * width
    first, padded = pos >> 3, torch.nn.functional.pad(b8, (0, 3))
    word = padded[first] | padded[first + 1] << 8 | padded[first + 2] << 16
    out = ((word | padded[first + 3] << 24) >> (pos & 7)) & ((1 << width) - 1)
    return out


def packed_len(m: int, width: int) -> int:
    """Bytes of a stream of ``m`` values of ``width`` bits: ``ceil(m width / 8)``."""
    return -(-m * width // 8)


def padding_clear(buf: torch.Tensor, m: int, width: int) -> bool:
    """Whether the bits after the stream's ``m width`` bits (last byte) are zero."""
    used = (m * width) % 8
    return used == 0 or buf.numel() == 0 or int(buf[-1]) >> used == 0


# ----------------------------------------------------------------------------- sparseloco


def largest_divisor(n: int, cap: int) -> int:
    """Largest divisor of ``n`` that is ``<= cap`` (``n`` itself when ``n <= cap``)."""
    for d in range(min(n, cap), 0, -1):
        if n % d == 0:
            return d
    return 1


def tiling(shape: tuple[int, ...], chunk: int) -> tuple[int, int, int, int]:
    """``(R, C, h, w)``: the ``(R, C)`` view of ``shape`` and its tile sides (module doc)."""
    n = math.prod(shape)
    rows = shape[0] if len(shape) >= 2 else 1
    cols = n // rows if rows else 0
    side = math.isqrt(chunk)
    return rows, cols, largest_divisor(rows, side), largest_divisor(cols, side)


def tile_keep(t: int, chunk: int, k: int) -> int:
    """``k_t`` of a tile of ``t`` entries: ``k t / chunk`` rounded half up (module doc), ``k``
    on a full tile; 0 when ``2 k t < chunk`` (the tile is too small for the density)."""
    return (2 * k * t + chunk) // (2 * chunk)


def sparse_refusal(shape: tuple[int, ...], chunk: int, k: int) -> str | None:
    """Why a tensor of ``shape`` cannot be sparseloco-encoded at about the density ``k /
    chunk`` (its tiles keep ``k_t = 0``), or None when it can."""
    rows, cols, h, w = tiling(shape, chunk)
    t = h * w
    if tile_keep(t, chunk, k) > 0:
        return None
    return (
        f"shape {tuple(shape)} gets {h} x {w} tiles of {t} entries (viewed as {rows} x {cols}): "
        f"one entry per tile is {chunk / (k * t):.3g}x the density k / chunk = {k}/{chunk}, "
        "more than 2x, so sparseloco does not encode it; compress() sends such a "
        "tensor raw (fp32). To compress it, use a chunk and k with 2 k T >= chunk; to send "
        "it raw explicitly, raise min_dims above its number of dimensions"
    )


def sparse_geometry(shape: tuple[int, ...], chunk: int, k: int) -> tuple[int, int, int, int]:
    """``(tiles, T, k_t, index_bits)`` of a tensor: ``k_t`` = :func:`tile_keep` (``k`` on
    full tiles), ``index_bits = max(1, ceil(log2 T))`` (12 for 64 x 64 tiles). The one
    geometry of encoder, decoder and length checks; ValueError (:func:`sparse_refusal`) for a
    shape whose tiles are too small for the density."""
    if why := sparse_refusal(shape, chunk, k):
        raise ValueError(f"sparseloco: {why}")
    rows, cols, h, w = tiling(shape, chunk)
    t = h * w
    return (rows // h) * (cols // w), t, tile_keep(t, chunk, k), max(1, (t - 1).bit_length())


def sparseloco_layout(shape: tuple[int, ...], o) -> dict[str, tuple[str, int]]:
    """Parts ``i`` (packed indices), ``q`` (packed codes), ``t`` (fp32 table of 2^bits)."""
    nt, _, kt, ib = sparse_geometry(shape, o["chunk"], o["k"])
    m = nt * kt
    return {
        "i": ("uint8", packed_len(m, ib)),
        "q": ("uint8", packed_len(m, o["bits"])),
        "t": ("float32", 1 << o["bits"]),
    }


def _tiles(x: torch.Tensor, shape: tuple[int, ...], chunk: int) -> torch.Tensor:
    rows, cols, h, w = tiling(shape, chunk)
    return x.reshape(rows // h, h, cols // w, w).permute(0, 2, 1, 3).reshape(-1, h * w)


def _untile(tiles: torch.Tensor, shape: tuple[int, ...], chunk: int) -> torch.Tensor:
    rows, cols, h, w = tiling(shape, chunk)
    return tiles.reshape(rows // h, cols // w, h, w).permute(0, 2, 1, 3).reshape(-1)


def quantise_table(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, table)`` of the values ``v`` (module doc: 2^bits bins over mean +- 3 sigma,
    ``table[c]`` = mean of the values coded ``c``, accumulated in fp64; ``mu`` if none)."""
    levels = 1 << bits
    v64 = v.to(torch.float64)
    mu = v64.mean()
    d = v64 - mu
    sigma = d.norm() / math.sqrt(max(v.numel() - 1, 1))
    s = float(RANGE_SIGMAS * sigma / levels)
    if not math.isfinite(s) or s == 0.0:
        s = 1.0
    codes = torch.round(d / s + levels // 2).clamp_(0, levels - 1).to(torch.int64)
    sums = torch.zeros(levels, dtype=torch.float64).index_add_(0, codes, v64)
    counts = torch.bincount(codes, minlength=levels).to(torch.float64)
    table = torch.where(counts > 0, sums / counts.clamp_min(1), mu)
    return codes, table.to(torch.float32)


def encode_sparseloco(
    x: torch.Tensor, shape: tuple[int, ...], chunk: int, k: int, bits: int
) -> dict[str, torch.Tensor]:
    """Top-``k_t`` of each tile (indices ascending), values through one per-tensor table."""
    nt, t, kt, ib = sparse_geometry(shape, chunk, k)
    tiles = _tiles(x, shape, chunk)
    idx = torch.topk(tiles.abs(), kt, dim=1, sorted=False).indices.sort(dim=1).values
    codes, table = quantise_table(tiles.gather(1, idx).reshape(-1), bits)
    return {"i": pack_bits(idx, ib), "q": pack_bits(codes, bits), "t": table}


def checked_indices(
    parts: dict[str, torch.Tensor], shape: tuple[int, ...], o
) -> torch.Tensor | str:
    """The ``(tiles, k_t)`` tile-local indices of length-checked parts, or why they are
    unusable: non-finite table, stray padding bits, indices ``>= T`` or not strictly increasing
    within a tile. Codes need no check: a ``bits``-bit code always indexes the
    ``2^bits``-entry table."""
    nt, t, kt, ib = sparse_geometry(shape, o["chunk"], o["k"])
    if not bool(torch.isfinite(parts["t"]).all()):
        return f"has {int((~torch.isfinite(parts['t'])).sum())} non-finite table entries"
    m = nt * kt
    if not padding_clear(parts["i"], m, ib) or not padding_clear(parts["q"], m, o["bits"]):
        return "has non-zero padding bits after its packed indices or codes"
    idx = unpack_bits(parts["i"], ib, m).view(nt, kt)
    if m and int(idx.max()) >= t:
        return f"has tile-local indices >= the tile size {t} (max {int(idx.max())})"
    if kt > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
        return "has tile indices that are not strictly increasing (duplicates or unsorted)"
    return idx


def decode_sparseloco(
    parts: dict[str, torch.Tensor], shape: tuple[int, ...], o
) -> torch.Tensor | str:
    """Flat fp32 ``x_hat`` (zeros except ``table[code]`` at the kept entries), or why not."""
    idx = checked_indices(parts, shape, o)
    if isinstance(idx, str):
        return idx
    nt, t, kt, _ = sparse_geometry(shape, o["chunk"], o["k"])
    vals = parts["t"][unpack_bits(parts["q"], o["bits"], nt * kt)].view(nt, kt)
    tiles = torch.zeros(nt, t, dtype=torch.float32).scatter_(1, idx, vals)
    return _untile(tiles, shape, o["chunk"])


def sparseloco_bytes(shape: tuple[int, ...], o) -> int:
    """Payload bytes of one floating tensor of at least ``min_dims`` dims under sparseloco: the
    sum of its parts, or ``4 n`` (raw fp32) for a shape :func:`sparse_refusal` refuses."""
    if sparse_refusal(shape, o["chunk"], o["k"]):
        return 4 * math.prod(shape)
    return sum(n * (4 if d == "float32" else 1) for d, n in sparseloco_layout(shape, o).values())


# ----------------------------------------------------------------------------- int4


def encode_int4(x: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
    """Parts ``q`` (uint8, two nibbles ``q + 8`` per byte, ceil(n/2)) and ``s`` (fp32)."""
    xb = C.blocks(x, block_size)
    scale, safe = C.block_scales(xb, INT4_MAX)
    q = torch.round(xb / safe[:, None]).clamp_(-INT4_MAX, INT4_MAX).to(torch.int64) + 8
    return {"q": pack_bits(q.reshape(-1)[: x.numel()], 4), "s": scale.contiguous()}


def decode_int4(q: torch.Tensor, s: torch.Tensor, n: int, block_size: int) -> torch.Tensor | str:
    """``x_hat = (nibble - 8) s_b``, or why not (nibble 0, stray padding, bad scales)."""
    if why := C.check_scales(s):
        return why
    if not padding_clear(q, n, 4):
        return "has a non-zero padding nibble"
    codes = unpack_bits(q, 4, n)
    if bad := int((codes == 0).sum()):
        return f"has {bad} int4 codes of -8 (outside [-7, 7])"
    return C.decode_int8((codes - 8).to(torch.int8), s, block_size)


def int4_layout(n: int, block_size: int) -> dict[str, tuple[str, int]]:
    """``q``: uint8 ceil(n/2); ``s``: fp32 ceil(n/B)."""
    return {"q": ("uint8", packed_len(n, 4)), "s": ("float32", C.n_blocks(n, block_size))}


__all__ = [
    "RANGE_SIGMAS",
    "SPARSELOCO_BITS",
    "pack_bits",
    "unpack_bits",
    "packed_len",
    "padding_clear",
    "largest_divisor",
    "tiling",
    "tile_keep",
    "sparse_refusal",
    "sparse_geometry",
    "sparseloco_layout",
    "quantise_table",
    "encode_sparseloco",
    "checked_indices",
    "decode_sparseloco",
    "sparseloco_bytes",
    "encode_int4",
    "decode_int4",
    "int4_layout",
]
