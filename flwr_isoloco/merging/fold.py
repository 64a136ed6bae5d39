"""A round's merge folded reply by reply (RoundFold), for every rule (streaming or not).

:class:`RoundMerge` computes the round's merged pseudo-gradient

    g = rule(delta_1..delta_M; w)           (orthogonalize="gradient")
    g = mean(delta_1..delta_M; w)           (orthogonalize="update": the rule acts on u later)

over the float entries of the model, folding streaming rules one reply at a time (each reply's
tensors are released once folded) and collecting the ``M`` deltas for the others. It also
owns the two rule-dependent pieces of the outer step: the DARE seed of a round,
``seed * 1_000_003 + round`` (so every round draws new, reproducible masks), and the
orthogonalised-update transform ``u -> rule([u])`` used with ``orthogonalize="update"``.

:class:`RoundFold` is the same merge fed one reply at a time, as replies arrive: a streaming
rule folds each delta into an :class:`~.streaming.OrderFreeMean` (the result does not depend on
the arrival order), any other rule, a robust aggregation (:mod:`.robust`, which replaces the
mean), or a round whose weights or norms are only known at the end, spills each delta to a
private :class:`~.spill.SpillStore` and merges tensor by tensor when the round closes. Server
memory is one model copy plus ``O(M x largest tensor)``; for a rule with a row-block form
(:attr:`~.rules.MergeRule.rows`: TIES) one model copy plus one tensor plus a fixed block
budget, whatever ``M``.

A reply is any object with ``node_id``, ``update(theta) -> dict`` (its ``delta_i``) and
``release()`` (e.g. :class:`flwr_isoloco.strategies.core.replies.CheckedReply`); this module imports
no Flower.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch

from .device import on_device_or_cpu, resolve_device
from .dp import GaussianSum
from .merge import merge
from .rules import MERGE_RULES, check_options, rule_applies
from .spill import SpillStore
from .streaming import OrderFreeMean, StreamingMerger
from .validation import all_finite, normalised_weights

__all__ = ["DARE_SEED_STRIDE", "RoundFold", "RoundMerge", "finite_or_raise"]

DARE_SEED_STRIDE = 1_000_003
"""DARE's seed in round ``r`` is ``seed * DARE_SEED_STRIDE + r`` (a prime stride: no overlap)."""

Tensors = dict[str, torch.Tensor]


def finite_or_raise(g: Tensors) -> Tensors:
    """``g`` itself, or ``ValueError`` naming the first tensor with non-finite values."""
    for k, t in g.items():
        if not all_finite(t):
            raise ValueError(f"merged tensor {k!r} has non-finite values")
    return g


