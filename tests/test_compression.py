"""Codecs, self-describing records, hostile records and error feedback (flwr_isoloco.compression)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from flwr_isoloco.compression import (
    HEADER_KEY,
    ErrorFeedback,
    compress,
    decompress,
    header,
    normalize_options,
    parse_request,
    payload_nbytes,
    request_config,
)
from flwr_isoloco.compression import codecs as C

B = 256


def pseudo_grads(seed: int = 0) -> dict[str, torch.Tensor]:
    """Delta-like tensors: heavy tails (Student t, 3 dof), rows of very different scale."""
    g = torch.Generator().manual_seed(seed)

    def heavy(*shape):
        z = torch.randn(*shape, generator=g)
        chi = torch.randn(*shape, 3, generator=g).pow(2).sum(-1).div(3).sqrt()
        return z / chi

    rows = torch.logspace(-5, -2, 96).reshape(96, 1)
    return {
        "embed.weight": heavy(96, 300) * rows,  # n not a multiple of B
        "mlp.weight": heavy(64, 64) * 3e-3,
        "conv.weight": heavy(8, 4, 3, 3) * 1e-2,
        "norm.weight": heavy(64) * 1e-3,
        "zeros": torch.zeros(4, 300),
    }


def block_amax(x: torch.Tensor, b: int = B) -> torch.Tensor:
    """Per-entry max |x| of its block."""
    flat = x.reshape(-1)
    nb = C.n_blocks(flat.numel(), b)
    amax = torch.nn.functional.pad(flat.abs(), (0, nb * b - flat.numel())).view(nb, b).amax(1)
    return amax.repeat_interleave(b)[: flat.numel()].reshape(x.shape)


def rel_fro(a, b):
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def test_int8_error_within_half_a_step_per_entry():
    x = pseudo_grads()
    dec = decompress(compress(x, "int8"))
    for k in ("embed.weight", "mlp.weight", "conv.weight"):
        err = (dec[k] - x[k]).abs()
        bound = block_amax(x[k]) / 254
        assert bool((err <= bound * (1 + 1e-6)).all()), k
        assert float(err.max()) > 0.3 * float(bound.max())  # the bound is not loose by 3x
        # Frobenius form of the bound: ||err|| <= ||bound||; < 2% on these heavy tails
        assert rel_fro(dec[k], x[k]) <= float(bound.norm() / x[k].norm())
        assert rel_fro(dec[k], x[k]) < 0.02
    assert torch.equal(dec["zeros"], x["zeros"])


def test_fp8_error_within_e4m3_half_ulp():
    x = pseudo_grads(1)
    dec = decompress(compress(x, "fp8"))
    for k in ("embed.weight", "mlp.weight", "conv.weight"):
        err = (dec[k] - x[k]).abs()
        bound = C.fp8_bound(x[k], block_amax(x[k]) / C.FP8_MAX)
        assert bool((err <= bound * (1 + 1e-6)).all()), k
        normal = x[k].abs() >= block_amax(x[k]) / C.FP8_MAX * 2.0**-6
        assert float((err[normal] / x[k].abs()[normal]).max()) > 2.0**-5  # 2^-4 bound is tight
        assert rel_fro(dec[k], x[k]) <= float(bound.norm() / x[k].norm()) <= 2.0**-4


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.5])
def test_topk_keeps_exactly_the_k_largest_magnitudes(fraction):
    x = pseudo_grads(2)
    dec = decompress(compress(x, "topk", fraction=fraction))
    for k in ("embed.weight", "mlp.weight", "conv.weight"):
        flat, got = x[k].reshape(-1), dec[k].reshape(-1)
        want_k = max(1, round(fraction * flat.numel()))
        kept = torch.nonzero(got).reshape(-1)
        assert kept.numel() == want_k
        top = torch.argsort(flat.abs(), descending=True)[:want_k]
        assert set(kept.tolist()) == set(top.tolist())
        assert torch.equal(got[kept], flat[kept])  # fp32 values travel exactly


def test_topk_int8_values_and_k_formula():
    x = {"w": torch.randn(10, 10, generator=torch.Generator().manual_seed(3))}
    assert C.topk_count(100, 0.001) == 1 and C.topk_count(1000, 0.0125) == 12
    rec = compress(x, "topk", fraction=0.2, values="int8", block_size=8)
    assert rec["w/q"].dtype == "int8" and tuple(rec["w/i"].shape) == (20,)
    dec = decompress(rec)["w"].reshape(-1)
    kept = torch.nonzero(dec).reshape(-1)
    err = (dec[kept] - x["w"].reshape(-1)[kept]).abs()
    assert float(err.max()) <= float(x["w"].abs().max()) / 254 * (1 + 1e-6)


def test_vectors_and_integers_travel_exactly_unless_asked():
    x = {"b": torch.randn(300), "count": torch.arange(5), "h": torch.randn(4, 4).half()}
    rec = compress(x, "int8")
    dec = decompress(rec)
    assert torch.equal(dec["b"], x["b"]) and rec["b/v"].dtype == "float32"
    assert torch.equal(dec["count"], x["count"]) and dec["count"].dtype == torch.int64
    assert dec["h"].dtype == torch.float16
    vec = decompress(compress(x, "int8", min_dims=1))
    assert not torch.equal(vec["b"], x["b"])
    assert float((vec["b"] - x["b"]).abs().max()) <= float(x["b"].abs().max()) / 254 * 1.00001


def test_bytes_on_the_wire_match_the_formulas():
    x = pseudo_grads()
    head = lambda r: r[HEADER_KEY].shape[0]  # noqa: E731
    for codec, opts in [
        ("none", {}),
        ("int8", {}),
        ("fp8", {}),
        ("topk", {"fraction": 0.01}),
        ("topk", {"fraction": 0.1, "values": "int8"}),
    ]:
        rec = compress(x, codec, **opts)
        o = normalize_options(codec, opts)
        want = head(rec)
        for k, t in x.items():
            enc = header(rec)["tensors"][k]["enc"]
            want += C.ideal_bytes(t.numel(), enc if enc != "raw" else "none", o)
        assert payload_nbytes(rec) == want, codec
    fp32 = sum(4 * t.numel() for t in x.values())
    assert payload_nbytes(compress(x, "int8")) < 0.27 * fp32


def test_record_is_self_describing_and_survives_a_copy():
    x = pseudo_grads()
    rec = copy.deepcopy(compress(x, "fp8", block_size=64))
    h = header(rec)
    assert h["codec"] == "fp8" and h["options"]["block_size"] == 64
    assert h["tensors"]["conv.weight"] == {"shape": [8, 4, 3, 3], "dtype": "float32", "enc": "fp8"}
    assert set(decompress(rec)) == set(x)


def test_bad_options_and_non_finite_input_are_refused():
    x = {"w": torch.randn(4, 4)}
    with pytest.raises(ValueError, match="unknown codec 'zip'"):
        compress(x, "zip")
    with pytest.raises(ValueError, match="block_size"):
        compress(x, "int8", block_size=0)
    with pytest.raises(ValueError, match="fraction"):
        compress(x, "topk", fraction=1.5)
    with pytest.raises(ValueError, match="takes options"):
        compress(x, "int8", fraction=0.1)
    with pytest.raises(ValueError, match="'w' has non-finite"):
        compress({"w": torch.tensor([[1.0, float("nan")]])}, "int8")


# ----------------------------------------------------------------------------- hostile records
def _base(codec="int8", **opts):
    x = {"w": torch.randn(6, 50, generator=torch.Generator().manual_seed(4))}
    return compress(x, codec, **opts)


def _with(rec: ArrayRecord, key: str, arr: np.ndarray | None) -> ArrayRecord:
    d = {k: rec[k] for k in rec.keys()}
    if arr is None:
        del d[key]
    else:
        d[key] = Array(arr)
    return ArrayRecord(d)


def _with_header(rec: ArrayRecord, mutate) -> ArrayRecord:
    h = json.loads(bytes(rec[HEADER_KEY].numpy()).decode())
    mutate(h)
    return _with(rec, HEADER_KEY, np.frombuffer(json.dumps(h).encode(), np.uint8).copy())


def _part(rec, key):
    return rec[key].numpy().copy()


def _set(arr, idx, v):
    arr[idx] = v
    return arr


def _lying_blob(truncate: bool = False) -> ArrayRecord:
    """Array metadata says int8(300,) but the npy blob's own header claims 1e12 entries (or
    carries too few bytes): must be refused before np.load would allocate."""
    import io

    rec = _base()
    good = rec["w/q"]
    buf = io.BytesIO()
    shape = (300,) if truncate else (10**12,)
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "|i1", "fortran_order": False, "shape": shape}
    )
    blob = buf.getvalue() + bytes(100)
    fake = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=blob)
    return ArrayRecord({**{k: rec[k] for k in rec.keys()}, "w/q": fake})


HOSTILE = {
    "unknown codec": (
        lambda: _with_header(_base(), lambda h: h.update(codec="zip")),
        "unknown codec",
    ),
    "huge shape": (
        lambda: _with_header(_base(), lambda h: h["tensors"]["w"].update(shape=[10**6, 10**6])),
        "1000000000000 entries",
    ),
    "negative dim": (
        lambda: _with_header(_base(), lambda h: h["tensors"]["w"].update(shape=[-1, 300])),
        "'w': bad shape",
    ),
    "bad enc": (
        lambda: _with_header(_base(), lambda h: h["tensors"]["w"].update(enc="fp8")),
        "'w': encoding",
    ),
    "bad dtype": (
        lambda: _with_header(_base(), lambda h: h["tensors"]["w"].update(dtype="object")),
        "'w': unsupported dtype",
    ),
    "bad options": (
        lambda: _with_header(_base(), lambda h: h["options"].update(block_size=0)),
        "block_size",
    ),
    "wrong q size": (lambda: _with(_base(), "w/q", np.zeros(299, np.int8)), "'w/q'"),
    "wrong q dtype": (lambda: _with(_base(), "w/q", np.zeros(300, np.int16)), "'w/q'"),
    "nan scale": (
        lambda: _with(r := _base(), "w/s", _set(_part(r, "w/s"), 0, np.nan)),
        "'w': has 1 non-finite scales",
    ),
    "inf scale": (
        lambda: _with(r := _base(), "w/s", _set(_part(r, "w/s"), 1, np.inf)),
        "'w': has 1 non-finite",
    ),
    "negative scale": (
        lambda: _with(r := _base(), "w/s", _set(_part(r, "w/s"), 0, -1.0)),
        "'w': has negative",
    ),
    "overflowing scale": (
        lambda: _with(r := _base(), "w/s", _set(_part(r, "w/s"), 0, 3e38)),
        "'w': has scales above",
    ),
    "fp8 nan code": (
        lambda: _with(r := _base("fp8"), "w/q", _set(_part(r, "w/q"), 5, 0x7F)),
        "'w': has 1 fp8 NaN",
    ),
    "index out of range": (
        lambda: _with(r := _base("topk", fraction=0.1), "w/i", _set(_part(r, "w/i"), -1, 300)),
        "'w': has indices outside",
    ),
    "negative index": (
        lambda: _with(r := _base("topk", fraction=0.1), "w/i", _set(_part(r, "w/i"), 0, -5)),
        "'w': has indices outside",
    ),
    "duplicate index": (
        lambda: _with(
            r := _base("topk", fraction=0.1), "w/i", _set(_part(r, "w/i"), 1, _part(r, "w/i")[0])
        ),
        "'w': has indices that are not strictly increasing",
    ),
    "wrong k": (
        lambda: _with(_base("topk", fraction=0.1), "w/i", np.arange(29, dtype=np.int32)),
        "'w/i'",
    ),
    "missing part": (lambda: _with(_base(), "w/s", None), "missing ['w/s']"),
    "extra part": (lambda: _with(_base(), "x/v", np.zeros(3, np.float32)), "extra ['x/v']"),
    "npy blob claims a huge shape": (lambda: _lying_blob(), "'w/q' holds int8(1000000000000,)"),
    "npy blob truncated": (lambda: _lying_blob(truncate=True), "'w/q' has 100 data bytes"),
    "header not json": (
        lambda: _with(_base(), HEADER_KEY, np.frombuffer(b"{nope", np.uint8).copy()),
        "not UTF-8 JSON",
    ),
    "nested json": (
        lambda: _with(
            _base(), HEADER_KEY, np.frombuffer(b"[" * 100_000 + b"]" * 100_000, np.uint8).copy()
        ),
        HEADER_KEY,
    ),
    "header not uint8": (lambda: _with(_base(), HEADER_KEY, np.zeros(4, np.float32)), "1-D uint8"),
    "header wrong format": (
        lambda: _with_header(_base(), lambda h: h.update(format="x")),
        "not a flwr-isoloco",
    ),
    "tensors not object": (
        lambda: _with_header(_base(), lambda h: h.update(tensors=[1])),
        "'tensors'",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_record_raises_value_error_naming_the_key(name):
    build, needle = HOSTILE[name]
    rec = build()
    with pytest.raises(ValueError) as info:
        decompress(rec)
    assert needle in str(info.value)


def test_shapes_from_the_model_are_enforced_before_decoding():
    rec = _base()
    assert decompress(rec, shapes={"w": (6, 50)})["w"].shape == (6, 50)
    with pytest.raises(ValueError, match=r"'w': shape \(6, 50\), expected \(50, 6\)"):
        decompress(rec, shapes={"w": (50, 6)})
    with pytest.raises(ValueError, match=r"missing \['v'\]"):
        decompress(rec, shapes={"w": (6, 50), "v": (3,)})
    with pytest.raises(ValueError, match="entries > max 100"):
        decompress(rec, max_entries=100)


# ----------------------------------------------------------------------------- error feedback
def _deltas(t: int, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"w": torch.randn(40, 64, generator=g) * 1e-3, "b": torch.randn(64, generator=g) * 1e-3}
        for _ in range(t)
    ]


@pytest.mark.parametrize("codec,opts", [("int8", {}), ("fp8", {}), ("topk", {"fraction": 0.01})])
def test_error_feedback_sum_of_uploads_is_sum_of_deltas_minus_final_residual(codec, opts):
    T = 8
    ef = ErrorFeedback(codec, **opts)
    deltas, sent = _deltas(T), []
    for d in deltas:
        sent.append(decompress(ef.compress(d)))
        res_norm = float(ef.residual["w"].norm())
    total_true = sum(d["w"] for d in deltas)
    total_sent = sum(s["w"] for s in sent)
    gap = total_true - total_sent
    assert torch.allclose(gap, ef.residual["w"], atol=1e-8, rtol=1e-4)
    assert float(gap.norm()) <= res_norm * (1 + 1e-4) + 1e-9  # no more than one round's residual
    assert torch.equal(sum(s["b"] for s in sent), sum(d["b"] for d in deltas))  # 1-D: exact
    assert "b" not in ef.residual


def test_error_feedback_recovers_a_persistent_direction_that_topk_alone_loses():
    g = torch.Generator().manual_seed(7)
    base = torch.randn(40, 64, generator=g) * 1e-3
    ef, with_ef, without, total = ErrorFeedback("topk", fraction=0.1), 0, 0, 0
    for _ in range(30):
        d = {"w": base + 0.5e-3 * torch.randn(40, 64, generator=g)}
        with_ef = with_ef + decompress(ef.compress(d))["w"]
        without = without + decompress(compress(d, "topk", fraction=0.1))["w"]
        total = total + d["w"]
    assert rel_fro(with_ef, total) < 0.2  # measured 0.13
    assert rel_fro(without, total) > 0.6  # measured 0.66: the small entries never travel


def test_error_feedback_state_round_trip_gives_the_same_next_upload():
    deltas = _deltas(3, seed=6)
    a = ErrorFeedback("topk", fraction=0.05)
    a.compress(deltas[0])
    b = ErrorFeedback("topk", fraction=0.05)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    ra, rb = a.compress(deltas[1]), b.compress(deltas[1])
    assert all(np.array_equal(ra[k].numpy(), rb[k].numpy()) for k in ra.keys())
    with pytest.raises(ValueError, match="residual 'w' has non-finite"):
        b.load_state_dict({"residual": {"w": torch.full((2,), float("inf"))}})
    with pytest.raises(ValueError, match="residual of 'w' has shape"):
        b.compress({"w": torch.zeros(3, 3)})


def test_request_config_round_trip_and_bad_requests():
    cfg = request_config("topk", {"fraction": 0.1, "values": "int8"}, error_feedback=False)
    assert cfg["upload-codec"] == "topk" and cfg["codec-fraction"] == 0.1
    assert parse_request(cfg) == (
        "topk",
        normalize_options("topk", {"fraction": 0.1, "values": "int8"}),
        False,
    )
    assert request_config(None) == {} and request_config("none") == {}
    assert parse_request({}) is None and parse_request({"upload-codec": "none"}) is None
    with pytest.raises(ValueError, match="'upload-codec'='zip'"):
        parse_request({"upload-codec": "zip"})
    with pytest.raises(ValueError, match="block_size"):
        parse_request({"upload-codec": "int8", "codec-block-size": -3})
    with pytest.raises(ValueError, match="upload-error-feedback"):
        parse_request({"upload-codec": "int8", "upload-error-feedback": 1})
