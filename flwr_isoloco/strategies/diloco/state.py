"""DiLoCo's checkpoint state (``state_dict`` / ``load_state_dict``, no pickle) and summary.

``{"tensors": {"theta": fp32 master, "outer": momentum buffers}, "meta": JSON-able}``; meta
holds ``server_round``, the model dtypes, the outer optimiser's scalars, the sampling RNG and
the merge settings, which a resumed run must share (a checkpoint that disagrees is refused),
the divergence guard's reference loss (so a resumed run compares its first round with the
last one before the checkpoint) and the empty-round streak (so ``max_empty_rounds`` counts
across a resume). :meth:`DiLoCoState._round_snapshot` is the lighter copy that
``on_divergence="skip"`` restores: ``theta``, the outer optimiser, and what the skipped round's
replies moved (the weight bound's reference weight, the adaptive DP clipping norm).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from logging import INFO
from typing import Any

import torch
from flwr.common.logger import log

from flwr_isoloco.strategies.core.lifecycle import divergence_guard
from flwr_isoloco.strategies.diloco.setup import codec_request

__all__ = ["DiLoCoState", "log_summary"]


def _split_state(tree: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a nested dict into (tensors only, everything else) with the same nesting; the
    tensors are the same objects, not copies."""
    tensors: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, torch.Tensor):
            tensors[k] = v.detach()
        elif isinstance(v, Mapping):
            t, m = _split_state(v)
            if t or not m:
                tensors[k] = t
            if m:
                meta[k] = m
        else:
            meta[k] = v
    return tensors, meta


