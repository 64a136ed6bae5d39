"""One RW-LoRA hop: its bytes, the checks of its reply, a failed hop, the new token.

A hop is accepted only if a reply came and it passes, in order, the
:class:`~flwr_isoloco.strategies.core.replies.ReplyValidator` (keys, shapes, dtype, NaN/inf, update
norm), :func:`~flwr_isoloco.strategies.core.wire.check_train_metrics` against the vertex, the
relative bound ``||update|| <= max_norm_ratio x median`` of the last ``norm_window`` accepted
update norms (with at least 3), and, when carried, the optimiser-state check. Otherwise the
token stays, the vertex is excluded for the round's re-routes and its health is updated.
Bytes: relayed = instruction down + every reply up; P2P = the token when it moves.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.logger import log

from flwr_isoloco.merging.weights import norm_outlier
from flwr_isoloco.strategies.core.replies import CheckedReply
from flwr_isoloco.strategies.core.wire import (
    _record_of,
    check_train_metrics,
    decode_array,
    nonfinite_reason,
    record_nbytes,
    record_tensors,
)

__all__ = ["RWLoRAHops"]


class RWLoRAHops:
    """Mixin of :class:`~flwr_isoloco.strategies.RWLoRA`: the hop methods (module docstring)."""

    def _count_hop_bytes(self, v: Any, replies: list[Message]) -> None:
        """Relayed: the instruction down and every reply up; P2P: the token if it moved."""
        sent = record_nbytes(self.token)
        if self.carry_optimizer_state:
            sent += record_nbytes(self.optimizer_state)
        moved = self.walk.position != v  # a lazy self-loop stays on the node in P2P
        self.bytes_relayed += sent
        carried = self.carried_adapters() * record_nbytes(self.token)  # momentum, average
        self.bytes_p2p += sent + carried if moved else 0
        for r in replies:
            if r.has_content():
                self.bytes_relayed += record_nbytes(*r.content.array_records.values())

    def _check_hop(
        self, v: Any, replies: list[Message], expected: Mapping[str, torch.Tensor]
    ) -> tuple[str | None, tuple]:
        """``(reason to refuse, None)`` or ``(None, (reply, update, norm, optimizer record))``.

        Checks in order: a reply came; the validator (keys, shapes, dtype, NaN/inf, norm);
        the metrics against the vertex; ``||update|| <= max_norm_ratio x`` the median of the
        last ``norm_window`` accepted norms (needs 3); the carried optimizer state."""
        if not replies:
            return "no reply (timeout)", ()
        if len(replies) > 1:
            log(WARNING, "%s: %d replies for one hop; using the first", self.what, len(replies))
        checked, report = self.validator.validate(replies[:1], expected, self._ledger)
        if not checked:
            return (report.reasons[0][1] if report.reasons else "reply rejected"), ()
        reply: CheckedReply = checked[0]
        reason = check_train_metrics(
            reply.content,
            asked_steps=self.local_steps,
            vertex=v,
            vertex_key=self.checked_vertex_key,
        )
        update = reply.update(expected)
        norm = reply.update_norm  # tensor_norm(update), fp64, set by the validator
        recent = self.update_norms[-self.norm_window :]
        if reason is None:
            reason = norm_outlier(
                norm,
                recent,
                self.checks.max_norm_ratio,
                min_reference=3,
                reference=f"the last {len(recent)} accepted updates",
            )
        opt_rec = None
        if reason is None and self.carry_optimizer_state:
            opt_rec, reason = self._check_optimizer(reply.content)
        return reason, (reply, update, norm, opt_rec)

    def _fail_hop(self, v: Any, reason: str) -> None:
        """Count the failure, exclude ``v`` for this round's re-routes, maybe mark it dead."""
        node = self.vmap.node_of.get(v)
        self.failures += 1
        self.failures_by_vertex[v] = self.failures_by_vertex.get(v, 0) + 1
        self.excluded.append(v)
        self.failure_log = [*self.failure_log[-999:], (self._pending_round, v, reason)]
        log(
            WARNING,
            "%s: round %s: hop to vertex %r (node %s) failed: %s; token kept, re-routing",
            self.what,
            self._pending_round,
            v,
            node,
            reason,
        )
        period = self.health.record_failure(v, self._pending_round)
        if period is not None:
            log(
                WARNING,
                "%s: vertex %r (node %s) is dead (death %d in a row): skipped for %d rounds "
                "(until round %d); the walk moves on the live graph",
                self.what,
                v,
                node,
                self.health.strikes[v],
                period,
                self.health.dead_until[v],
            )

    def _take_token(
        self,
        v: Any,
        expected: Mapping[str, torch.Tensor],
        reply: CheckedReply,
        update: Mapping[str, torch.Tensor],
        norm: float,
        opt_rec: ArrayRecord | None,
    ) -> dict[str, float]:
        """The reply becomes the token (and optimizer state); the walk moves to ``v``."""
        if reply.payload == "delta":
            new = {k: expected[k].float() - update[k] for k in expected}
        else:
            new = {k: t.float() for k, t in reply.tensors().items()}
        new = self._variant_token(expected, {k: new[k] for k in expected})
        self.token = _record_of({k: new[k] for k in expected})
        if self.carry_optimizer_state:
            if opt_rec is None:
                log(WARNING, "%s: vertex %r sent no optimizer state; it is reset", self.what, v)
                self.optimizer_state, self.optimizer_config = None, None
            else:
                self.optimizer_state = opt_rec
                cfg = reply.content.config_records.get(self.optimizer_config_key)
                self.optimizer_config = ConfigRecord(dict(cfg)) if cfg is not None else None
        self.walk.move_to(v)
        self.health.record_success(v)
        self.relays += int(self._pending_relay)
        self.trajectory.append(v)
        self._visits[v] = self._visits.get(v, 0) + 1
        self.round_replies.append((v, dict(reply.metrics)))
        self.excluded = []
        self.update_norms.append(norm)
        self.update_norms = self.update_norms[-self.norm_window :]
        self.local_updates += int(reply.metrics.get("local-steps", self.local_steps))  # checked
        client = {
            k: float(x) for k, x in reply.metrics.items() if k not in ("local-steps", "walk-vertex")
        }
        return {**client, "hop-ok": 1, "update-norm": norm, "relay": int(self._pending_relay)}

    def _check_optimizer(self, content: RecordDict) -> tuple[ArrayRecord | None, str | None]:
        """``(record, None)``, ``(None, None)`` without one, or ``(None, reason)``.

        Every array must decode (:func:`~.wire.decode_array`), be floating or int32/int64 and
        finite, and match the previous hop's keys and shapes."""
        rec = content.array_records.get(self.optimizer_key)
        if rec is None:
            return None, None
        prev = record_tensors(self.optimizer_state) if self.optimizer_state is not None else None
        if prev is not None and set(prev) != set(rec.keys()):
            return None, "optimizer state keys differ from the previous hop's"
        for k, arr in rec.items():
            t = decode_array(k, arr, None if prev is None else tuple(prev[k].shape))
            if isinstance(t, str):
                return None, f"optimizer {t}"
            if not t.is_floating_point() and t.dtype not in (torch.int32, torch.int64):
                return None, f"optimizer array {k!r} has dtype {t.dtype}"
            if (why := nonfinite_reason(k, t)) is not None:
                return None, f"optimizer {why}"
        return rec, None
