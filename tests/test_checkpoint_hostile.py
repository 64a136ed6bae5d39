"""Hostile checkpoint files (issue 8, B4, B6-B9): every bad input is a CheckpointError naming
the file and the field or tensor; interrupted writes' temp files are cleaned up."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import struct
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord

from flwr_isoloco.checkpoint import (
    CheckpointError,
    Field,
    load_checkpoint,
    save_checkpoint,
    set_rng_state,
    tree_to_recorddict,
    write_bytes_atomic,
)
from flwr_isoloco.checkpoint.store import _header as digest_header  # to forge "valid" files
from flwr_isoloco.runconfig import RunConfigError, check_resumable
from flwr_isoloco.strategies import DiLoCo

SPEC = {
    "round": Field("int", min=0),
    "config": Field("dict"),
    "totals": Field("dict", fields={"bytes-p2p": Field("int", min=0)}),
    "cursors": Field("dict", keys=r"[0-9]{1,9}", values=Field("int", min=0)),
}
META = {"app": "isoloco_lm", "round": 3, "config": {}, "totals": {"bytes-p2p": 5}, "cursors": {}}


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}}


def _forge(path: Path, flat: dict, meta_json: str, empty_json: str = "[]", **header) -> Path:
    """A file with correct digests for whatever ``flat``/``meta_json`` hold (a careful forger
    or a bug in a writer), with header entries overridden or removed (value None)."""
    from safetensors.torch import save_file

    head = digest_header(flat, meta_json, empty_json)
    for k, v in header.items():
        if v is None:
            head.pop(k, None)
        else:
            head[k] = v
    save_file(flat, str(path), metadata=head)
    return path


def _flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def _data_offset(path: Path, key: str) -> int:
    """Byte offset in the file of tensor ``key``'s first data byte (safetensors layout)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n + json.loads(raw[8 : 8 + n])[key]["data_offsets"][0]


# ----------------------------------------------------------------------------- B4 digests
def test_one_flipped_bit_in_a_tensor_is_refused_naming_it(tmp_path):
    p = save_checkpoint(tmp_path / "ck.safetensors", _tensors(), META)
    load_checkpoint(p)  # intact: fine
    _flip_bit(p, _data_offset(p, "model/w") + 5, bit=3)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p)
    assert str(p) in str(e.value)
    assert "tensor 'model/w' does not match its sha256 digest" in str(e.value)


def test_one_flipped_bit_in_the_meta_is_refused(tmp_path):
    p = save_checkpoint(tmp_path / "ck.safetensors", _tensors(), META)
    raw = p.read_bytes()
    at = raw.index(b'\\"round\\": 3')  # the meta JSON string inside the header JSON
    _flip_bit(p, at + len(b'\\"round\\": '), bit=0)  # '3' -> '2': still valid JSON
    with pytest.raises(CheckpointError, match=r"'meta' does not match its sha256 digest") as e:
        load_checkpoint(p)
    assert str(p) in str(e.value)


def test_tampered_digest_and_old_format_are_refused(tmp_path):
    flat = {"model/w": torch.zeros(2)}
    p = _forge(tmp_path / "a.safetensors", flat, json.dumps(META), digest="{oops")
    with pytest.raises(CheckpointError, match=r"'digest' is not valid JSON"):
        load_checkpoint(p)
    p = _forge(tmp_path / "b.safetensors", flat, json.dumps(META), digest=None)
    with pytest.raises(CheckpointError, match=r"header field 'digest' is missing"):
        load_checkpoint(p)
    p = _forge(
        tmp_path / "c.safetensors", flat, json.dumps(META), format="flwr-isoloco-checkpoint/1"
    )
    with pytest.raises(CheckpointError, match=r"predates checksums.*not supported") as e:
        load_checkpoint(p)
    assert str(p) in str(e.value)


def test_nan_or_inf_tensor_is_refused_naming_it(tmp_path):
    t = _tensors()
    t["model"]["b"][1] = float("nan")
    p = save_checkpoint(tmp_path / "nan.safetensors", t, META)
    with pytest.raises(CheckpointError, match=r"tensor 'model/b' has non-finite values") as e:
        load_checkpoint(p)
    assert str(p) in str(e.value)
    t["model"]["b"][1] = float("inf")
    save_checkpoint(p, t, META)
    with pytest.raises(CheckpointError, match=r"'model/b' has non-finite"):
        load_checkpoint(p)


