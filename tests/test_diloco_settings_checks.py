"""DiLoCo/IsoLoCo settings that would have no effect are refused when built, each with the fix;
one setting has one meaning whether it comes from a constructor or the run config; and the
strategy's views of its settings (``quorum``, ``weighting``, ...) are read from the settings
objects, never a second copy."""

from __future__ import annotations

import pytest

from flwr_isoloco.runconfig import RunConfigError
from flwr_isoloco.strategies import (
    CentralDP,
    Codec,
    DiLoCo,
    IsoLoCo,
    ReplyChecks,
    Rounds,
)
from flwr_isoloco.strategies.diloco.secagg import use_secagg
from flwr_isoloco.strategies.diloco.setup import effective_weighting


# ----------------------------------------------------------------------------- quorum
def test_quorum_one_is_all_replies_in_the_run_config_and_refused_as_an_int_count():
    """``strategy.quorum = 1`` (TOML int) and ``1.0`` wait for every reply; ``Rounds(quorum=1)``
    would close a round on one reply: refused, naming both spellings of "all"."""
    for value in (1, 1.0):
        s = DiLoCo.from_run_config({"strategy.quorum": value})
        assert s.rounds.quorum is None and s.quorum is None
    with pytest.raises(ValueError, match=r"quorum=1 .*quorum=None"):
        Rounds(quorum=1)
    assert DiLoCo(rounds=Rounds(quorum=1.0)).quorum is None  # the fraction 1.0: all


def test_a_count_is_an_int_and_a_fraction_a_float():
    with pytest.raises(ValueError, match=r"a count is an int: write 3"):
        Rounds(quorum=3.0)
    assert Rounds(quorum=3).quorum == 3 and Rounds(quorum=0.5).quorum == 0.5
    s = DiLoCo.from_run_config({"strategy.quorum": 3.0, "strategy.grace-s": 1.0})
    assert type(s.rounds.quorum) is int and s.rounds.quorum == 3 and s.quorum == 3


def test_a_run_config_quorum_that_is_neither_is_named():
    with pytest.raises(RunConfigError, match=r"strategy\.quorum.*whole count"):
        DiLoCo.from_run_config({"strategy.quorum": 1.5})


# ----------------------------------------------------------------------------- grace without quorum
@pytest.mark.parametrize("quorum", [None, 1.0])
def test_grace_without_a_quorum_is_refused(quorum):
    with pytest.raises(ValueError, match=r"grace_s=5.*set quorum"):
        Rounds(quorum=quorum, grace_s=5)
    assert Rounds(quorum=0.5, grace_s=5).grace_s == 5.0


def test_run_config_grace_without_a_quorum_is_named():
    with pytest.raises(ValueError, match=r"strategy\.grace-s.*strategy\.quorum"):
        DiLoCo.from_run_config({"strategy.grace-s": 5.0})


# ----------------------------------------------------------------------------- weight bound
def test_a_weight_bound_under_uniform_weights_is_refused():
    with pytest.raises(ValueError, match=r"max_weight_ratio=3.*uniform"):
        ReplyChecks(weighting="uniform", max_weight_ratio=3)
    assert DiLoCo(checks=ReplyChecks(weighting="uniform")).max_weight_ratio == 0.0  # off
    assert DiLoCo(checks=ReplyChecks(weighting="uniform", max_weight_ratio=0)).max_weight_ratio == 0
    assert DiLoCo().max_weight_ratio == 5.0  # the default bound, under examples weighting


def test_run_config_weight_bound_under_uniform_weights_is_named():
    rc = {"strategy.weighting": "uniform", "strategy.max-weight-ratio": 3.0}
    with pytest.raises(ValueError, match=r"strategy\.max-weight-ratio.*strategy\.weighting"):
        DiLoCo.from_run_config(rc)
    s = DiLoCo.from_run_config({"strategy.weighting": "uniform"})  # the default: off
    assert s.max_weight_ratio == 0.0 and s.checks.weighting == "uniform"


