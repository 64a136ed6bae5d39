"""Bytes of the messages a federation actually exchanges, in Flower's own accounting.

``content_bytes(rd)`` is what Flower's benchmark apps call ``RecordDict.count_bytes()``: the
sum over the RecordDict's records of ``record.count_bytes()`` (an ArrayRecord counts each
array's serialised ``.npy`` bytes, header included, plus its key) plus the record names. flwr
1.42's ``RecordDict`` has no ``count_bytes`` of its own (its records do), hence the sum.

:class:`CountingGrid` is the tests' in-process ``FakeGrid`` (``tests/fakegrid.py``) that logs,
for every delivered message, those bytes down (the instruction) and up (the reply), and the
array payload (``payload_nbytes``: itemsize x entries, the strategies' ``bytes-up`` /
``bytes-down`` metrics) of each.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

common.on_path("tests")
from fakegrid import FakeGrid  # noqa: E402
from flwr.app import ConfigRecord, Message, RecordDict  # noqa: E402

from flwr_isoloco.compression import payload_nbytes  # noqa: E402


def record_bytes(rec: Any) -> int:
    """``rec.count_bytes()``; a ConfigRecord holding an empty ``str`` / ``bytes`` (the
    ``download-base`` of a full download) is counted without it plus its key, as
    ``count_bytes`` would count a 0-byte value: flwr 1.42 raises ValueError there."""
    if not isinstance(rec, ConfigRecord):
        return rec.count_bytes()
    empty = [k for k, v in rec.items() if isinstance(v, (str, bytes)) and len(v) == 0]
    rest = ConfigRecord({k: v for k, v in rec.items() if k not in empty})
    return rest.count_bytes() + sum(len(k) for k in empty)


def content_bytes(rd: RecordDict) -> int:
    """``sum(record.count_bytes() + len(name))`` over the records of ``rd`` (module doc)."""
    return sum(record_bytes(rec) + len(name) for name, rec in rd.items())


def arrays_nbytes(rd: RecordDict) -> int:
    """Array payload of ``rd``: ``payload_nbytes`` summed over its ArrayRecords."""
    return sum(payload_nbytes(rec) for rec in rd.array_records.values())


def server_round(msg: Message) -> int:
    """The instruction's ``server-round`` config entry (0 if it has none)."""
    cfg = msg.content.config_records.get("config")
    return int(cfg.get("server-round", 0)) if cfg is not None else 0


@dataclass
class CountingGrid(FakeGrid):
    """``FakeGrid`` that appends one row per delivered message to ``self.traffic``:
    ``{"round", "partition", "type", "down", "up", "down-arrays", "up-arrays"}``
    (``up`` = 0 for a message that got no reply or an error reply)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.traffic: list[dict] = []

    def _deliver(self, msg: Message) -> Message | None:
        down, down_arrays = content_bytes(msg.content), arrays_nbytes(msg.content)
        reply = super()._deliver(msg)
        ok = reply is not None and reply.has_content()
        self.traffic.append(
            {
                "round": server_round(msg),
                "partition": self.partition_of[msg.metadata.dst_node_id],
                "type": msg.metadata.message_type,
                "down": down,
                "up": content_bytes(reply.content) if ok else 0,
                "down-arrays": down_arrays,
                "up-arrays": arrays_nbytes(reply.content) if ok else 0,
                "error": None if reply is None or ok else reply.error.reason[:200],
            }
        )
        return reply


def per_round(traffic: list[dict], kind: str = "train") -> dict[int, dict[str, float]]:
    """Per round: the mean over the nodes messaged of each byte count (one message per node
    and round for ``kind``), and how many nodes."""
    rows: dict[int, list[dict]] = {}
    for t in traffic:
        if t["type"].split(".")[0] == kind:
            rows.setdefault(t["round"], []).append(t)
    keys = ("down", "up", "down-arrays", "up-arrays")
    return {
        r: {**{k: mean(x[k] for x in rs) for k in keys}, "nodes": len(rs)}
        for r, rs in sorted(rows.items())
    }