class RoundMerge:
    """The merge of one strategy: rule, options, ``orthogonalize`` and seed (module docstring)."""

    def __init__(
        self,
        rule: Any,
        name: str,
        options: Mapping[str, Any],
        orthogonalize: str = "gradient",
        seed: int = 0,
        device: str | torch.device | None = "auto",
        robust: Any = None,
    ) -> None:
        self.rule, self.name = rule, name
        self.options = dict(options)
        self.orthogonalize = orthogonalize
        self.seed = seed
        self.device = resolve_device(device)  # where a round's merge computes (results on CPU)
        self.robust = robust  # a robust.RobustMerge, or None: replaces the mean (robust.py)

    def round_options(self, server_round: int) -> dict[str, Any]:
        """The rule's options for ``server_round`` (DARE: a per-round seed unless given)."""
        opts = dict(self.options)
        if self.name == "dare" and "seed" not in opts:
            opts["seed"] = self.seed * DARE_SEED_STRIDE + server_round
        return opts

    def rule_for_g(self) -> Any:
        """The rule that forms ``g``: the mean when the rule orthogonalises the update."""
        return MERGE_RULES["mean"] if self.orthogonalize == "update" else self.rule

    def update_transform(self, server_round: int) -> Callable[[Tensors], Tensors] | None:
        """``u -> rule([u])`` for ``orthogonalize="update"``, else None. It computes on the
        merge device, and on the CPU when that runs out of memory, as the round merge does
        (:func:`~.device.on_device_or_cpu`)."""
        if self.orthogonalize != "update":
            return None
        opts = self.round_options(server_round)

        def transform(u: Tensors) -> Tensors:
            def on(device: torch.device) -> Tensors:
                return merge(self.rule, [u], None, device=device, **opts)

            return on_device_or_cpu(on, self.device, "update transform", server_round)

        return transform

    def merge(
        self,
        theta: Mapping[str, torch.Tensor],
        source: Iterable[Any],
        used: list[Any],
        weight: Callable[[Any], float],
        server_round: int,
        rule: Any = None,
        buffers: Collection[str] = (),
    ) -> Tensors | None:
        """``g`` over ``source`` (float entries of ``theta`` only); appends the replies used.

        ``rule`` defaults to :meth:`rule_for_g`; keys in ``buffers`` (:mod:`.buffers`) take the
        weighted mean, never the rule. None when ``source`` is empty. Raises ``ValueError``
        when the rule fails or gives non-finite values.
        """
        rule = self.rule_for_g() if rule is None else rule
        floats = [k for k, t in theta.items() if t.is_floating_point()]
        plain = [k for k in floats if k in buffers]
        params = [k for k in floats if k not in buffers]
        opts = {} if self.orthogonalize == "update" else self.round_options(server_round)
        if getattr(rule, "streaming", False) and self.robust is None:
            merger, means = StreamingMerger(rule, **opts), StreamingMerger(MERGE_RULES["mean"])
            for r in source:
                d = r.update(theta)
                r.release()
                used.append(r)  # before add(): a reply that makes add() fail is a suspect
                for acc, keys in ((merger, params), (means, plain)):
                    if keys:
                        acc.add({k: d[k] for k in keys}, weight(r))
            if not used:
                return None
            g = {**(merger.result() if params else {}), **(means.result() if plain else {})}
            return finite_or_raise(g)
        deltas = []
        for r in source:
            d = r.update(theta)
            r.release()
            deltas.append({k: d[k] for k in floats})
            used.append(r)
        if not used:
            return None
        ws = [weight(r) for r in used]
        if self.robust is not None:
            g = self.robust.merge(rule, opts, floats, lambda i, k: deltas[i][k], ws)
            return finite_or_raise(g)
        g = merge(rule, [{k: d[k] for k in params} for d in deltas], ws, **opts) if params else {}
        if plain:
            g.update(merge(MERGE_RULES["mean"], [{k: d[k] for k in plain} for d in deltas], ws))
        return finite_or_raise(g)


