"""What a round sent, so that each reply is attributed to the node it answers for.

A reply is matched to its instruction by ``reply.metadata.reply_to_message_id``; the node is the
instruction's ``dst_node_id``, not the reply's ``src_node_id`` (a killed SuperNode's error reply
comes from the SuperLink, ``src_node_id == 1``). The ledger keeps each instruction's
``Metadata`` only, not the message: its content (the model sent, one copy for every node) is
then freed once the grid has it, not held until the next round.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message, Metadata
from flwr.common.constant import ErrorCode

__all__ = ["SentLedger", "node_gone", "not_this_round"]


class SentLedger:
    """Remembers which node each instruction went to, to attribute replies correctly."""

    def __init__(self) -> None:
        self._sent: list[Metadata] = []

    def remember(self, messages: Iterable[Message]) -> list[Message]:
        """Record ``messages``' metadata (the same objects: ``grid.push_messages`` fills their
        ids in later) and return the messages."""
        messages = list(messages)
        self._sent = [m.metadata for m in messages]
        return messages

    def replace(self, answered: str, message: Message) -> None:
        """``message`` takes the place of the instruction whose id is ``answered`` (its node's
        reply asked for another message in the same round: a full model for an update)."""
        self._sent = [m for m in self._sent if m.message_id != answered]
        self._sent.append(message.metadata)

    def sent_any(self) -> bool:
        """Whether the last round sent any instruction."""
        return bool(self._sent)

    def count(self) -> int:
        """How many instructions the last round sent."""
        return len(self._sent)

    def sent(self) -> list[Metadata]:
        """The metadata of the last round's instructions (ids filled in once pushed)."""
        return list(self._sent)

    def sent_this_round(self, message_id: str) -> bool:
        """Whether ``message_id`` is one of the last round's instructions (True when their ids
        are not known: nothing to check against)."""
        ids = {m.message_id for m in self._sent if m.message_id}
        return not ids or message_id in ids

    def sender(self, reply: Message) -> int:
        """The node a reply answers for."""
        target = reply.metadata.reply_to_message_id
        for m in self._sent:
            if target and m.message_id == target:
                return m.dst_node_id
        return reply.metadata.src_node_id

    def missing(self, replies: Iterable[Message]) -> list[int]:
        """Nodes we sent to that did not reply at all."""
        return self.unanswered({r.metadata.reply_to_message_id for r in replies})

    def unanswered(self, answered: set[str]) -> list[int]:
        """Nodes whose (pushed) instruction's id is not among the ``answered`` message ids."""
        return [m.dst_node_id for m in self._sent if m.message_id and m.message_id not in answered]


def not_this_round(msg: Message, ledger: SentLedger | None, seen: set[str]) -> str:
    """Why ``msg`` is not one of this round's replies (``""`` if it is): a second reply to the
    same message (a replayed delivery: applied once), or a reply to a message this round did not
    send (an earlier round's, never folded into this one). Adds its message id to ``seen``."""
    rid = msg.metadata.reply_to_message_id
    if rid and rid in seen:
        return f"duplicate reply to message {rid} (already taken once this round)"
    seen.add(rid)
    if ledger is not None and rid and not ledger.sent_this_round(rid):
        return f"reply to message {rid}, not sent this round (an earlier round's reply)"
    return ""


def node_gone(msg: Message) -> bool:
    """Whether ``msg`` is an error reply saying its node is gone (Flower's NODE_UNAVAILABLE,
    sent by the SuperLink for a node that stopped answering), not an error of the node."""
    return msg.has_error() and msg.error.code == ErrorCode.NODE_UNAVAILABLE
