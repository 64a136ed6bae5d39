"""Compressed downloads: the broadcast model ``B``, its version digest, per-node bookkeeping.

The server keeps ``B``, the model every up-to-date node holds. Each train round
(:meth:`Broadcast.advance`)::

    u  = Q(theta - B)
    B <- B + decode(u)                # exactly the node's arithmetic, in B's dtypes

The gap ``theta - B`` is the error-feedback residual itself: whatever a round does not send stays
in it and goes out in a later round, undecayed, so nothing is lost. (Adding a separate residual
``beta e`` on top, as uploads do, would count the unsent part twice: ``theta - B`` already
holds it. An entry left unsent for n rounds would then go out up to ``1 / (1 - beta)`` times too
large.) ``ef_decay`` therefore has no effect on downloads.

Protocol (config keys of the instruction, one ConfigRecord entry in the reply):

- ``download-digest``: the sha256 digest of ``B`` after the node applies the message;
- ``download-base``: the digest of the copy the arrays apply to, ``""`` = the arrays are the
  full ``B``;
- the reply carries ``ConfigRecord({"held": digest})`` under ``download`` (REPLY_RECORD).

The server sends the update ``u`` only to a node whose last reported digest equals the
previous ``B``, an empty record to a node already holding the current ``B`` (evaluation after
training), else the full ``B``. With ``nodes_hold_initial`` every node is taken to hold the first
``B`` (the initial model) until it says otherwise: each builds it itself (the same seed, or the
same pretrained checkpoint every site loads from its own disk or hub), so round 1 sends no
arrays; the node's ``download_mod`` checks its build against the announced digest. A node whose copy's digest differs from ``download-base`` refuses
(an error reply), and a node whose result's digest differs from ``download-digest`` refuses too:
nobody trains on a model other than ``B``, silently. A refusal of an update (not of the full
``B``) has the code ``NEEDS_FULL_CODE`` and a reason starting ``NEEDS_FULL`` (it names the digest
the node holds, or none): the server answers it within the round with the full ``B``
(:func:`asks_for_full`), so a node that lost its copy (a restart) still trains that round.

Exact downloads (codec ``"exact"``, :mod:`.step`): the update is the round's step record, the
peers' own upload messages from which a node takes the server's step itself, and ``B`` is the
server's model bit for bit (:meth:`Broadcast.stepped` makes the server's step the nodes'
arithmetic). A round whose step is not such a record (no step, a step the divergence guard put
back, a reply that was not compressed) sends the full model to any node not already holding
it; so does a round whose record is larger than the full model (many peers, dense uploads).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, Message
from flwr.common.constant import ErrorCode

from flwr_isoloco.compression.record import (
    compress,
    decompress,
    json_array,
    json_header,
    nest,
    normalize_options,
    payload_nbytes,
    unnest,
)
from flwr_isoloco.compression.step import EXACT, decode_step, is_step

DIGEST_KEY = "download-digest"
BASE_KEY = "download-base"
REPLY_RECORD = "download"
HELD_KEY = "held"
NEEDS_FULL_CODE = ErrorCode.MOD_FAILED_PRECONDITION  # the mod's precondition: holding the base
NEEDS_FULL = "download_mod needs the full model"
CHAIN_KEY = "__chain__"
MAX_LINKS = 32
"""Most versions a node may be behind and still get updates (a chain) instead of the model."""


def model_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, names sorted."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach().contiguous().cpu()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def apply_update(
    base: Mapping[str, torch.Tensor], decoded: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``B + decode(u)`` in B's dtypes (fp32 sum); ValueError on other names or shapes."""
    if set(decoded) != set(base):
        raise ValueError("update and stored model name different tensors")
    out = {}
    for k, b in base.items():
        d = decoded[k]
        if d.shape != b.shape:
            raise ValueError(f"update of {k!r} has shape {tuple(d.shape)}, model {tuple(b.shape)}")
        out[k] = (b.float() + d.float()).to(b.dtype)
    return out


