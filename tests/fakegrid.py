"""In-process fake Flower ``Grid`` for fast federation tests (no Ray, no SuperLink).

``FakeGrid`` implements the ``flwr.serverapp.Grid`` interface and dispatches each message
synchronously to a ClientApp (or a dict of handler functions keyed by message category:
``"train"``, ``"evaluate"``, ``"query"``). Every node has its own persistent ``Context``
(``node_config`` with ``partition-id`` / ``num-partitions``, a ``state`` RecordDict that lives
across rounds, the run config). Messages and replies are deep-copied, as a real transport would.

Fault injection (per node id, see :meth:`FakeGrid.set_fault`):

- ``"raise"``: the handler is not run; the node replies with an error (code 2,
  CLIENT_APP_RAISED_EXCEPTION), like a ClientApp that raised.
- ``"timeout"``: no reply at all (the message is simply missing from the returned list).
- ``"dead"``: an error reply with code 5 (NODE_UNAVAILABLE) whose ``src_node_id`` is the
  SuperLink (1), as Flower does for a killed SuperNode.
- a callable ``fn(reply: Message) -> Message``: the handler runs, then ``fn`` may corrupt
  (or replace) the reply.

A fault applies for ``times`` messages (``None``: forever).

Slow nodes (:meth:`FakeGrid.set_delay`): the next ``times`` messages to a node are answered
only at the ``pulls + 1``-th ``pull_messages`` call that asks for them (a straggler; the round
driver's quorum and grace window see it late). ``FakeGrid.pulls`` counts pull calls per id. Handler exceptions that are not
injected also become error replies (the run goes on, as in Flower).

Usage::

    grid = FakeGrid(app, num_nodes=3, run_config={...})
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(sd), num_rounds=2)
"""

from __future__ import annotations

import copy
import random
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, Metadata, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

Handler = Callable[[Message, Context], Message]
Fault = str | Callable[[Message], Message]

_FAULT_NAMES = ("raise", "timeout", "dead")


@dataclass
class SentRecord:
    """One delivered (or dropped) instruction, for assertions in tests."""

    node_id: int
    message_type: str
    group_id: str
    outcome: str  # "ok", "raised", "timeout", "dead", "corrupted"


@dataclass
class _FaultSpec:
    fault: Fault
    times: int | None = None


