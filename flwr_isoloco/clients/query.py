"""A ready-made ``@app.query()`` handler for the graph strategies' vertex query.

RW-LoRA and gossip ask every node once, at start, which graph vertex it is: the QUERY message
holds ``ConfigRecord({"vertex-key": <key>})`` (default ``partition-id``) and the node answers
``ConfigRecord({<key>: context.node_config[<key>]})``. Without any query handler the strategies
still run, with vertex ``i`` = the ``i``-th connected node in node-id order; register this one
to make vertex ``i`` partition ``i`` (so a graph can follow the data, e.g. a ring of sites)::

    from flwr_isoloco.clients import partition_id_query

    app = ClientApp()
    app.query()(partition_id_query)
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, RecordDict

__all__ = ["partition_id_query"]


def partition_id_query(msg: Message, context: Context) -> Message:
    """Answer the vertex query with ``context.node_config[vertex-key]``.

    The key comes from the query (``partition-id`` when absent). Raises ``KeyError`` naming
    the key and the node_config keys when the node has no such entry (the server then logs the
    error reply and leaves the node out).
    """
    cfg = msg.content.config_records.get("config")
    key = str(cfg.get("vertex-key", "partition-id")) if cfg is not None else "partition-id"
    if key not in context.node_config:
        raise KeyError(f"node_config has no {key!r} (got keys {sorted(context.node_config)})")
    content = RecordDict({"config": ConfigRecord({key: context.node_config[key]})})
    return Message(content=content, reply_to=msg)