def _join_state(tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = dict(meta)
    for k, v in tensors.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _join_state(v, out[k])
        else:
            out[k] = v
    return out


def log_summary(s: Any) -> None:
    """Log a DiLoCo strategy's configuration, Flower-style (``Strategy.summary``)."""
    log(INFO, "\t├──> Sampling:")
    log(
        INFO,
        "\t│\t├──Fraction: train (%.2f) | evaluate ( %.2f)",
        s.fraction_train,
        s.fraction_evaluate,
    )
    log(
        INFO,
        "\t│\t├──Minimum nodes: train (%d) | evaluate (%d)",
        s.min_train_nodes,
        s.min_evaluate_nodes,
    )
    log(INFO, "\t│\t└──Minimum available nodes: %d", s.min_available_nodes)
    log(
        INFO,
        "\t├──> Merge: %s %s (%s) | robust %s %s",
        s.merge_name,
        s.merge_options,
        s.orthogonalize,
        s.robust,
        s.robust_options,
    )
    log(
        INFO,
        "\t├──> Outer SGD: lr %g | momentum %g | nesterov %s",
        s.outer.lr,
        s.outer.momentum,
        s.outer.nesterov,
    )
    log(
        INFO,
        "\t├──> Replies: weighting %s | payload %s | max-update-norm %s | max-norm-ratio %s"
        " | max-weight-ratio %s",
        s.weighting,
        s.payload,
        s.train_validator.max_update_norm,
        s.train_validator.max_norm_ratio,
        s.max_weight_ratio or "off",
    )
    a = getattr(s, "async_rounds", None)
    if a is not None:
        r = a.settings
        log(
            INFO,
            "\t├──> Rounds: asynchronous | replies per step %s | max-staleness %d"
            " | staleness (1+tau)^-%g | momentum every %d outer steps | hold %g x a task",
            r.replies_per_step or "nodes",
            r.max_staleness,
            r.staleness,
            r.momentum_every,
            r.hold,
        )
    log(INFO, "\t├──> Uploads: codec %s %s", s.upload_codec, codec_request(s.upload))
    log(INFO, "\t└──> Keys in records:")
    log(INFO, "\t\t├── Weighted by: '%s'", s.weighted_by_key)
    log(INFO, "\t\t├── ArrayRecord key: '%s'", s.arrayrecord_key)
    log(INFO, "\t\t└── ConfigRecord key: '%s'", s.configrecord_key)


class DiLoCoState:
    """Mixin of :class:`~flwr_isoloco.strategies.DiLoCo` holding its checkpoint methods."""

    theta: dict[str, torch.Tensor] | None
    server_round: int
    book: Any  # DiLoCo's RoundBook (the empty-round guard)

    def state_dict(self) -> dict[str, Any]:
        """``{"tensors": nested dict of tensors, "meta": JSON-able dict}`` (no pickle needed).

        Holds ``theta`` (fp32 master), model dtypes, the outer optimiser (buffers, steps, hyper
        parameters), ``server_round`` and the sampling RNG. Save with
        ``flwr_isoloco.checkpoint.save_checkpoint(path, sd["tensors"], sd["meta"])``.

        The tensors are the strategy's own, not copies (at 135M a copy of ``theta`` and the
        momentum is 1 GiB): each outer step replaces ``theta`` and the buffers with new tensors
        and never changes them in place, so the dict stays this round's state after later
        rounds; :meth:`load_state_dict` copies what it restores. Do not modify them in place.
        """
        if self.theta is None:
            raise ValueError("state_dict(): no global model yet (start() not called)")
        outer_t, outer_m = _split_state(self.outer.state_dict(copy=False))
        version, internal, gauss = self._rng.getstate()
        return {
            "tensors": {"theta": dict(self.theta), "outer": outer_t},
            "meta": {
                "server_round": self.server_round,
                "dtypes": {k: str(v).replace("torch.", "") for k, v in self.dtypes.items()},
                "outer": outer_m,
                "rng": [version, list(internal), gauss],
                "merge": self.merge_name,
                "merge_options": self.merge_options,
                "orthogonalize": self.orthogonalize,
                "divergence": divergence_guard(self).state(),
                "empty_streak": self.book.guard.streak,
            },
        }

    def _round_snapshot(self) -> dict[str, Any]:
        """What ``on_divergence="skip"`` puts back, cloned: ``theta``, the outer optimiser
        (momentum buffers, step count), the weight bound's reference weight (the median weight
        of the last used round: the skipped round's must not bound the next one) and the
        adaptive DP clipping norm ``C`` (moved by the skipped round's update norms). Round
        counter, sampling RNG, guards and the DP accountant go on: the round was sent and its
        noisy sum released, so its privacy cost stays counted."""
        if self.theta is None:
            raise ValueError("round snapshot: no global model yet")
        dp = getattr(self, "dp", None)
        return {
            "theta": {k: v.clone() for k, v in self.theta.items()},
            "outer": self.outer.state_dict(),
            "weight_reference": getattr(self, "weight_reference", None),
            "dp_clipping_norm": None if dp is None else dp.c,
        }

    def _restore_round_snapshot(self, snapshot: Mapping[str, Any]) -> None:
        """Put back :meth:`_round_snapshot` (bitwise: the model, momentum, reference weight and
        clipping norm from before the round)."""
        self.theta = dict(snapshot["theta"])
        self.outer.load_state_dict(snapshot["outer"])
        if "weight_reference" in snapshot:
            self.weight_reference = snapshot["weight_reference"]
        dp = getattr(self, "dp", None)
        if dp is not None and snapshot.get("dp_clipping_norm") is not None:
            dp.c = snapshot["dp_clipping_norm"]

    @staticmethod
    def _state_spec() -> dict[str, Any]:
        """The fields :meth:`load_state_dict` needs in ``meta`` (types and ranges)."""
        from flwr_isoloco.checkpoint.spec import Field

        number = Field("float", min=0)
        outer = {"lr": number, "momentum": number, "nesterov": Field("bool")}
        return {
            "server_round": Field("int", min=0),
            "dtypes": Field("dict", values=Field("str")),
            "outer": Field("dict", fields={**outer, "steps": Field("int", min=0)}),
            "rng": Field("list", length=3),
            "merge": Field("str"),
            "merge_options": Field("dict", optional=True),
            "orthogonalize": Field("str", optional=True),
            "divergence": Field("dict", optional=True, values=Field("float")),
            "empty_streak": Field("int", min=0, optional=True),
        }

    def _check_settings(self, meta: Mapping[str, Any]) -> None:
        """Saved merge rule/options, ``orthogonalize`` and outer hyper-parameters must be ours."""
        import json

        from flwr_isoloco.checkpoint.spec import CheckpointError

        if meta["merge"] != self.merge_name:
            raise CheckpointError(
                f"checkpoint was written with merge {meta.get('merge')!r}, "
                f"this strategy uses {self.merge_name!r}"
            )
        saved = {
            "merge_options": meta.get("merge_options", {}),
            "orthogonalize": meta.get("orthogonalize", self.orthogonalize),
            **{f"outer.{k}": meta["outer"][k] for k in ("lr", "momentum", "nesterov")},
            "outer.delay": meta["outer"].get("delay", 1),
        }
        ours = {
            "merge_options": json.loads(json.dumps(self.merge_options)),
            "orthogonalize": self.orthogonalize,
            "outer.lr": self.outer.lr,
            "outer.momentum": self.outer.momentum,
            "outer.nesterov": self.outer.nesterov,
            "outer.delay": self.outer.delay,
        }
        for name, value in saved.items():
            if value != ours[name]:
                raise CheckpointError(
                    f"field {name!r} = {value!r} differs from this strategy's {ours[name]!r}; "
                    "a resumed run must use the same settings"
                )

    def load_state_dict(
        self, state: Mapping[str, Any], reference: Mapping[str, Any] | None = None
    ) -> None:
        """Restore :meth:`state_dict` output (tensors and meta may come from a checkpoint).

        Everything is checked before anything is set, and a failure is a
        :class:`~flwr_isoloco.checkpoint.CheckpointError` (a ``ValueError``) naming the field or
        tensor: meta types and ranges; ``theta`` and the outer momentum buffers finite, buffers
        only for ``theta``'s names with ``theta``'s shapes; with ``reference`` (the model's
        state dict, name -> tensor), ``theta`` has its names, shapes and dtypes. The saved merge
        rule, merge options, ``orthogonalize`` and outer ``lr``/``momentum``/``nesterov`` must
        equal this strategy's: a resumed run uses the settings it was built with, so a
        checkpoint that disagrees is refused rather than silently overriding them.
        """
        from flwr_isoloco.checkpoint.spec import CheckpointError, check_fields, check_tensors

        if not isinstance(state, Mapping) or "tensors" not in state or "meta" not in state:
            raise CheckpointError("DiLoCo state must be a dict with 'tensors' and 'meta'")
        tensors, meta = state["tensors"], state["meta"]
        if not isinstance(tensors, Mapping):
            raise CheckpointError("DiLoCo state: 'tensors' must be a dict")
        check_fields(dict(meta) if isinstance(meta, Mapping) else meta, self._state_spec())
        self._check_settings(meta)
        dtypes = {}
        for k, v in meta["dtypes"].items():
            dt = getattr(torch, v, None)
            if not isinstance(dt, torch.dtype):
                raise CheckpointError(f"field 'dtypes.{k}' is {v!r}, not a torch dtype")
            dtypes[k] = dt
        theta = tensors.get("theta")
        check_tensors(theta, None, "theta")  # a group of finite tensors
        if set(theta) != set(dtypes):
            odd = sorted(set(theta) ^ set(dtypes), key=str)[0]
            raise CheckpointError(f"tensor 'theta/{odd}' and field 'dtypes' disagree on names")
        if reference is not None:
            check_tensors(theta, reference, "theta")
            bad = [k for k, t in reference.items() if t.dtype != dtypes[k]]
            if bad:
                raise CheckpointError(
                    f"field 'dtypes.{bad[0]}' is {meta['dtypes'][bad[0]]!r}, the model's is "
                    f"{str(reference[bad[0]].dtype).replace('torch.', '')!r}"
                )
        if self.theta is not None:
            check_tensors(theta, self.theta, "theta")
        outer_t = tensors.get("outer", {})
        buffers = outer_t.get("momentum_buffer", {}) if isinstance(outer_t, Mapping) else None
        check_tensors(buffers, None, "outer/momentum_buffer")
        check_tensors(
            buffers, {k: theta[k] for k in buffers if k in theta}, "outer/momentum_buffer"
        )
        acc = outer_t.get("accumulator", {})  # delayed momentum (OuterSGD delay > 1)
        check_tensors(acc, None, "outer/accumulator")
        check_tensors(acc, {k: theta[k] for k in acc if k in theta}, "outer/accumulator")
        version, internal, gauss = meta["rng"]
        try:
            rng = random.Random()
            rng.setstate((version, tuple(internal), gauss))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"field 'rng' is not a valid generator state ({exc})") from None
        self.outer.load_state_dict(_join_state(outer_t, meta["outer"]))
        # Keep the model's own key order (a checkpoint may sort keys; clients may care).
        self.theta = {k: theta[k].detach().clone() for k in dtypes}
        self._dtypes = dtypes
        self._rng.setstate(rng.getstate())
        self.server_round = meta["server_round"]
        divergence_guard(self).load_state(meta.get("divergence", {}))
        self.book.guard.streak = meta.get("empty_streak", 0)  # absent in older checkpoints