class RoundFold:
    """One round's merge, fed reply by reply (module docstring).

    ``add(reply, weight)`` takes the reply's delta (``reply.update(theta)``, float entries),
    releases the reply's tensors and folds the delta (``weight`` is its merge weight) or spills
    it (``weight`` may then be None: it is asked again at :meth:`finish`). ``spill=True``
    forces spilling (weights or norms known only at the end, or a subset of the replies to be
    chosen at :meth:`finish`: a folded mean cannot drop a reply). :meth:`finish` returns ``g``;
    :meth:`close` removes the spill directory (:meth:`finish` calls it; use ``with``).

    ``buffers`` (:mod:`.buffers`): float keys merged as FedAvg merges them, the weighted mean
    of the deltas (same weights, same DP clipping and noise), never the rule. With a robust
    aggregation they take the same robust aggregate as the rest (the same choice of updates);
    the rules act on 2-D tensors only, so 1-D running statistics stay that aggregate.

    Out of memory (:func:`~.device.is_out_of_memory`) is not the replies' fault: the merge is
    retried on the CPU for the round (a logged warning), and a CPU that runs out too raises
    :class:`~.device.MergeOutOfMemoryError`, which no caller takes for a bad reply.
    """

    def __init__(
        self,
        merger: RoundMerge,
        theta: Mapping[str, torch.Tensor],
        server_round: int,
        *,
        spill: bool = False,
        spill_dir: str | None = None,
        dp: GaussianSum | None = None,
        buffers: Collection[str] = (),
    ) -> None:
        self.merger, self.theta, self.server_round = merger, theta, server_round
        self.dp = dp  # clip each delta, noise the sum (weights forced to 1; dp.py)
        if dp is not None and not getattr(merger.rule_for_g(), "streaming", False):
            raise ValueError(f"central DP needs a rule of the mean, not {merger.name!r}")
        self.rule = merger.rule_for_g()
        opts = {} if merger.orthogonalize == "update" else merger.round_options(server_round)
        self.device = merger.device  # the CPU after an out-of-memory error (_merge)
        self.opts = {**opts, "device": merger.device}  # for merge() and OrderFreeMean.result()
        self.floats = [k for k, t in theta.items() if t.is_floating_point()]
        self.buffers = frozenset(k for k in self.floats if k in buffers)  # the mean, no rule
        self.robust = getattr(merger, "robust", None)  # needs every delta: always spills
        if dp is not None and self.robust is not None:
            raise ValueError("central DP noises the mean; a robust aggregate is not the mean")
        self.spills = (
            bool(spill) or self.robust is not None or not getattr(self.rule, "streaming", False)
        )
        self._acc = None if self.spills else OrderFreeMean()
        self._store = SpillStore(spill_dir) if self.spills else None
        self._entry: dict[int, int] = {}  # id(reply) -> spill entry
        self.folded: list[Any] = []  # replies taken, in arrival order
        self.left_out: list[Any] = []  # replies the robust rule did not choose (last merge)

    def __enter__(self) -> RoundFold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def spill_bytes(self) -> int:
        """Bytes written to the spill directory this round."""
        return 0 if self._store is None else self._store.bytes_written

    def add(self, reply: Any, weight: float | None = None) -> None:
        """Fold or spill ``reply``'s delta; ``ValueError`` (nothing folded) for a bad delta."""
        d = reply.update(self.theta)
        reply.release()
        delta = {k: d[k] for k in self.floats}
        del d
        if self.dp is not None:
            delta, weight = self.dp.clip(delta), 1.0
        if self._store is not None:
            self._entry[id(reply)] = self._store.put(delta)
        else:
            assert self._acc is not None
            self._acc.add(delta, 1.0 if weight is None else weight)
        self.folded.append(reply)

    def finish(
        self,
        keep: list[Any],
        weight: Callable[[Any], float],
        reject: Callable[[Any, str], None],
        on_failure: Callable[[Exception], None] | None = None,
    ) -> tuple[Tensors | None, list[Any]]:
        """``(g, used)`` over the replies in ``keep`` (a subset of :attr:`folded`, in the order
        where order matters: content-digest order). A failed merge of spilled deltas drops the
        replies that fail alone (``reject(reply, reason)``) and merges the rest; a failed
        streaming merge drops the round's replies (their deltas are folded already).

        Without spilling, ``keep`` must be every folded reply: the folded mean has them all, so
        a strict subset would be reported as used while the others are in ``g``
        (``ValueError``; fold with ``spill=True`` to choose at the end)."""
        try:
            if not keep:
                return None, []
            self._check_keep(keep)
            try:
                return self._merge(keep, weight), list(keep)
            except (ValueError, RuntimeError) as exc:
                if on_failure is not None:
                    on_failure(exc)
                if self._store is None:
                    for r in keep:
                        reject(r, f"merge of the round failed, model kept: {exc}")
                    return None, []
            used = []
            for r in keep:
                try:
                    self._merge([r], weight)
                    used.append(r)
                except (ValueError, RuntimeError) as exc:
                    reject(r, f"merge fails on this reply: {exc}")
            if not used:
                return None, []
            try:
                return self._merge(used, weight), used
            except (ValueError, RuntimeError) as exc:
                for r in used:
                    reject(r, f"merge of the round failed, model kept: {exc}")
                return None, []
        finally:
            self.close()

    def _check_keep(self, keep: list[Any]) -> None:
        """``keep`` is a subset of :attr:`folded` (the whole of it unless spilled)."""
        folded = {id(r) for r in self.folded}
        ids = [id(r) for r in keep]
        if len(set(ids)) != len(ids) or not folded.issuperset(ids):
            raise ValueError("finish(keep): keep must name folded replies, each once")
        if self._store is None and len(ids) != len(folded):
            raise ValueError(
                f"finish(keep): {len(ids)} of {len(folded)} folded replies kept, but their "
                "deltas are folded into one mean; fold with spill=True to keep a subset"
            )

    def _merge(self, replies: list[Any], weight: Callable[[Any], float]) -> Tensors:
        """:meth:`_merge_on` on the merge device; on out of memory, again on the CPU, where the
        rest of the round stays (:func:`~.device.on_device_or_cpu`)."""

        def on(device: torch.device) -> Tensors:
            self.device, self.opts = device, {**self.opts, "device": device}
            return self._merge_on(replies, weight)

        return on_device_or_cpu(on, self.device, "merge", self.server_round)

    def _merge_on(self, replies: list[Any], weight: Callable[[Any], float]) -> Tensors:
        if self._store is None:
            assert self._acc is not None
            perturb = self._perturb(len(replies))
            g = self._acc.result(self.rule, perturb=perturb, plain=self.buffers, **self.opts)
            return finite_or_raise(g)
        ws = [1.0] * len(replies) if self.dp is not None else [weight(r) for r in replies]
        entries = [self._entry[id(r)] for r in replies]
        if self.robust is not None:
            store = self._store
            self.robust.last_kept = None
            g = self.robust.merge(
                self.rule,
                self.opts,
                self.floats,
                lambda i, k: store.get(entries[i], k),
                ws,
                rows=lambda i, k, a, b: store.rows(entries[i], k, a, b),
                shapes={k: self.theta[k].shape for k in self.floats},
            )
            kept = self.robust.last_kept
            self.left_out = (
                [] if kept is None else [r for i, r in enumerate(replies) if i not in kept]
            )
            return finite_or_raise(g)
        out: Tensors = {}
        for key in self.floats:
            if self._by_rows(key):
                out[key] = self._merge_rows(key, entries, ws)
                continue
            if key in self.buffers or getattr(self.rule, "streaming", False):
                acc = OrderFreeMean()  # one spilled delta read at a time
                for e, w in zip(entries, ws, strict=True):
                    acc.add({key: self._store.get(e, key)}, w)
                perturb, plain = self._perturb(len(replies)), self.buffers
                out[key] = acc.result(self.rule, perturb=perturb, plain=plain, **self.opts)[key]
            else:
                xs = [self._store.get(e, key) for e in entries]
                out[key] = merge(self.rule, [{key: x} for x in xs], ws, **self.opts)[key]
                del xs
        return finite_or_raise(out)

    def _perturb(self, used: int) -> Callable[[str, torch.Tensor], torch.Tensor] | None:
        dp = self.dp
        return None if dp is None else (lambda key, mean: dp.release(key, mean, used))

    def _rule_opts(self) -> dict[str, Any]:
        """The rule's own options (``self.opts`` less the merge device)."""
        return {k: v for k, v in self.opts.items() if k != "device"}

    def _by_rows(self, key: str) -> bool:
        """Whether ``key`` merges from row blocks read off the spill files (the rule has a
        ``rows`` form, e.g. TIES, and acts on this tensor)."""
        if getattr(self.rule, "rows", None) is None or key in self.buffers:
            return False
        _, pattern = check_options(self.rule, self._rule_opts())
        return rule_applies(key, self.theta[key], pattern)

    def _merge_rows(self, key: str, entries: list[int], ws: list[float]) -> torch.Tensor:
        """``merge(rule, deltas, ws)[key]`` bit for bit (same weights, dtype and device), with
        only a block of rows of each worker's tensor in memory (:attr:`MergeRule.rows`)."""
        assert self._store is not None
        store, t0 = self._store, self.theta[key]
        opts, _ = check_options(self.rule, self._rule_opts())
        norm = normalised_weights(ws, len(ws))
        used = [e for e, w in zip(entries, norm, strict=True) if w > 0]
        norm = [w for w in norm if w > 0]  # zero-weight workers take no part, as in merge()
        dev = self.device  # the strategy's merge device, or the CPU after out of memory
        cdt = torch.float64 if t0.dtype == torch.float64 else torch.float32

        def read(i: int, r0: int, r1: int | None) -> torch.Tensor:
            return store.rows(used[i], key, r0, r1).to(device=dev, dtype=cdt)

        merged = self.rule.rows(read, len(used), norm, key=key, **opts)
        return merged.to(device="cpu", dtype=t0.dtype)

    def close(self) -> None:
        """Free the accumulator and remove the spill directory (idempotent)."""
        if self._store is not None:
            self._store.close()
        if self._acc is not None:
            self._acc.release()
