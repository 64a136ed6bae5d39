"""The low-bit codecs (``sparseloco``, ``int4``; flwr_isoloco/compression/lowbit.py): exactness
against an independent numpy decode, bytes on the wire, hostile records, error feedback with
decay and its train-config keys."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, RecordDict

from flwr_isoloco.clients.worker_reply import RESIDUAL_STATE_KEY, compressed_delta
from flwr_isoloco.compression import (
    CODECS,
    EF_DECAY_KEY,
    HEADER_KEY,
    ErrorFeedback,
    compress,
    decompress,
    normalize_options,
    parse_request,
    payload_nbytes,
    request_config,
)
from flwr_isoloco.compression import lowbit as L


def heavy(*shape, seed=0, scale=1e-3):
    """Delta-like entries: Student t (3 dof), so the top-k of a tile matters."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*shape, generator=g)
    chi = torch.randn(*shape, 3, generator=g).pow(2).sum(-1).div(3).sqrt()
    return z / chi * scale


def np_bits(buf: np.ndarray, width: int, m: int) -> np.ndarray:
    """Independent LSB-first unpacking: np.unpackbits(little) then weights 2^b."""
    bits = np.unpackbits(buf, bitorder="little")[: m * width].reshape(m, width)
    return bits.astype(np.int64) @ (1 << np.arange(width, dtype=np.int64))


def test_pack_bits_round_trips_every_width_and_matches_templars_12_bit_pairs():
    g = torch.Generator().manual_seed(1)
    for w in range(1, 21):
        v = torch.randint(0, 1 << w, (37,), generator=g)
        buf = L.pack_bits(v, w)
        assert buf.dtype == torch.uint8 and buf.numel() == math.ceil(37 * w / 8)
        assert torch.equal(L.unpack_bits(buf, w, 37), v)
        assert np.array_equal(np_bits(buf.numpy(), w, 37), v.numpy())
        assert L.padding_clear(buf, 37, w)
    idx = torch.randint(0, 4096, (10,), generator=g)
    p, a, b = L.pack_bits(idx, 12), idx[0::2], idx[1::2]  # two indices in 3 bytes
    assert torch.equal(p[0::3].long(), a & 0xFF)
    assert torch.equal(p[1::3].long(), ((a >> 8) & 0xF) | ((b & 0xF) << 4))
    assert torch.equal(p[2::3].long(), (b >> 4) & 0xFF)


@pytest.mark.parametrize(
    "shape,tiling,keep",  # keep: k_t = k T / chunk rounded half up (templar: min(k, T))
    [
        ((576, 576), (576, 576, 64, 64), 64),
        ((96, 300), (96, 300, 48, 60), 45),  # largest divisors <= 64, no padding (templar)
        ((67, 64), (67, 64, 1, 64), 1),  # 67 is prime: 1 x 64 tiles (templar keeps all)
        ((8, 4, 3, 3), (8, 36, 8, 36), 5),  # >= 3-D: (R, prod(rest)); 4.5 rounds up
        ((128,), (1, 128, 1, 64), 1),  # 1-D: chunks of 64 (templar)
    ],
)
def test_sparseloco_tiling_follows_the_reference(shape, tiling, keep):
    assert L.tiling(shape, 4096) == tiling
    nt, t, kt, ib = L.sparse_geometry(shape, 4096, 64)
    assert nt * t == math.prod(shape) and kt == keep and 2 ** (ib - 1) < t <= 2**ib


