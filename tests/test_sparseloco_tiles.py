"""sparseloco on tiles smaller than ``chunk`` (flwr_isoloco/compression/lowbit.py, "Tiles and
small tensors"): each tile keeps ``k_t = k T / chunk`` rounded half up, so the density is about
``k / chunk`` on every shape (templar's ``min(k, T)`` kept all of a 97 x 64 tensor); full tiles
encode bit for bit as before; a shape whose tiles are too small (``2 k T < chunk``) travels raw,
and a record claiming otherwise, or carrying another ``k_t``, is refused."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from flwr_isoloco.compression import (
    HEADER_KEY,
    ErrorFeedback,
    compress,
    decompress,
    encoding,
    normalize_options,
)
from flwr_isoloco.compression import lowbit as L

CHUNK, K = 4096, 64
DENSITY = K / CHUNK  # 1.5625 %

# shape -> (tile h x w, k_t, density kept); "before": what min(k, T) kept.
SHAPES = {
    (97, 64): ((1, 64), 1, 1 / 64),  # 97 is prime; before: 100 %
    (2, 4096): ((2, 64), 2, 2 / 128),  # before: 50 %
    (96, 96): ((48, 48), 36, 36 / 2304),  # before: 64 / 2,304 = 2.78 %
    (256, 256): ((64, 64), 64, 64 / 4096),  # full tiles: unchanged
    (1000,): ((1, 50), 1, 1 / 50),  # 64 x 50 / 4,096 = 0.78 -> 1: 2 %; before: 100 %
}


def _x(shape, seed=0) -> torch.Tensor:
    """Heavy-tailed entries, none zero (so a decoded non-zero is exactly a kept entry)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*shape, generator=g)
    return z / torch.randn(*shape, 3, generator=g).pow(2).mean(-1).sqrt() + 1e-3 * z.sign()


def _np_tiles(a: np.ndarray, shape) -> tuple[np.ndarray, int, int]:
    """(tiles, T) entries numbered as lowbit's: independent of its code (numpy loops)."""
    rows = shape[0] if len(shape) >= 2 else 1
    cols = a.size // rows
    h = max(d for d in range(1, 65) if rows % d == 0)
    w = max(d for d in range(1, 65) if cols % d == 0)
    m = a.reshape(rows, cols)
    tiles = [
        m[r : r + h, c : c + w].reshape(-1) for r in range(0, rows, h) for c in range(0, cols, w)
    ]
    return np.stack(tiles), h, w


@pytest.mark.parametrize("shape", list(SHAPES))
def test_density_is_k_over_chunk_on_every_tile(shape):
    (h, w), kt, density = SHAPES[shape]
    assert L.tiling(shape, CHUNK)[2:] == (h, w)
    nt, t, got_kt, _ = L.sparse_geometry(shape, CHUNK, K)
    assert (t, got_kt) == (h * w, kt)
    assert abs(kt - K * t / CHUNK) <= 0.5  # the rounding's bound
    assert DENSITY / 1.5 <= kt / t <= 2 * DENSITY  # and the stated one (module doc)
    x = _x(shape)
    dec = decompress(compress({"w": x}, "sparseloco", min_dims=1))["w"]
    kept = dec.numpy() != 0
    assert kept.mean() == pytest.approx(density, abs=1e-12)
    tiles, _, _ = _np_tiles(kept, shape)
    assert (tiles.sum(1) == kt).all()  # every tile, not only on average


def test_the_bound_holds_on_every_tile_size_and_too_small_tiles_are_refused():
    for chunk, k in ((4096, 64), (4096, 128), (4096, 1), (64, 4), (16, 16), (4, 1)):
        for t in range(1, chunk + 1):
            kt = L.tile_keep(t, chunk, k)
            assert kt == math.floor(k * t / chunk + 0.5) and kt <= t
            if 2 * k * t < chunk:
                assert kt == 0
            else:
                assert 1 <= kt and abs(kt - k * t / chunk) <= 0.5
                assert 2 / 3 * k / chunk < kt / t <= 2 * k / chunk
        assert L.tile_keep(chunk, chunk, k) == k  # full tiles: exactly k