# ----------------------------------------------------------------------------- B6-B8 headers
@pytest.mark.parametrize(
    "meta_json, pattern",
    [
        (None, r"header field 'meta' is missing"),
        ("{not json", r"header field 'meta' is not valid JSON"),
        ("[1, 2]", r"header field 'meta' must be a JSON object"),
        (json.dumps({**META, "round": -3}), r"field 'round' must be an int >= 0, got -3"),
        (json.dumps({**META, "round": "abc"}), r"field 'round' must be an int >= 0, got 'abc'"),
        (json.dumps({**META, "round": True}), r"field 'round' must be an int"),
        (json.dumps({**META, "round": 2.5}), r"field 'round' must be an int"),
        (json.dumps({k: v for k, v in META.items() if k != "totals"}), r"'totals' is missing"),
        (json.dumps({**META, "totals": {}}), r"field 'totals.bytes-p2p' is missing"),
        (json.dumps({**META, "totals": {"bytes-p2p": "x"}}), r"'totals.bytes-p2p' must be an"),
        (json.dumps({**META, "config": [1]}), r"field 'config' must be a JSON object"),
        (json.dumps({**META, "cursors": {"abc": 1}}), r"field 'cursors' has a bad key 'abc'"),
        (json.dumps({**META, "cursors": {"1": -1}}), r"field 'cursors.1' must be an int >= 0"),
        (json.dumps({**META, "app": "rwlora_sentiment"}), r"field 'app' is 'rwlora_sentiment'"),
        (json.dumps({**META, "app": "node-state"}), r"'app' is 'node-state' \(one node's state"),
        (json.dumps({k: v for k, v in META.items() if k != "app"}), r"field 'app' is None"),
    ],
)
def test_bad_header_is_a_checkpoint_error_naming_the_field(tmp_path, meta_json, pattern):
    p = tmp_path / "ck.safetensors"
    flat = {"model/w": torch.zeros(2)}
    if meta_json is None:
        _forge(p, flat, "{}", meta=None)
    else:
        _forge(p, flat, meta_json)
    with pytest.raises(CheckpointError, match=pattern) as e:
        load_checkpoint(p, kind="isoloco_lm", spec=SPEC)
    assert str(e.value).startswith(f"checkpoint {str(p)!r}")


@pytest.mark.parametrize(
    "flat, empty, pattern",
    [
        ({"a": torch.zeros(1), "a/b": torch.zeros(1)}, [], r"'a/b' clashes with tensor 'a'"),
        ({"a/b": torch.zeros(1), "a": torch.zeros(1)}, [], r"clashes"),
        ({"a": torch.zeros(1)}, ["a"], r"clashes"),
        ({"a//b": torch.zeros(1)}, [], r"'a//b' has an empty level"),
        ({"x": torch.zeros(1)}, "[1]", r"'empty' must be a list of strings"),
    ],
)
def test_key_clash_is_a_checkpoint_error(tmp_path, flat, empty, pattern):
    p = _forge(
        tmp_path / "ck.safetensors",
        flat,
        json.dumps(META),
        empty if isinstance(empty, str) else json.dumps(empty),
    )
    with pytest.raises(CheckpointError, match=pattern) as e:
        load_checkpoint(p)
    assert str(p) in str(e.value)


def test_malformed_rng_and_records_name_the_field():
    with pytest.raises(CheckpointError, match=r"field 'rng.python' must have 3 items"):
        set_rng_state({"python": [1], "numpy": [0] * 5, "torch": [0]})
    with pytest.raises(CheckpointError, match=r"field 'rng.torch' is not a valid state"):
        good = {"python": [3, [0] * 625, None], "numpy": ["MT19937", [0] * 624, 0, 0, 0.0]}
        set_rng_state({**good, "torch": [0, 1, 2]})
    with pytest.raises(CheckpointError, match=r"field 'rng' must be a JSON object"):
        set_rng_state([])
    with pytest.raises(CheckpointError, match=r"field 'records.c.kind' must be one of"):
        tree_to_recorddict({}, {"c": {"kind": "pickle", "values": {}}})
    with pytest.raises(CheckpointError, match=r"field 'records.c.values' is missing"):
        tree_to_recorddict({}, {"c": {"kind": "config"}})