# ----------------------------------------------------------------------------- download codec
def test_a_download_codec_with_an_error_feedback_decay_is_refused():
    with pytest.raises(ValueError, match=r"download.*ef_decay"):
        DiLoCo(download=Codec("int8", ef_decay=0.5))
    assert DiLoCo(upload=Codec("int8", ef_decay=0.5)).upload.options["ef_decay"] == 0.5


def test_run_config_ef_decay_goes_to_the_upload_codec_only():
    rc = {
        "strategy.upload-codec": "sparseloco",
        "strategy.download-codec": "int8",
        "strategy.codec-ef-decay": 0.9,
    }
    s = DiLoCo.from_run_config(rc)
    assert s.upload.options["ef_decay"] == 0.9 and "ef_decay" not in s.download.options
    with pytest.raises(ValueError, match=r"strategy\.codec-ef-decay.*strategy\.upload-codec"):
        DiLoCo.from_run_config({**rc, "strategy.upload-codec": "none"})


# ----------------------------------------------------------------------------- secagg
def test_use_secagg_refuses_asynchronous_rounds_with_the_reason():
    s = DiLoCo(
        checks=ReplyChecks(weighting="uniform"),
        fraction_evaluate=0.0,
        rounds=Rounds(asynchronous=True),
    )
    with pytest.raises(ValueError, match=r"secagg.*asynchronous"):
        use_secagg(s)
    assert s.secagg is None


# ----------------------------------------------------------------------------- one source
VIEWS = ("quorum", "grace_s", "weighting", "max_weight_ratio", "payload", "upload_codec")


@pytest.mark.parametrize("cls", [DiLoCo, IsoLoCo])
def test_the_strategys_views_are_read_from_its_settings(cls):
    checks = ReplyChecks(payload="delta", max_weight_ratio=2.0)
    s = cls(rounds=Rounds(quorum=2, grace_s=1.5), checks=checks, upload="int8")
    assert (s.quorum, s.grace_s) == (2, 1.5)
    assert (s.weighting, s.max_weight_ratio, s.payload) == ("examples", 2.0, "delta")
    assert s.upload_codec == "int8"
    for name in VIEWS:
        assert name not in vars(s), f"{name} is a second copy of a setting"
        with pytest.raises(AttributeError):
            setattr(s, name, "uniform" if name == "weighting" else None)


def test_central_dp_weighs_uniformly_whatever_checks_say():
    s = DiLoCo(privacy=CentralDP(clipping_norm=1.0))
    assert effective_weighting(s) == "uniform" and s.max_weight_ratio == 0.0


def test_renamed_fields_and_keys_name_the_new_spelling():
    with pytest.raises(
        TypeError, match=r"client_sends is now payload: use ReplyChecks\(payload='delta'\)"
    ):
        ReplyChecks(client_sends="delta")
    assert ReplyChecks(payload="delta").payload == "delta"
    with pytest.raises(ValueError, match=r"'strategy.client-sends' is now 'strategy.payload'"):
        DiLoCo.from_run_config({"strategy.client-sends": "delta"})


def test_async_buffer_is_refused_naming_replies_per_step():
    """``buffer`` also names BatchNorm statistics (``MergeSettings.buffers``): K is
    ``Rounds.replies_per_step`` and ``strategy.async-replies-per-step``."""
    with pytest.raises(
        TypeError, match=r"buffer is now replies_per_step: use Rounds\(replies_per_step=2\)"
    ):
        Rounds(buffer=2)
    assert Rounds(asynchronous=True, replies_per_step=2).replies_per_step == 2
    rc = {"strategy.asynchronous": True, "strategy.fraction-evaluate": 0.0}
    for cls in (DiLoCo, IsoLoCo):
        with pytest.raises(
            ValueError,
            match=r"'strategy.async-buffer' is now 'strategy.async-replies-per-step'",
        ):
            cls.from_run_config({**rc, "strategy.async-buffer": 2})