# The encoder's parts on 64 x 64 tiles, computed with min(k, T) before k was scaled to the
# tile: sha256 over the bytes of parts i, q, t.
BEFORE = {
    ("randn", 4096, 64, 2): "e0e28dad4014b0ba1b29966c10859deb70c4434ed2b47daf2faeda913e007ddd",
    ("randn", 4096, 128, 4): "67ed5dd0e5faf72dbb2fc5b639dc1219e67db66fc0b1f1dc9174dc883024ca0c",
    ("randn", 4096, 1, 2): "ad361ae0aa4941ae852700f7cef82590497997954eb337760648925b4b801d0b",
    ("sin", 4096, 64, 2): "a7d37a53e3ea971921fa5e8a589d4f7bdc23dc9e6e45fab117284a88c896a115",
    ("sin", 4096, 128, 4): "52fc57edf1bc967cbe382eae41d34e1785c3fdd1624e762bff7eb3803cac58d7",
    ("sin", 4096, 1, 2): "6b55b58082c96bc7bea4778cf75ba31ab2ac67328e900ca36bc73843a8b8f8cd",
    ("randn", 64, 4, 2): "65065767573f66650fe93ae8ceeeb7fd660c94bf94c1aaa06cc024c7f4402514",
}


@pytest.mark.parametrize("key", list(BEFORE))
def test_full_tiles_encode_bit_for_bit_as_before(key):
    name, chunk, k, bits = key
    if name == "randn":
        x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1234))
    else:
        i = torch.arange(256 * 256, dtype=torch.float64)
        x = torch.sin(i * 0.7071).float().reshape(256, 256) * torch.arange(1, 257).float()
    parts = L.encode_sparseloco(x.reshape(-1), (256, 256), chunk, k, bits)
    h = hashlib.sha256()
    for p in ("i", "q", "t"):
        h.update(parts[p].contiguous().numpy().tobytes())
    assert h.hexdigest() == BEFORE[key]
    rec = compress({"w": x}, "sparseloco", chunk=chunk, k=k, bits=bits)
    assert all(np.array_equal(rec[f"w/{p}"].numpy(), parts[p].numpy()) for p in parts)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_round_trip_keeps_each_tiles_largest_entries_through_the_table(shape):
    x = _x(shape, seed=1)
    rec = compress({"w": x, "b": torch.ones(3)}, "sparseloco", min_dims=1)
    head = json.loads(bytes(rec[HEADER_KEY].numpy()).decode())["tensors"]
    assert head["w"]["enc"] == "sparseloco" and head["b"]["enc"] == "raw"  # 3 entries: raw
    out = decompress(rec, shapes={"w": shape, "b": (3,)})
    assert out["w"].shape == shape and out["w"].dtype == torch.float32
    assert torch.equal(out["b"], torch.ones(3))
    kept, table = out["w"].numpy() != 0, rec["w/t"].numpy()
    assert np.isin(out["w"].numpy()[kept], table).all()  # decoded = table[code]
    ax, _, _ = _np_tiles(np.abs(x.numpy()), shape)
    kt, _, _ = _np_tiles(kept, shape)
    for a, m in zip(ax, kt, strict=True):  # the kept entries are the tile's largest |x|
        assert float(a[m].min()) > float(a[~m].max())
    o = normalize_options("sparseloco", {"min_dims": 1})
    parts = sum(rec[f"w/{p}"].numpy().nbytes for p in "iqt")
    assert parts == L.sparseloco_bytes(shape, o)


