"""An error reply's reason reaches the user as the ClientApp's own exception: Ray's actor repr,
traceback and ANSI escapes removed, the exception type read back (Ray's ClientAppException
drops it), in the rejection the strategy logs and returns."""

from __future__ import annotations

import traceback

from flwr.app import Error, Message, RecordDict

from flwr_isoloco.strategies.core.reply import CAUSE_CHARS, node_error_cause

MESSAGE = "train.device 'cuda': no CUDA device is visible to this node; use 'auto' or 'cpu'"


def _ray_reason(message: str) -> str:
    """The reason a Ray simulation puts in the error reply (vce_api: ``str(type(ex)) + ":<'" +
    str(ex) + "'>"`` of Ray's RayTaskError around Flower's ClientAppException)."""
    from flwr.clientapp.client_app import ClientAppException
    from ray.exceptions import RayTaskError

    try:
        try:
            raise ValueError(message)
        except ValueError as ex:
            raise ClientAppException(str(ex)) from ex
    except ClientAppException as e:
        err = RayTaskError(
            "ClientAppActor.run",
            traceback.format_exc(),
            e,
            proctitle="ray::ClientAppActor.run()",
            pid=4242,
            ip="127.0.0.1",
            actor_repr="<ClientAppActor object at 0x7f0000>",
        ).as_instanceof_cause()
        return str(type(err)) + ":<'" + str(err) + "'>"


def test_ray_wrapped_reason_gives_the_exception_and_its_type():
    reason = _ray_reason(MESSAGE)
    assert "\x1b[" in reason and reason.index("cuda") > 300  # what the user saw before
    assert node_error_cause(reason) == f"ValueError: {MESSAGE}"


def test_supernode_reason_and_plain_reasons():
    assert node_error_cause("<class 'KeyError'>:<''missing''>") == "KeyError: 'missing'"
    assert node_error_cause("node went away") == "node went away"
    assert node_error_cause("\x1b[31mred\x1b[0m   text\n") == "red text"
    assert len(node_error_cause("x" * 5000)) == CAUSE_CHARS


def test_the_strategy_names_the_cause_in_its_log_and_metrics(caplog):
    """Node 1 answers with Ray's error reply; the round's warning names the ValueError."""
    import logging

    import torch
    from fakegrid import FakeGrid
    from flwr.app import ArrayRecord, MetricRecord
    from flwr.clientapp import ClientApp

    from flwr_isoloco.strategies import DiLoCo

    def train(msg: Message, context) -> Message:
        if int(context.node_config["partition-id"]) == 1:
            return Message(Error(2, _ray_reason(MESSAGE)), reply_to=msg)
        sd = msg.content["arrays"].to_torch_state_dict()
        out = {k: v + 1 for k, v in sd.items()}
        metrics = MetricRecord({"num-examples": 1})
        return Message(RecordDict({"arrays": ArrayRecord(out), "metrics": metrics}), reply_to=msg)

    app = ClientApp()
    app.train()(train)
    s = DiLoCo(min_available_nodes=2, fraction_evaluate=0.0)
    with caplog.at_level(logging.WARNING):
        res = s.start(
            grid=FakeGrid(app, num_nodes=2),
            initial_arrays=ArrayRecord({"w": torch.zeros(3)}),
            num_rounds=1,
        )
    assert res.train_metrics_clientapp[1]["replies-rejected"] == 1
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"error reply (code 2): ValueError: {MESSAGE}" in text
    assert "\x1b[" not in text and "ClientAppActor" not in text