def test_check_resumable_refuses_a_malformed_or_incomplete_saved_config():
    with pytest.raises(RunConfigError, match=r"checkpoint's config \(f\) is not a dict"):
        check_resumable([1], {"a": 1}, source="f")
    with pytest.raises(RunConfigError, match=r"'b' = 2 is not in the checkpoint's config"):
        check_resumable({"a": 1}, {"a": 1, "b": 2})
    with pytest.raises(RunConfigError, match=r"has key 'z' = 0, which this run does not know"):
        check_resumable({"a": 1, "z": 0}, {"a": 1})
    with pytest.raises(RunConfigError, match=r"'a' = 1 differs from the checkpoint's True"):
        check_resumable({"a": True}, {"a": 1})
    with pytest.raises(RunConfigError, match=r"malformed"):
        check_resumable({"a.b": 1}, {})
    check_resumable({"a": {"b": 1}, "o": "x"}, {"a": {"b": 1}, "o": "y"}, may_differ={"o"})


# ----------------------------------------------------------------------------- B4/B7/B8 DiLoCo
def _diloco(**kw):
    kw.setdefault("min_train_nodes", 1)
    kw.setdefault("min_available_nodes", 1)
    kw.setdefault("min_evaluate_nodes", 0)
    kw.setdefault("fraction_evaluate", 0.0)
    return DiLoCo(**kw)


def _model():
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g)}


def _diloco_state(**kw):
    """State of a strategy that took one outer step (so momentum buffers exist)."""
    s = _diloco(**kw)
    s._adopt(ArrayRecord(_model()))
    s.theta = s.outer.step(s.theta, {k: torch.ones_like(v) for k, v in s.theta.items()})
    s.server_round = 1
    sd = s.state_dict()
    assert set(sd["tensors"]["outer"]["momentum_buffer"]) == {"w", "b"}
    return sd


def test_diloco_refuses_saved_outer_hyper_parameters_that_differ():
    sd = _diloco_state(outer_lr=0.7)
    _diloco(outer_lr=0.7).load_state_dict(sd, reference=_model())  # same: fine
    with pytest.raises(CheckpointError, match=r"'outer.lr' = 0.7 differs from this strategy's 0.5"):
        _diloco(outer_lr=0.5).load_state_dict(sd)
    with pytest.raises(CheckpointError, match=r"'outer.momentum' = 0.9 differs"):
        _diloco(outer_momentum=0.5).load_state_dict(sd)
    with pytest.raises(CheckpointError, match=r"'outer.nesterov' = True differs"):
        _diloco(nesterov=False).load_state_dict(sd)
    with pytest.raises(CheckpointError, match=r"'merge_options' = .* differs"):
        _diloco(merge="ties").load_state_dict(
            {**sd, "meta": {**sd["meta"], "merge": "ties", "merge_options": {"density": 0.1}}}
        )


def test_diloco_refuses_wrong_shapes_and_non_finite_tensors():
    sd = _diloco_state()
    t = sd["tensors"]

    def bad(tensors=None, meta=None, reference=None):
        state = {"tensors": tensors or t, "meta": {**sd["meta"], **(meta or {})}}
        with pytest.raises(CheckpointError) as e:
            _diloco().load_state_dict(state, reference=reference)
        return str(e.value)

    mb = t["outer"]["momentum_buffer"]
    msg = bad({**t, "outer": {"momentum_buffer": {**mb, "w": torch.zeros(3, 5)}}})
    assert msg == "tensor 'outer/momentum_buffer/w' has shape [3, 5], expected [5, 3]"
    msg = bad({**t, "outer": {"momentum_buffer": {**mb, "zz": torch.zeros(1)}}})
    assert msg == "tensor 'outer/momentum_buffer/zz' is unexpected"
    nan = {**mb, "b": torch.tensor([0.0, float("nan"), 0.0])}
    assert "'outer/momentum_buffer/b' has non-finite" in bad(
        {**t, "outer": {"momentum_buffer": nan}}
    )
    inf = {**t["theta"], "w": torch.full((5, 3), float("inf"))}
    assert bad({**t, "theta": inf}) == "tensor 'theta/w' has non-finite values (NaN or inf)"
    ref = {**_model(), "w": torch.zeros(5, 4)}
    assert bad(reference=ref) == "tensor 'theta/w' has shape [5, 3], expected [5, 4]"
    ref = {**_model(), "extra": torch.zeros(1)}
    assert bad(reference=ref).startswith("tensor 'theta/extra' is missing")
    ref = {**_model(), "b": torch.zeros(3, dtype=torch.float64)}
    assert "field 'dtypes.b' is 'float32', the model's is 'float64'" in bad(reference=ref)
    assert "'server_round' must be an int >= 0, got -1" in bad(meta={"server_round": -1})
    assert "'dtypes.w' is 'nn', not a torch dtype" in bad(meta={"dtypes": {"w": "nn", "b": "x"}})
    outer = {**sd["meta"]["outer"], "lr": "0.7"}
    assert "field 'outer.lr' must be a finite number" in bad(meta={"outer": outer})