@pytest.mark.parametrize("shape", [(97, 97), (3, 5), (7,), (31, 1)])
def test_tiles_too_small_for_the_density_travel_raw(shape):
    x = _x(shape, seed=2)
    o = normalize_options("sparseloco", {"min_dims": 1})
    assert encoding(x, "sparseloco", o) == "raw"
    assert (
        encoding(
            x, "sparseloco", normalize_options("sparseloco", {"min_dims": 1, "chunk": 4, "k": 2})
        )
        == "sparseloco"
    )
    rec = compress({"w": x}, "sparseloco", min_dims=1)
    assert set(rec.keys()) == {HEADER_KEY, "w/v"}
    assert torch.equal(decompress(rec)["w"], x)  # exact: fp32 as sent
    assert L.sparseloco_bytes(shape, o) == 4 * x.numel()
    why = L.sparse_refusal(shape, CHUNK, K)
    assert str(shape) in why and "tiles" in why and "raw" in why and "min_dims" in why
    with pytest.raises(ValueError, match=r"sparseloco: shape .* gets \d+ x \d+ tiles"):
        L.encode_sparseloco(x.reshape(-1), shape, CHUNK, K, 2)
    ef = ErrorFeedback("sparseloco", min_dims=1)  # exact, so no residual to carry
    ef.compress({"w": x})
    assert "w" not in ef.residual


def _with(rec: ArrayRecord, **parts) -> ArrayRecord:
    return ArrayRecord(
        {**{k: rec[k] for k in rec.keys()}, **{k: Array(v) for k, v in parts.items()}}
    )


def test_a_record_with_templars_k_t_is_refused():
    """A (97, 64) tensor encoded with k_t = min(k, T) = 64 (templar's rule) instead of 1: the
    index and code streams are 64x too long for the geometry the decoder derives."""
    x = _x((97, 64), seed=3)
    rec = compress({"w": x}, "sparseloco")
    nt, t, kt, ib = L.sparse_geometry((97, 64), CHUNK, K)
    assert (nt, t, kt, ib) == (97, 64, 1, 6) and rec["w/i"].numpy().size == 73  # 97 x 6 bits
    tiles = x.reshape(97, 64).abs()
    idx = torch.topk(tiles, 64, dim=1).indices.sort(dim=1).values  # templar: all 64 kept
    codes, table = L.quantise_table(x.reshape(97, 64).gather(1, idx).reshape(-1), 2)
    old = _with(
        rec,
        **{
            "w/i": L.pack_bits(idx, ib).numpy(),
            "w/q": L.pack_bits(codes, 2).numpy(),
            "w/t": table.numpy(),
        },
    )
    with pytest.raises(
        ValueError, match=r"tensor 'w': part 'w/i' is uint8\(4656,\), expected uint8\(73,\)"
    ):
        decompress(old)
    for key, n in (("w/i", 74), ("w/q", 26)):  # one k_t more on one tile: one byte longer
        with pytest.raises(ValueError, match=f"part '{key}'"):
            decompress(_with(rec, **{key: np.zeros(n, np.uint8)}))
    two = L.pack_bits(torch.arange(2 * 97) % 64, ib).numpy()  # two per tile, truncated to fit
    bad = _with(rec, **{"w/i": two[:73]})  # right length, indices of another k_t
    with pytest.raises(ValueError, match="tensor 'w'"):
        decompress(bad)


def test_a_header_claiming_sparseloco_for_too_small_tiles_is_refused():
    rec = compress({"w": _x((97, 64), seed=4)}, "sparseloco")
    h = json.loads(bytes(rec[HEADER_KEY].numpy()).decode())
    h["tensors"]["w"]["shape"] = [97, 97]  # would be 1 x 1 tiles: the encoder sends it raw
    blob = np.frombuffer(json.dumps(h).encode(), np.uint8).copy()
    with pytest.raises(ValueError, match=r"tensor 'w': sparseloco: shape \(97, 97\) gets 1 x 1"):
        decompress(_with(rec, **{HEADER_KEY: blob}))
    with pytest.raises(ValueError, match=r"shape \(97, 97\)"):
        L.checked_indices(
            {p: torch.from_numpy(rec[f"w/{p}"].numpy()) for p in "iqt"},
            (97, 97),
            normalize_options("sparseloco"),
        )