def decode_update(
    record: ArrayRecord, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """The update a download carries, decoded and checked against the model's ``shapes``: an
    exact step record (:func:`~.step.decode_step`) or a compressed ``Q(theta - B)``."""
    if is_step(record):
        return decode_step(record, shapes)
    return decompress(record, shapes=shapes)


def chain(updates: list[ArrayRecord]) -> ArrayRecord:
    """The updates of consecutive versions as one record: ``CHAIN_KEY`` (JSON ``{"links": n}``)
    and link ``j``'s arrays under ``"l<j>:<key>"`` (:func:`~.record.nest`)."""
    return ArrayRecord({CHAIN_KEY: json_array({"links": len(updates)}), **nest(updates, "l")})


def _links(record: ArrayRecord) -> list[ArrayRecord]:
    """The updates of a :func:`chain` record, checked: a small header, link numbers in range,
    no stray arrays (each link is then checked by :func:`decode_update`)."""
    head = json_header(record, CHAIN_KEY, limit=4096)
    n = head.get("links") if isinstance(head, dict) else None
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_LINKS:
        raise ValueError(f"{CHAIN_KEY!r}: header must be {{'links': 1..{MAX_LINKS}}}")
    return unnest(record, "l", n, {CHAIN_KEY})


def apply_download(
    held: Mapping[str, torch.Tensor], record: ArrayRecord
) -> dict[str, torch.Tensor]:
    """The model after a download's update(s): ``B + decode(u)``, or for a :func:`chain` each
    link applied in turn, as the server advanced ``B`` (ValueError on a bad record)."""
    shapes = {k: tuple(v.shape) for k, v in held.items()}
    links = _links(record) if CHAIN_KEY in record else [record]
    out = dict(held)
    for link in links:
        out = apply_update(out, decode_update(link, shapes))
    return out


def reply_digest(msg: Message) -> str | None:
    """The digest a reply says its node holds, or None (error reply, absent, not a string)."""
    if msg.has_error():
        return None
    rec = msg.content.config_records.get(REPLY_RECORD)
    held = None if rec is None else rec.get(HELD_KEY)
    return held if isinstance(held, str) and len(held) == 64 else None


def asks_for_full(msg: Message) -> bool:
    """Whether ``msg`` is a node's refusal of an update that the full ``B`` answers (module
    docstring: code ``NEEDS_FULL_CODE``, reason starting ``NEEDS_FULL``)."""
    if not msg.has_error() or msg.error.code != NEEDS_FULL_CODE:
        return False
    return (msg.error.reason or "").startswith(NEEDS_FULL)


class Broadcast:
    """Server side of compressed downloads (module docstring): ``B``, ``e``, nodes' digests."""

    def __init__(
        self, codec: str, options: Mapping[str, Any], *, nodes_hold_initial: bool = False
    ) -> None:
        self.codec = codec
        self.exact = codec == EXACT
        self.nodes_hold_initial = nodes_hold_initial
        self.assumed = ""  # the digest a node not heard from is taken to hold
        self.options = {} if self.exact else normalize_options(codec, dict(options))
        self.history: list[tuple[str, str, ArrayRecord, int]] = []  # (from, to, update, bytes)
        self._chains: dict[int, ArrayRecord] = {}  # first link -> chain record (this version)
        self.step: ArrayRecord | None = None  # exact: the round's step record, for stepped()
        self.pending: tuple[ArrayRecord, dict[str, torch.Tensor]] | None = None  # and decoded
        self.base: dict[str, torch.Tensor] | None = None
        self.digest = ""
        self.prev = ""
        self.update: ArrayRecord | None = None
        self.held: dict[int, str] = {}  # node -> digest of its copy, from its last reply
        self.version: Any = None  # the caller's name for the model B last advanced towards
        self._full: ArrayRecord | None = None

    def advance(self, theta: Mapping[str, torch.Tensor], dtypes: Mapping[str, Any]) -> None:
        """A new round: ``B`` becomes ``B + decode(Q(theta - B))`` (first: ``theta``)."""
        first = self.base is None
        if first:
            self.base = {k: v.to(dtypes.get(k, v.dtype)).clone() for k, v in theta.items()}
            self.prev, self.update = "", None
        elif self.exact:
            self.prev = self.digest
            self.update, self.base = self._exact_update(theta, dtypes)
        else:
            delta = {k: theta[k].float() - self.base[k].float() for k in self.base}
            self.update = compress(delta, self.codec, **self.options)
            self.base = apply_update(self.base, decompress(self.update))
            self.prev = self.digest
        bad = [k for k, v in self.base.items() if not v.is_floating_point()]
        if bad:
            raise ValueError(f"compressed downloads need floating tensors, got {bad[:3]}")
        self.digest = model_digest(self.base)
        if first and self.nodes_hold_initial:
            self.assumed = self.digest
        self._full, self._chains = None, {}
        self._remember()

    def _remember(self) -> None:
        """Add this version's update to :attr:`history` (none: the chain breaks), keeping at
        most ``MAX_LINKS`` links and less than the full model's bytes in all (a longer chain
        would never be sent: the full model is smaller)."""
        if self.update is None or not self.prev:
            self.history = []
            return
        self.history.append((self.prev, self.digest, self.update, payload_nbytes(self.update)))
        full = self._full_nbytes()
        while self.history and (
            len(self.history) > MAX_LINKS or sum(h[3] for h in self.history) >= full
        ):
            self.history.pop(0)

    def _full_nbytes(self) -> int:
        assert self.base is not None
        return sum(v.numel() * v.element_size() for v in self.base.values())

    def stepped(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The server's new ``params`` (fp32) after the round's exact step :attr:`step`:
        ``p + d`` in ``B``'s dtypes (:func:`apply_update`, the nodes' arithmetic), so that the
        next :meth:`advance` finds ``B + d`` equal to them and sends the record."""
        assert self.base is not None and self.step is not None
        record, self.step = self.step, None
        d = decode_step(record, {k: tuple(b.shape) for k, b in self.base.items()})
        self.pending = (record, d)
        base = {k: params[k].to(self.base[k].dtype) for k in params}
        return {k: v.float() for k, v in apply_update(base, {k: d[k] for k in params}).items()}

    def _exact_update(self, theta, dtypes) -> tuple[ArrayRecord | None, dict[str, torch.Tensor]]:
        """``(update, B)`` of an exact download: the pending step when ``B + d`` is ``theta``
        bit for bit, else no update (nodes not holding ``theta`` get the full model)."""
        assert self.base is not None
        pending, self.pending = self.pending, None
        if pending is not None and set(pending[1]) == set(self.base):
            cand = apply_update(self.base, pending[1])
            if all(torch.equal(cand[k], theta[k].to(cand[k].dtype)) for k in cand):
                return pending[0], cand
        return None, {k: v.to(dtypes.get(k, v.dtype)).clone() for k, v in theta.items()}

    def full(self) -> ArrayRecord:
        """``B`` as an ArrayRecord (built once per version)."""
        assert self.base is not None
        if self._full is None:
            self._full = ArrayRecord({k: v.clone() for k, v in self.base.items()})
        return self._full

    def for_node(self, node: int) -> tuple[ArrayRecord, dict[str, str]]:
        """What ``node`` gets (module docstring) and the config entries that describe it: the
        updates since the version it holds (one, or a chain of them: :func:`chain`) when
        :attr:`history` reaches back to it, else the full ``B``."""
        held = self.held.get(node, self.assumed)
        entries = {DIGEST_KEY: self.digest}
        if held == self.digest:
            return ArrayRecord(), {**entries, BASE_KEY: self.digest}
        starts = [i for i, h in enumerate(self.history) if held and h[0] == held]
        if starts:
            links = self.history[starts[0] :]
            if sum(h[3] for h in links) < self._full_nbytes():
                if len(links) == 1:
                    return links[0][2], {**entries, BASE_KEY: held}
                if starts[0] not in self._chains:
                    self._chains[starts[0]] = chain([h[2] for h in links])
                return self._chains[starts[0]], {**entries, BASE_KEY: held}
        return self.full(), {**entries, BASE_KEY: ""}

    def note(self, node: int, msg: Message) -> None:
        """Record the digest ``node`` reported (none: it holds no known copy, and is no longer
        taken to hold the initial model either)."""
        self.held[node] = reply_digest(msg) or ""

    def state_dict(self) -> dict[str, Any]:
        """``B`` and its digest (the residual ``theta - B`` follows from theta; the per-node
        digests are not kept: after a resume every node gets the full ``B`` once)."""
        return {
            "base": None if self.base is None else {k: v.clone() for k, v in self.base.items()},
            "digest": self.digest,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore, checked as hostile input: tensors finite and floating, digest matching."""
        base = state.get("base")
        if base is not None:
            if not isinstance(base, Mapping) or not all(
                isinstance(v, torch.Tensor) and v.is_floating_point() for v in base.values()
            ):
                raise ValueError("broadcast state: 'base' is not a mapping of floating tensors")
            if not all(bool(torch.isfinite(v).all()) for v in base.values()):
                raise ValueError("broadcast state: 'base' has non-finite entries")
            if model_digest(base) != state.get("digest"):
                raise ValueError("broadcast state: 'base' does not match its digest")
            base = {k: v.clone() for k, v in base.items()}
        self.base, self.digest = base, str(state.get("digest", "")) if base is not None else ""
        self.prev, self.update, self.held, self._full = "", None, {}, None
        self.history, self._chains = [], {}
        self.assumed, self.version, self.pending = (
            "",
            None,
            None,
        )  # a resumed B is not the nodes' initial model