def _np_decode(rec: ArrayRecord, shape, o) -> np.ndarray:
    """Independent decode: numpy bit unpacking, explicit tile loops."""
    rows, cols = shape[0], math.prod(shape) // shape[0]
    h = max(d for d in range(1, 65) if rows % d == 0)
    w = max(d for d in range(1, 65) if cols % d == 0)
    kt = math.floor(o["k"] * h * w / o["chunk"] + 0.5)  # k scaled to the tile, half up
    ib = max(1, math.ceil(math.log2(h * w)))
    m = (rows // h) * (cols // w) * kt
    idx = np_bits(rec["w/i"].numpy(), ib, m).reshape(-1, kt)
    vals = rec["w/t"].numpy()[np_bits(rec["w/q"].numpy(), o["bits"], m)].reshape(-1, kt)
    out = np.zeros((rows, cols), np.float32)
    for tile in range(idx.shape[0]):
        tr, tc = divmod(tile, cols // w)
        for j, v in zip(idx[tile], vals[tile], strict=True):
            out[tr * h + j // w, tc * w + j % w] = v
    return out


@pytest.mark.parametrize("bits,k", [(2, 16), (4, 7)])
def test_sparseloco_keeps_each_tiles_topk_and_decodes_through_the_bin_means(bits, k):
    x = heavy(96, 120, seed=2)  # tiles 48 x 60 = 2,880 entries, 4 tiles
    o = normalize_options("sparseloco", {"k": k, "bits": bits})
    rec = compress({"w": x}, "sparseloco", k=k, bits=bits)
    dec = decompress(rec)["w"]
    assert np.array_equal(_np_decode(rec, (96, 120), o), dec.numpy())  # independent decode
    table = rec["w/t"].numpy()
    kept = dec != 0
    tiles = x.reshape(2, 48, 2, 60).permute(0, 2, 1, 3).reshape(4, -1).abs()
    ktiles = kept.reshape(2, 48, 2, 60).permute(0, 2, 1, 3).reshape(4, -1)
    assert (ktiles.sum(1) == {16: 11, 7: 5}[k]).all()  # k x 2,880 / 4,096 rounded
    for t, kk in zip(tiles, ktiles, strict=True):  # the kept entries are the tile's k largest |x|
        assert float(t[kk].min()) >= float(t[~kk].max())
    v = x[kept].double().numpy()  # independent binning (numpy, fp64), templar's rule
    levels = 1 << bits
    s = 6 * np.std(v, ddof=1) / levels
    codes = np.clip(np.rint((v - v.mean()) / s + levels // 2), 0, levels - 1).astype(int)
    means = [v[codes == c].mean() for c in range(levels) if (codes == c).any()]
    used = [c for c in range(levels) if (codes == c).any()]
    assert np.allclose(table[used], means, rtol=1e-6, atol=0)
    assert np.array_equal(dec[kept].numpy(), table[codes])  # decoded = table[code], exactly


def _parts_bytes(rec: ArrayRecord) -> int:
    """Payload bytes without the JSON header."""
    return payload_nbytes(rec) - payload_nbytes(ArrayRecord({HEADER_KEY: rec[HEADER_KEY]}))


def test_sparseloco_bytes_of_a_576x576_tensor_are_146x_below_fp32():
    x = {"w": torch.randn(576, 576, generator=torch.Generator().manual_seed(3))}
    rec = compress(x, "sparseloco")
    parts = _parts_bytes(rec)
    # 81 tiles x (64 x 12 bits + 64 x 2 bits) = 81 x 112 bytes, + a 4-entry fp32 table
    assert parts == 81 * 112 + 16 == L.sparseloco_bytes((576, 576), normalize_options("sparseloco"))
    fp32 = 576 * 576 * 4
    assert round(fp32 / parts, 2) == 146.03
    assert fp32 / payload_nbytes(rec) > 140  # with the ~200-byte JSON header: 142.9
    k128 = compress(x, "sparseloco", k=128)
    assert _parts_bytes(k128) - parts == 81 * 112  # twice the kept entries: 73.1x
    b4 = compress(x, "sparseloco", bits=4)
    assert _parts_bytes(b4) - parts == 81 * 16 + 12 * 4  # codes x2, table of 16: 127.2x


def test_int4_error_within_half_a_step_and_two_codes_per_byte():
    x = heavy(97, 129, seed=4)  # n odd, not a multiple of the block
    rec = compress({"w": x, "z": torch.zeros(3, 5)}, "int4")
    n, b = x.numel(), 256
    assert rec["w/q"].shape == ((n + 1) // 2,) and rec["w/s"].shape == (math.ceil(n / b),)
    dec = decompress(rec)
    flat = x.reshape(-1)
    amax = torch.nn.functional.pad(flat.abs(), (0, math.ceil(n / b) * b - n)).view(-1, b).amax(1)
    step = (amax / 7).repeat_interleave(b)[:n]
    err = (dec["w"].reshape(-1) - flat).abs()
    assert bool((err <= step / 2 * (1 + 1e-6)).all())
    assert torch.equal(dec["z"], torch.zeros(3, 5))
    parts = _parts_bytes(compress({"w": torch.ones(576, 576)}, "int4"))
    assert parts == 576 * 576 // 2 + 4 * 1296  # n/2 + 4 ceil(n/256): 7.76x below fp32
    assert round(576 * 576 * 4 / parts, 2) == 7.76


def test_codecs_registered_and_options_checked():
    assert {"int4", "sparseloco"} <= set(CODECS)
    assert normalize_options("sparseloco") == {
        "chunk": 4096,
        "k": 64,
        "bits": 2,
        "min_dims": 2,
        "ef_decay": 0.95,
    }
    assert normalize_options("int4")["ef_decay"] == 1.0 == normalize_options("int8")["ef_decay"]
    for bad, needle in [
        ({"chunk": 4000}, "square"),
        ({"chunk": 2}, "'chunk'"),
        ({"k": 5000}, "'k'"),
        ({"k": 0}, "'k'"),
        ({"bits": 3}, "'bits'"),
        ({"bits": True}, "'bits'"),
        ({"ef_decay": 1.5}, "ef_decay"),
        ({"ef_decay": True}, "ef_decay"),
        ({"fraction": 0.1}, "takes options"),
    ]:
        with pytest.raises(ValueError, match=needle):
            normalize_options("sparseloco", bad)
    with pytest.raises(ValueError, match="takes options"):
        normalize_options("none", {"ef_decay": 0.9})


# ----------------------------------------------------------------------------- hostile records
SL = {"k": 21}  # (144, 60): 3 tiles of 48 x 60 = 2,880 entries, k_t = round(21 x 2,880 /
# 4,096) = 15 each; 45 indices (4 padding bits)


def _sl() -> ArrayRecord:
    return compress({"w": heavy(144, 60, seed=5)}, "sparseloco", **SL)


def _i4() -> ArrayRecord:
    return compress({"w": heavy(7, 9, seed=6)}, "int4")  # 63 nibbles: one padding nibble


def _with(rec: ArrayRecord, key: str, arr: np.ndarray) -> ArrayRecord:
    return ArrayRecord({**{k: rec[k] for k in rec.keys()}, key: Array(arr)})


def _header(rec: ArrayRecord, mutate) -> ArrayRecord:
    h = json.loads(bytes(rec[HEADER_KEY].numpy()).decode())
    mutate(h)
    return _with(rec, HEADER_KEY, np.frombuffer(json.dumps(h).encode(), np.uint8).copy())


def _indices(rec: ArrayRecord, edit) -> ArrayRecord:
    idx = L.unpack_bits(torch.from_numpy(rec["w/i"].numpy()), 12, 45).view(3, 15)
    edit(idx)
    return _with(rec, "w/i", L.pack_bits(idx, 12).numpy())


def _edit(rec: ArrayRecord, key: str, edit) -> ArrayRecord:
    arr = rec[key].numpy().copy()
    edit(arr)
    return _with(rec, key, arr)


def _swap(i):
    i[0, 0], i[0, 1] = i[0, 1].clone(), i[0, 0].clone()


def _nibble0(a):
    a[0] &= 0xF0


HOSTILE = {
    "truncated indices": (lambda: _with(r := _sl(), "w/i", r["w/i"].numpy()[:-1]), "'w/i'"),
    "truncated codes": (lambda: _with(r := _sl(), "w/q", r["w/q"].numpy()[:-1]), "'w/q'"),
    "oversized codes": (lambda: _with(_sl(), "w/q", np.zeros(13, np.uint8)), "'w/q'"),
    "table too short": (lambda: _with(_sl(), "w/t", np.zeros(3, np.float32)), "'w/t'"),
    "table float64": (lambda: _with(_sl(), "w/t", np.zeros(4, np.float64)), "'w/t'"),
    "indices int32": (lambda: _with(_sl(), "w/i", np.zeros(68, np.int32)), "'w/i'"),
    "nan in table": (lambda: _edit(_sl(), "w/t", lambda a: a.__setitem__(1, np.nan)), "non-finite"),
    "inf in table": (
        lambda: _edit(_sl(), "w/t", lambda a: a.__setitem__(0, -np.inf)),
        "non-finite",
    ),
    "index out of range": (
        lambda: _indices(_sl(), lambda i: i[1].__setitem__(-1, 4000)),
        "indices >= the tile size 2880",
    ),
    "duplicate index": (
        lambda: _indices(_sl(), lambda i: i[2].__setitem__(1, int(i[2, 0]))),
        "not strictly increasing",
    ),
    "unsorted indices": (lambda: _indices(_sl(), _swap), "not strictly increasing"),
    "index padding bits": (
        lambda: _edit(_sl(), "w/i", lambda a: a.__setitem__(-1, a[-1] | 0x80)),
        "padding bits",
    ),
    "code padding bits": (
        lambda: _edit(_sl(), "w/q", lambda a: a.__setitem__(-1, a[-1] | 0x80)),
        "padding bits",
    ),
    "header k above chunk": (lambda: _header(_sl(), lambda h: h["options"].update(k=5000)), "'k'"),
    "header bits 3": (lambda: _header(_sl(), lambda h: h["options"].update(bits=3)), "'bits'"),
    "header chunk not square": (
        lambda: _header(_sl(), lambda h: h["options"].update(chunk=4000)),
        "'chunk'",
    ),
    "header claims more rows": (
        lambda: _header(_sl(), lambda h: h["tensors"]["w"].update(shape=[288, 60])),
        "'w/i'",
    ),
    "header claims other tiles": (  # same n, other geometry: the lengths disagree
        lambda: _header(_sl(), lambda h: h["tensors"]["w"].update(shape=[72, 120])),
        "'w/",
    ),
    "header claims huge shape": (
        lambda: _header(_sl(), lambda h: h["tensors"]["w"].update(shape=[1 << 20, 1 << 20])),
        "entries > max",
    ),
    "int4 code -8": (lambda: _edit(_i4(), "w/q", _nibble0), "codes of -8"),
    "int4 padding nibble": (
        lambda: _edit(_i4(), "w/q", lambda a: a.__setitem__(-1, a[-1] | 0x30)),
        "padding nibble",
    ),
    "int4 truncated": (lambda: _with(r := _i4(), "w/q", r["w/q"].numpy()[:-1]), "'w/q'"),
    "int4 int8 codes": (lambda: _with(_i4(), "w/q", np.zeros(32, np.int8)), "'w/q'"),
    "int4 nan scale": (
        lambda: _edit(_i4(), "w/s", lambda a: a.__setitem__(0, np.nan)),
        "non-finite scales",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_low_bit_record_raises_value_error_naming_the_tensor(name):
    build, needle = HOSTILE[name]
    rec = build()
    with pytest.raises(ValueError) as info:
        decompress(rec)
    assert needle in str(info.value)
    assert "'w" in str(info.value) or HEADER_KEY in str(info.value) or "entries" in str(info.value)


def test_hostile_cases_start_from_records_that_decode():
    assert decompress(_sl())["w"].count_nonzero() == 45
    assert decompress(_i4())["w"].shape == (7, 9)


# ----------------------------------------------------------------------------- error feedback
def test_error_feedback_decay_follows_e_beta_e_plus_delta():
    d1, d2 = {"w": heavy(64, 128, seed=7)}, {"w": heavy(64, 128, seed=8)}
    ef = ErrorFeedback("sparseloco", k=8)
    assert ef.decay == 0.95
    e1 = d1["w"] - decompress(ef.compress(d1))["w"]
    assert torch.equal(ef.residual["w"], e1)
    r2 = ef.compress(d2)
    c2 = d2["w"] + 0.95 * e1
    direct = compress({"w": c2}, "sparseloco", k=8)
    assert all(np.array_equal(r2[k].numpy(), direct[k].numpy()) for k in r2.keys())
    assert torch.equal(ef.residual["w"], c2 - decompress(r2)["w"])
    assert "ef_decay" not in bytes(r2[HEADER_KEY].numpy()).decode()  # not on the wire
    zero = ErrorFeedback("int8", ef_decay=0.0)  # beta = 0: the residual is forgotten
    zero.compress(d1)
    r = zero.compress(d2)
    assert all(np.array_equal(r[k].numpy(), compress(d2, "int8")[k].numpy()) for k in r.keys())


def test_error_feedback_decay_bounds_a_never_sent_residual():
    """An entry that never wins its tile accumulates ``sum_t beta^t delta = delta / (1 - beta)``
    at most, instead of ``T delta`` without decay."""
    big = torch.zeros(8, 8)
    big[0, :4] = 1.0  # 4 entries always win (k = 4); the rest carry a constant 1e-3
    delta = {"w": big + 1e-3 * (big == 0)}
    for beta, bound in [(0.5, 2e-3), (1.0, 30e-3)]:
        ef = ErrorFeedback("sparseloco", chunk=64, k=4, ef_decay=beta)  # one full tile
        for _ in range(30):
            ef.compress(delta)
        e = ef.residual["w"][1:]
        assert torch.allclose(e, torch.full_like(e, bound), rtol=1e-3, atol=0)


def test_train_config_carries_the_new_options_and_the_decay():
    cfg = request_config("sparseloco", {"k": 32, "ef_decay": 0.9})
    assert cfg["codec-k"] == 32 and cfg["codec-chunk"] == 4096 and cfg["codec-bits"] == 2
    assert cfg[EF_DECAY_KEY] == 0.9
    assert parse_request(cfg) == (
        "sparseloco",
        normalize_options("sparseloco", {"k": 32, "ef_decay": 0.9}),
        True,
    )
    assert request_config("int8")[EF_DECAY_KEY] == 1.0
    assert parse_request({"upload-codec": "int4"})[1]["block_size"] == 256
    with pytest.raises(ValueError, match="'bits'"):
        parse_request({"upload-codec": "sparseloco", "codec-bits": 3})
    with pytest.raises(ValueError, match="ef_decay"):
        parse_request({"upload-codec": "sparseloco", EF_DECAY_KEY: 2.0})


def test_diloco_worker_reply_applies_the_decay_from_its_train_config():
    request = parse_request(request_config("sparseloco", {"k": 4, "ef_decay": 0.5}))
    state, d = RecordDict(), {"w": heavy(32, 32, seed=9), "b": torch.ones(32)}
    compressed_delta(d, request, state)
    e1 = state[RESIDUAL_STATE_KEY].to_torch_state_dict()["w"]
    rec = compressed_delta(d, request, state)
    direct = compress({"w": d["w"] + 0.5 * e1, "b": d["b"]}, "sparseloco", k=4)
    assert all(np.array_equal(rec[k].numpy(), direct[k].numpy()) for k in rec.keys())
    assert torch.equal(decompress(rec)["b"], d["b"])  # 1-D travels raw (min_dims 2)