@dataclass
class FakeGrid(Grid):
    """A fake ``Grid`` running ClientApp handlers in-process.

    Parameters
    ----------
    app : ClientApp or Mapping[str, Handler]
        A ``flwr.clientapp.ClientApp`` (called as ``app(message, context)``) or a dict from
        message category (``"train"``, ``"evaluate"``, ``"query"``) to ``fn(msg, context)``.
    num_nodes : int
        Number of simulated nodes; node ``i`` gets ``partition-id = i``.
    run_config : Mapping
        The run config every node's ``Context`` carries.
    node_config_fn : callable, optional
        ``fn(partition_id) -> dict`` with extra node-config entries.
    seed : int
        Seed for the random uint64 node ids.
    run_id : int
        Run id put in contexts and in ``TaskIdentity``.
    """

    app: Any
    num_nodes: int = 2
    run_config: Mapping[str, Any] = field(default_factory=dict)
    node_config_fn: Callable[[int], Mapping[str, Any]] | None = None
    seed: int = 0
    run_id: int = 1234

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {self.num_nodes}")
        # Messages built outside a real run need a task identity (see flwr Message.__init__).
        TaskIdentity.run_id = self.run_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        TaskIdentity.task_id = 1
        rng = random.Random(self.seed)
        ids: list[int] = []
        while len(ids) < self.num_nodes:
            nid = rng.getrandbits(64)
            if nid > SUPERLINK_NODE_ID and nid not in ids:
                ids.append(nid)
        self.node_ids: list[int] = ids  # index = partition id
        self.partition_of: dict[int, int] = {nid: i for i, nid in enumerate(ids)}
        self.contexts: dict[int, Context] = {}
        for i, nid in enumerate(ids):
            node_config: dict[str, Any] = {"partition-id": i, "num-partitions": self.num_nodes}
            if self.node_config_fn is not None:
                node_config.update(self.node_config_fn(i))
            self.contexts[nid] = Context(
                run_id=self.run_id,
                node_id=nid,
                node_config=node_config,
                state=RecordDict(),
                run_config=dict(self.run_config),
            )
        self.offline: set[int] = set()  # nodes not listed by get_node_ids()
        self.log: list[SentRecord] = []
        self._faults: dict[int, _FaultSpec] = {}
        self._pending: dict[str, Message] = {}
        self._delays: dict[int, list[int]] = {}  # node -> [pulls to withhold, messages left]
        self._withheld: dict[str, int] = {}  # message id -> pulls still to withhold
        self.pull_calls = 0
        self.time_source = _VirtualClock(
            self
        )  # the round driver's clock (strategies/core/stream.py)
        self._run = Run.create_empty(self.run_id)

    # ------------------------------------------------------------------ faults
    def set_fault(self, node: int, fault: Fault, times: int | None = None) -> None:
        """Inject ``fault`` on ``node`` (a node id, or a partition id < num_nodes)."""
        nid = self._resolve(node)
        if isinstance(fault, str) and fault not in _FAULT_NAMES:
            raise ValueError(
                f"unknown fault {fault!r}; expected one of {_FAULT_NAMES} or a callable"
            )
        self._faults[nid] = _FaultSpec(fault, times)

    def set_delay(self, node: int, pulls: int, times: int = 1) -> None:
        """Answer the next ``times`` messages to ``node`` only after ``pulls`` pulls of each."""
        self._delays[self._resolve(node)] = [int(pulls), int(times)]

    def clear_faults(self) -> None:
        """Remove every injected fault."""
        self._faults.clear()

    def _resolve(self, node: int) -> int:
        if node in self.contexts:
            return node
        if 0 <= node < self.num_nodes:
            return self.node_ids[node]
        raise KeyError(f"no node {node} (neither a node id nor a partition id)")

    def _take_fault(self, nid: int) -> Fault | None:
        spec = self._faults.get(nid)
        if spec is None:
            return None
        if spec.times is not None:
            spec.times -= 1
            if spec.times <= 0:
                del self._faults[nid]
        return spec.fault

    # ------------------------------------------------------------------ Grid API
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return [nid for nid in self.node_ids if nid not in self.offline]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            if msg.metadata.dst_node_id not in self.contexts:
                raise ValueError(f"message to unknown node {msg.metadata.dst_node_id}")
            self._pending[msg.metadata.message_id] = msg
            ids.append(msg.metadata.message_id)
            delay = self._delays.get(msg.metadata.dst_node_id)
            if delay is not None and delay[1] > 0:
                self._withheld[msg.metadata.message_id] = delay[0]
                delay[1] -= 1
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = []
        self.pull_calls += 1
        for mid in list(message_ids):
            if self._withheld.get(mid, 0) > 0:
                self._withheld[mid] -= 1
                continue
            msg = self._pending.pop(mid, None)
            if msg is None:
                continue
            reply = self._deliver(msg)
            if reply is not None:
                replies.append(reply)
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return list(self.pull_messages(self.push_messages(list(messages))))

    # ------------------------------------------------------------------ dispatch
    def _handler(self, message_type: str) -> Handler:
        if isinstance(self.app, Mapping):
            category = message_type.split(".")[0]
            if category not in self.app:
                raise ValueError(f"no handler registered for message type {message_type!r}")
            return self.app[category]
        return self.app

    def _deliver(self, msg: Message) -> Message | None:
        nid = msg.metadata.dst_node_id
        mtype = msg.metadata.message_type
        group = msg.metadata.group_id
        fault = self._take_fault(nid)
        if fault == "timeout":
            self.log.append(SentRecord(nid, mtype, group, "timeout"))
            return None
        if fault == "dead":
            self.log.append(SentRecord(nid, mtype, group, "dead"))
            return _superlink_error_reply(msg)
        if fault == "raise":
            self.log.append(SentRecord(nid, mtype, group, "raised"))
            return Message(
                Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "injected fault: ClientApp raised"),
                reply_to=msg,
            )
        # Deliver a copy, as a transport would: the client cannot alias server objects.
        delivered = Message(
            metadata=copy.deepcopy(msg.metadata), content=copy.deepcopy(msg.content)
        )
        try:
            reply = self._handler(mtype)(delivered, self.contexts[nid])
        except Exception as exc:  # noqa: BLE001 - a raising ClientApp becomes an error reply
            self.log.append(SentRecord(nid, mtype, group, "raised"))
            reason = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=msg)
        if reply.has_content():
            reply = Message(
                metadata=copy.deepcopy(reply.metadata), content=copy.deepcopy(reply.content)
            )
        # Make the reply point at the message as pushed (ids set by push_messages).
        reply.metadata.__dict__["_reply_to_message_id"] = msg.metadata.message_id
        reply.metadata.__dict__["_src_node_id"] = nid
        reply.metadata.__dict__["_message_id"] = str(uuid4())
        if callable(fault):
            reply = fault(reply)
            self.log.append(SentRecord(nid, mtype, group, "corrupted"))
        else:
            self.log.append(SentRecord(nid, mtype, group, "ok"))
        return reply


class _VirtualClock:
    """Virtual time for the round driver: ``sleep`` advances it at once; when no withheld
    reply is left (nothing more can arrive) it jumps 10**9 s ahead, so a round waiting for a
    reply that never comes ends at its timeout without waiting for real."""

    def __init__(self, grid: FakeGrid) -> None:
        self.grid, self.now = grid, 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        withheld = any(n > 0 for mid, n in self.grid._withheld.items() if mid in self.grid._pending)
        self.now += seconds if withheld else 1e9


def _superlink_error_reply(msg: Message) -> Message:
    """Error reply for an unreachable node, sent by the SuperLink (src_node_id 1)."""
    md = msg.metadata
    metadata = Metadata(
        run_id=md.run_id,
        message_id=str(uuid4()),
        src_node_id=SUPERLINK_NODE_ID,
        dst_node_id=md.src_node_id,
        reply_to_message_id=md.message_id,
        group_id=md.group_id,
        created_at=md.created_at,
        ttl=md.ttl,
        message_type=md.message_type,
    )
    return Message(
        metadata=metadata,
        error=Error(ErrorCode.NODE_UNAVAILABLE, f"node {md.dst_node_id} is unavailable"),
    )


def corrupt_arrays(fn: Callable[[dict], dict], arrayrecord_key: str = "arrays") -> Fault:
    """Fault that rewrites the reply's ArrayRecord through ``fn(numpy_dict) -> numpy_dict``."""
    from flwr.app import Array, ArrayRecord

    def _fault(reply: Message) -> Message:
        rec = reply.content[arrayrecord_key]
        arrays = {k: v.numpy().copy() for k, v in rec.items()}
        reply.content[arrayrecord_key] = ArrayRecord({k: Array(v) for k, v in fn(arrays).items()})
        return reply

    return _fault
