"""What a round sent, so that each reply is attributed to the node it answers for.

A reply is matched to its instruction by ``reply.metadata.reply_to_message_id``; the node is the
instruction's ``dst_node_id``, not the reply's ``src_node_id`` (a killed SuperNode's error reply
comes from the SuperLink, ``src_node_id == 1``).
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message

__all__ = ["SentLedger"]


class SentLedger:
    """Remembers which node each instruction went to, to attribute replies correctly."""

    def __init__(self) -> None:
        self._sent: list[Message] = []

    def remember(self, messages: Iterable[Message]) -> list[Message]:
        """Record ``messages`` (their ids are filled in later by ``grid.push_messages``)."""
        self._sent = list(messages)
        return self._sent

    def sent_any(self) -> bool:
        """Whether the last round sent any instruction."""
        return bool(self._sent)

    def sender(self, reply: Message) -> int:
        """The node a reply answers for."""
        target = reply.metadata.reply_to_message_id
        for m in self._sent:
            if target and m.metadata.message_id == target:
                return m.metadata.dst_node_id
        return reply.metadata.src_node_id

    def missing(self, replies: Iterable[Message]) -> list[int]:
        """Nodes we sent to that did not reply at all."""
        return self.unanswered({r.metadata.reply_to_message_id for r in replies})

    def unanswered(self, answered: set[str]) -> list[int]:
        """Nodes whose (pushed) instruction's id is not among the ``answered`` message ids."""
        return [
            m.metadata.dst_node_id
            for m in self._sent
            if m.metadata.message_id and m.metadata.message_id not in answered
        ]