# ----------------------------------------------------------------------------- B9 temp files
def _killed_write(path: str) -> None:  # child process: dies between write and rename
    import signal

    import flwr_isoloco.checkpoint.store as ck

    def die(*a):
        os.kill(os.getpid(), signal.SIGKILL)

    ck.os.replace = die
    ck.write_bytes_atomic(path, b"x" * 100_000)


def test_leftovers_of_killed_writes_are_removed_by_the_next_write(tmp_path):
    target = tmp_path / "checkpoint.safetensors"
    ctx = mp.get_context("spawn")
    for _ in range(2):
        proc = ctx.Process(target=_killed_write, args=(str(target),))
        proc.start()
        proc.join(120)
        assert proc.exitcode == -9
    # the second write removed the first one's leftover: at most one is ever left
    (leftover,) = [p.name for p in tmp_path.iterdir()]
    assert leftover.startswith(".checkpoint.safetensors.") and leftover.endswith(".tmp")
    fake = [".checkpoint.safetensors.abcd1234.tmp", ".checkpoint.safetensors.x_9zzzzz.tmp"]
    for name in fake:
        (tmp_path / name).write_bytes(b"torn")
    unrelated = [
        ".checkpoint.safetensors.tmp",  # no random part
        ".checkpoint.safetensors.ABCDEFGH.tmp",  # not mkstemp's alphabet
        ".checkpoint.safetensors.abcd1234.tmp.keep",
        ".results.json.abcd1234.tmp",  # another target's leftover
        "checkpoint.safetensors.abcd1234.tmp",  # no leading dot
        "notes.txt",
    ]
    for name in unrelated:
        (tmp_path / name).write_text("keep me")
    (tmp_path / ".checkpoint.safetensors.dir12345.tmp").mkdir()  # a folder: not ours
    write_bytes_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    after = sorted(p.name for p in tmp_path.iterdir())
    assert after == sorted(
        [*unrelated, ".checkpoint.safetensors.dir12345.tmp", "checkpoint.safetensors"]
    )
    assert all((tmp_path / n).read_text() == "keep me" for n in unrelated)


def test_graph_strategy_state_fields_are_checked():
    from flwr_isoloco.strategies.graph.rwlora import RWLoRA

    token = {"a": torch.zeros(2, 3)}
    meta = {
        "kind": "rwlora",
        "round": 1,
        "vertices": [0, 1, 2],
        "walk": {},
        "trajectory": [0],
        "excluded": [],
        "failures": 0,
        "failures_by_vertex": [],
        "failure_log": [],
        "local_updates": 1,
        "bytes_relayed": 0,
        "bytes_p2p": 0,
        "update_norms": [],
    }

    def bad(tensors=None, reference=None, optimizer_reference=None, **m):
        s = RWLoRA("ring", num_vertices=3)
        with pytest.raises(CheckpointError) as e:
            s.load_state_dict(
                {"tensors": tensors or {"token": token}, "meta": {**meta, **m}},
                reference=reference,
                optimizer_reference=optimizer_reference,
            )
        return str(e.value)

    RWLoRA("ring", num_vertices=3).load_state_dict({"tensors": {"token": token}, "meta": meta})
    assert bad(round="abc") == "field 'round' must be an int >= 0, got 'abc'"
    assert bad(failure_log=[["x", 1, "why"]]).startswith("field 'failure_log[0][0]' must be")
    assert bad(failures_by_vertex=[[1, -2]]).startswith("field 'failures_by_vertex[0][1]' must")
    assert bad(update_norms=[float("nan")]).startswith("field 'update_norms[0]' must be")
    assert bad(reference={"a": torch.zeros(3, 2)}) == (
        "tensor 'token/a' has shape [2, 3], expected [3, 2]"
    )
    opt = {"a.exp_avg": torch.zeros(2, 3), "a.exp_avg_sq": torch.zeros(2)}
    ref = {"a.exp_avg": (2, 3), "a.exp_avg_sq": (2, 3)}
    msg = bad({"token": token, "optimizer": opt}, optimizer_reference=ref)
    assert msg == "tensor 'optimizer/a.exp_avg_sq' has shape [2], expected [2, 3]"
    nan = {"token": {"a": torch.full((2, 3), float("nan"))}}
    assert bad(nan) == "tensor 'token/a' has non-finite values (NaN or inf)"
