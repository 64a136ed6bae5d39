"""Run-config reader: defaults, type checks, validators, and error messages naming the key."""

import pytest
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ReadonlyConfigError

from flwr_isoloco.runconfig import (
    RunConfigError,
    absolute_path,
    choices,
    existing_path,
    flatten,
    in_range,
    non_negative,
    positive,
    read_run_config,
    unflatten,
)

DEFAULTS = {
    "num-server-rounds": 3,
    "seed": 0,
    "output-dir": "",
    "strategy": {"name": "isoloco", "outer-lr": 1.8, "nesterov": True},
    "train": {"local-steps": 10, "lr": 1e-3},
}
VALIDATORS = {
    "strategy.name": choices("diloco", "isoloco", "fedavg"),
    "strategy.outer-lr": positive,
    "train.local-steps": [positive],
    "train.lr": in_range(0.0, 1.0, lo_open=True),
    "seed": non_negative,
    "output-dir": absolute_path(allow_empty=True),
}


def test_defaults_and_overrides():
    cfg = read_run_config({"strategy.outer-lr": 2, "train.local-steps": 5}, DEFAULTS, VALIDATORS)
    assert isinstance(cfg, DictConfig)
    assert cfg.strategy["outer-lr"] == 2.0 and isinstance(cfg.strategy["outer-lr"], float)
    assert cfg.train["local-steps"] == 5
    assert cfg.strategy.name == "isoloco" and cfg.strategy.nesterov is True
    assert cfg["num-server-rounds"] == 3


def test_nested_input_accepted():
    cfg = read_run_config({"strategy": {"name": "diloco"}}, DEFAULTS, VALIDATORS)
    assert cfg.strategy.name == "diloco"


def test_readonly_struct():
    cfg = read_run_config({}, DEFAULTS)
    with pytest.raises(ReadonlyConfigError):
        cfg.strategy.name = "x"
    with pytest.raises(ConfigAttributeError):
        _ = cfg.strategy.nonexistent


def test_unknown_key_names_it_and_close_match():
    with pytest.raises(
        RunConfigError, match=r"'strategy\.outer-rl'.*did you mean 'strategy\.outer-lr'"
    ):
        read_run_config({"strategy.outer-rl": 1.0}, DEFAULTS, VALIDATORS)
    with pytest.raises(RunConfigError, match=r"unknown run-config key 'zzz'"):
        read_run_config({"zzz": 1}, DEFAULTS)


@pytest.mark.parametrize(
    "key,value,pattern",
    [
        (
            "strategy.outer-lr",
            "fast",
            r"'strategy\.outer-lr' has value 'fast' of type str; expected float",
        ),
        (
            "train.local-steps",
            2.5,
            r"'train\.local-steps' has value 2\.5 of type float; expected int",
        ),
        ("train.local-steps", True, r"'train\.local-steps'.*type bool; expected int"),
        ("strategy.nesterov", 1, r"'strategy\.nesterov'.*expected bool"),
        ("strategy.name", 3, r"'strategy\.name'.*expected str"),
        ("strategy.outer-lr", float("nan"), r"'strategy\.outer-lr' has non-finite value"),
    ],
)
def test_wrong_type(key, value, pattern):
    with pytest.raises(RunConfigError, match=pattern):
        read_run_config({key: value}, DEFAULTS, VALIDATORS)


@pytest.mark.parametrize(
    "key,value,pattern",
    [
        ("strategy.name", "fedsgd", r"'strategy\.name' has bad value 'fedsgd': must be one of"),
        ("strategy.outer-lr", -0.5, r"'strategy\.outer-lr' has bad value -0\.5: must be > 0"),
        ("train.local-steps", 0, r"'train\.local-steps' has bad value 0: must be > 0"),
        ("train.lr", 0.0, r"'train\.lr' has bad value 0\.0: must be in \(0\.0, 1\.0\]"),
        ("seed", -1, r"'seed' has bad value -1: must be >= 0"),
        (
            "output-dir",
            "relative/dir",
            r"'output-dir' has bad value 'relative/dir': must be an absolute",
        ),
    ],
)
def test_bad_values(key, value, pattern):
    with pytest.raises(RunConfigError, match=pattern):
        read_run_config({key: value}, DEFAULTS, VALIDATORS)


def test_bad_default_also_caught():
    with pytest.raises(RunConfigError, match="'seed' has bad value -3"):
        read_run_config({}, {**DEFAULTS, "seed": -3}, VALIDATORS)


def test_existing_path(tmp_path):
    v = {"output-dir": existing_path()}
    read_run_config({"output-dir": str(tmp_path)}, DEFAULTS, v)
    with pytest.raises(RunConfigError, match="'output-dir'.*no such file or directory"):
        read_run_config({"output-dir": str(tmp_path / "missing")}, DEFAULTS, v)


def test_validator_for_unknown_key_rejected():
    with pytest.raises(RunConfigError, match="'nope'"):
        read_run_config({}, DEFAULTS, {"nope": positive})


def test_is_value_error():
    assert issubclass(RunConfigError, ValueError)


def test_flatten_roundtrip():
    assert unflatten(flatten(DEFAULTS)) == DEFAULTS
    with pytest.raises(RunConfigError, match="'a.b'"):
        unflatten({"a": 1, "a.b": 2})
