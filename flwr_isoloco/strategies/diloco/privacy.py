"""Central differential privacy for DiLoCo / IsoLoCo: settings, accounting, checkpoint state.

The mechanism (:mod:`flwr_isoloco.merging.dp`) clips each site's pseudo-gradient to ``C`` and
adds ``N(0, (z C)^2)`` to the round's sum before the outer optimiser, so the outer momentum,
Iso-C and the model are post-processing. Each round that releases an update is one Gaussian
mechanism of multiplier ``z`` on a sum whose sensitivity to adding or removing one site's
whole contribution is ``C``; Flower's :class:`~flwr.serverapp.RdpAccountant` composes them with
no sampling amplification (the nodes are not Poisson-sampled: ``fraction_train`` draws a fixed
number without replacement, and a site's presence is visible to the server anyway). The
accountant's population size is therefore irrelevant and set to 1 (each event ``(z, 1, 1)``).
With :class:`~flwr_isoloco.strategies.diloco.settings.LocalDP` the workers clip and noise their own deltas instead (any merge rule;
each site's epsilon uses multiplier ``z / 2``, the replace-one sensitivity ``2 C``).

Adaptive clipping (``CentralDP(adaptive=AdaptiveClipping(...))``, Andrew et al. 2021, "Differentially private
learning with adaptive clipping"): after round ``t`` the server, which clipped every update
itself, releases the noised *centred* count of the updates it clipped,
``s = sum_{i folded} (1[||delta_i|| <= C_t] - 1/2) + N(0, sigma_b^2)`` (a missing, rejected or
removed site adds 0, any other +-1/2: sensitivity 1/2), estimates the unclipped fraction as
``b = s / k + 1/2`` with ``k`` the sites sampled (public, fixed before any reply: adding ``k/2``
is post-processing) and sets ``C_{t+1} = C_t exp(-eta (b - gamma))``. The two Gaussian releases
of a round (sensitivity ``C_t``, std ``z_delta C_t``; sensitivity 1/2, std ``sigma_b``)
compose to one of multiplier ``z`` when ``z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (Flower's
``compute_adaptive_noise_params``), so the accountant still composes one ``z`` per round.
Every release is journaled before it leaves the server and its noise keyed by the attempt and a
fresh nonce per release (:mod:`~flwr_isoloco.strategies.diloco.dp_journal`): a redo, even from a
forked journal, never reuses released noise, and the release the checkpoint missed is charged on
resume.
The derivation is in the repository's ``docs/privacy.md`` ("Privacy"), with
the relation, the assumptions and what is not covered (client metrics, evaluation, counts).
"""

from __future__ import annotations

import math
import secrets
from typing import Any, NamedTuple

import torch
from flwr.serverapp.exception import PrivacyBudgetExhausted  # Flower's own (its DP wrappers')

from flwr_isoloco.merging.dp import CLIP_KEY, NOISE_KEY, GaussianSum
from flwr_isoloco.strategies.diloco import composition
from flwr_isoloco.strategies.diloco.dp_journal import DPJournal, charge_unsaved
from flwr_isoloco.strategies.diloco.dp_settings import DEFAULT_CLIP_LR, DEFAULT_DP_DELTA, DPSettings

__all__ = [
    "DEFAULT_DP_DELTA",
    "DP_MODES",
    "StrategyDP",
    "PrivacyBudgetExhausted",
    "noise_for_epsilon",
    "require_secagg",
    "secagg_problems",
]

DP_MODES = ("central", "local")
COUNT_NOISE_INDEX = 2**31 - 1  # noise stream of the clipped count (tensors use 0, 1, ...)


NEEDS_EVERY_DELTA_HINT = (
    "its output is not a function of the sum of the updates, so one site's influence is not "
    "bounded by clipping; use merge='mean' or an Iso-C rule, or client-side (local) DP "
    "(privacy=LocalDP(...))"
)


def _accountant(delta: float) -> Any:
    from flwr.serverapp import (
        NeighboringRelation,
        PrivacyConfig,
        RdpAccountant,
        SamplingMethod,
    )

    config = PrivacyConfig(
        target_delta=delta,
        population_size=1,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.NO_AMPLIFICATION,
    )  # max_epsilon is given per check, so a resumed run may raise it
    return RdpAccountant(config)


def _event(z: float) -> Any:
    from flwr.serverapp import GaussianPrivacyEvent

    return GaussianPrivacyEvent(noise_multiplier=z, sample_size=1, population_size=1)


def noise_for_epsilon(epsilon: float, rounds: int, delta: float, tol: float = 1e-3) -> float:
    """The smallest ``z`` (to ``tol`` relative) with epsilon(``rounds`` releases) <= ``epsilon``
    at ``delta``, by bisection on Flower's accountant (calibration only, no accounting here)."""

    def eps(z: float) -> float:
        a = _accountant(delta)
        a.compose(_event(z), rounds)
        return a.get_epsilon(delta)

    lo, hi = 1e-3, 1.0
    while eps(hi) > epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError(f"no noise multiplier reaches epsilon {epsilon} in {rounds} rounds")
    while hi - lo > tol * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if eps(mid) > epsilon else (lo, mid)
    return hi


def update_noise_multiplier(z: float, count_std: float) -> float:
    """``z_delta`` for the update sum so that it and the count noise ``count_std`` compose to
    multiplier ``z``: RDP of Gaussians adds, ``(sens/std)^2`` per mechanism, so with the sum's
    ``(1 / z_delta)^2`` and the centred count's ``(1/2 / count_std)^2``,
    ``z^-2 = z_delta^-2 + (2 count_std)^-2`` (Flower's ``compute_adaptive_noise_params``,
    which checks ``z < 2 count_std``). Valid only because the count is centred
    (:meth:`StrategyDP.next_clipping_norm`)."""
    from flwr.supercore.differential_privacy import compute_adaptive_noise_params

    return compute_adaptive_noise_params(z, 1, count_std)[1]


class ParsedDP(NamedTuple):
    """What :meth:`StrategyDP.parse_state` read (``run_id`` None: keep the current one)."""

    accountant: Any
    noise_key: int
    c: float | None
    run_id: str | None = None


class StrategyDP:
    """The DP settings of one strategy and its accountant (module docstring).

    ``settings``: :class:`~flwr_isoloco.strategies.diloco.settings.CentralDP` (the server clips
    and noises the sum, :class:`GaussianSum`), :class:`~.settings.LocalDP` (each worker clips
    and noises its own delta before compression, :func:`~flwr_isoloco.merging.dp.privatize`,
    asked through the train config and echoed in its reply: a reply without the echo is
    dropped; any merge rule is then post-processing), or None (DP off). The settings checked
    their own fields; ``noise_multiplier`` 0 with a clipping norm: clipping only, epsilon
    infinite (no accountant).
    """

    def __init__(self, settings: DPSettings | None = None) -> None:
        self.settings = settings
        on = settings is not None
        self.mode = settings.mode if on else "central"
        self.z = float(settings.noise_multiplier) if on and settings.noise_multiplier else None
        self.c = float(settings.clipping_norm) if on else None
        self.max_epsilon = float(settings.max_epsilon) if on and settings.max_epsilon else None
        self.delta = settings.delta if on else DEFAULT_DP_DELTA
        seed = settings.seed if on else None
        # The noise key must stay secret: whoever knows it can regenerate and subtract the noise.
        # None (default): drawn from the OS; kept in the checkpoint so a resumed run draws the
        # same noise. An int (tests, benchmarks) makes the noise reproducible from it.
        self.noise_key = secrets.randbits(63) if seed is None else seed
        self.fixed_key = seed is not None  # reproducible noise: no per-release nonce
        # The run's id in the DP journal and the checkpoint; attempt: the noise's attempt key.
        self.run_id, self.journal, self.attempt = secrets.token_hex(8), None, 0
        self.uniform_forced = False  # weighting='examples' was overridden (said in describe())
        self.accountant = None if self.z is None else _accountant(self.delta)
        self.last: GaussianSum | None = None
        # Published: only what a mechanism released (the noised unclipped fraction of adaptive
        # clipping); the exact count of clipped updates is what that release protects.
        self.released_fraction: float | None = None
        self.quantile, self.clip_lr, self.count_std = None, DEFAULT_CLIP_LR, None
        self.z_update = self.z  # the update sum's multiplier (z_delta under adaptive clipping)
        adaptive = getattr(settings, "adaptive", None)
        if adaptive is not None:  # CentralDP checked: noise_multiplier > 0, < 2 count_std
            self.quantile, self.clip_lr = float(adaptive.quantile), float(adaptive.lr)
            self.count_std = float(adaptive.count_std)
            self.z_update = update_noise_multiplier(self.z, self.count_std)

    @property
    def enabled(self) -> bool:
        """Whether updates are clipped (and noised when ``z > 0``)."""
        return self.c is not None

    def check_strategy(self, s: Any) -> None:
        """Refuse the options under which one site's influence on the release is unbounded."""
        if not self.enabled or self.mode == "local":
            return
        if not getattr(s.merger.rule_for_g(), "streaming", False):
            raise ValueError(
                f"central DP (clipping_norm={self.c:g}) does not apply to merge={s.merge_name!r}: "
                + NEEDS_EVERY_DELTA_HINT
            )
        if getattr(s, "robust", "none") != "none":
            raise ValueError(
                f"central DP (clipping_norm={self.c:g}) refuses robust={s.robust!r}: its "
                "noise is sized for the mean's sensitivity C/k, and a robust aggregate has "
                "another one; set robust='none', or use client-side DP (privacy=LocalDP(...)), "
                "under which robust rules are allowed"
            )
        if s.train_validator.max_norm_ratio:
            raise ValueError(
                "central DP refuses max_norm_ratio: whether a reply is kept would depend on the "
                "other sites' norms (clipping to clipping_norm already bounds every update)"
            )
        r = s.checks.max_weight_ratio
        if r not in ("auto", None, 0):
            raise ValueError(
                f"central DP refuses ReplyChecks.max_weight_ratio={r!r}: its noise is sized for "
                "weights w_i = 1, so every reply weighs 1 and the bound would clip nothing; "
                "leave max_weight_ratio out (or 0) with central DP"
            )
        # A check reads, never writes: the strategy's weighting in force is uniform under central
        # DP (its effective_weighting). Said once, in the strategy summary (describe()), not per
        # construction, since every ClientApp rebuilds the strategy from the run config.
        self.uniform_forced = s.checks.weighting == "examples"

    def epsilon(self) -> float:
        """Epsilon spent so far at ``delta`` (0 before any release, inf without noise)."""
        if self.accountant is None:
            return math.inf
        if self.accountant.num_releases == 0:
            return 0.0
        return float(self.accountant.get_epsilon(self.delta))

    def before_round(self, server_round: int) -> None:
        """``PrivacyBudgetExhausted`` when releasing round ``server_round`` would pass the cap;
        local DP: then the round is journaled (its train messages are its release)."""
        if self.accountant is None:
            return
        if self.max_epsilon is not None and self.accountant.would_exceed(
            self._event(), self.max_epsilon
        ):
            raise PrivacyBudgetExhausted(
                f"round {server_round} would exceed max_epsilon={self.max_epsilon:g} "
                f"(epsilon so far {self.epsilon():.4g} at delta {self.delta:g} after "
                f"{self.accountant.num_releases} rounds); the run stops before sending it"
            )
        if self.mode == "local":
            self._journal(server_round)

    def attach_journal(self, path: Any, read_from: Any = None) -> DPJournal:
        """Record every release in the journal at ``path`` (continuing the one at
        ``read_from``, default ``path``) before it leaves the server
        (:mod:`~flwr_isoloco.strategies.diloco.dp_journal`). Call before :meth:`parse_state` (the
        strategy's ``load_state_dict``) and before the first round; a strategy with DP noise
        cannot be resumed without it."""
        self.journal = DPJournal(path, read_from)
        return self.journal

    def _journal(self, server_round: int, attempt: int | None = None, nonce: int = 0) -> None:
        """Write the release ``(server_round, attempt, nonce)`` (default: the next attempt) to
        the journal, if attached, before it happens: an ``OSError`` stops the release."""
        if self.journal is not None:
            if attempt is None:
                attempt = self.journal.attempts(self.run_id, server_round)
            self.journal.record(self.run_id, server_round, attempt, nonce)

    def mechanism(self, server_round: int, sampled: int, keys: list[str]) -> GaussianSum | None:
        """The round's :class:`GaussianSum` (``sampled`` = nodes the round was sent to)."""
        if not self.enabled or self.mode == "local":
            return None
        # attempt: releases of this round already journaled (a redo after a crash); nonce: this
        # release's own secret, so that a redo from a lost or forked journal draws new noise too
        j, self.released_fraction = self.journal, None
        self.attempt = 0 if j is None else j.attempts(self.run_id, server_round)
        nonce = 0 if self.fixed_key else 1 + secrets.randbits(62)
        z, k = self.z_update or 0.0, max(sampled, 1)
        self.last = GaussianSum(
            self.c, z, k, keys, self.noise_key, server_round, self.attempt, nonce
        )
        return self.last

    def _event(self) -> Any:
        """One round's event: ``z`` on a sum of sensitivity ``C`` (central, add/remove one
        site), or ``z / 2`` for one site's own release (local: any two of its clipped updates
        differ by up to ``2 C``)."""
        return _event(self.z / 2 if self.mode == "local" else self.z)

    def account(self, released: bool, sent: bool) -> None:
        """Account the round: central, when its noised sum was formed (``released``: every
        output of the round, the model or only a metric such as its norm, derives from it);
        local, when it was sent (a site releases its noised delta by replying, whatever the
        server does)."""
        if self.accountant is not None and (released if self.mode == "central" else sent):
            if self.mode == "central" and self.last is not None:  # before it leaves the server
                self._journal(self.last.server_round, self.last.attempt, self.last.nonce)
            self.accountant.compose(self._event())
            if self.quantile is not None and self.last is not None:
                self.c = self.next_clipping_norm(self.last)

    def next_clipping_norm(self, gs: GaussianSum) -> float:
        """``C exp(-eta (b - gamma))`` with ``b = (centred + N(0, sigma_b^2)) / k + 1/2`` the
        noised unclipped fraction of the round of ``gs``, ``centred = sum_i (1[||delta_i|| <=
        C] - 1/2)`` over the deltas it clipped (sensitivity 1/2: a site without a delta adds
        0; module docstring), the noise drawn from ``(key, round, COUNT_NOISE_INDEX,
        attempt)``. With every sampled site in the round, ``b = (k - clipped + noise) / k``."""
        from flwr_isoloco.merging.dp import noise_like

        assert self.quantile is not None and self.count_std is not None
        noise = noise_like(
            torch.zeros(()),
            self.count_std,
            self.noise_key,
            gs.server_round,
            COUNT_NOISE_INDEX,
            gs.attempt,
            gs.nonce,
        )
        unclipped = (gs.centred_count + float(noise)) / gs.k + 0.5
        self.released_fraction = unclipped
        return gs.c * math.exp(-self.clip_lr * (unclipped - self.quantile))

    def request(self) -> dict[str, float]:
        """Train-config entries asking the workers for local DP (empty in central mode)."""
        if not self.enabled or self.mode != "local":
            return {}
        return {CLIP_KEY: self.c, NOISE_KEY: self.z or 0.0}

    def reply_problem(self, content: Any) -> str | None:
        """Why a reply cannot be used under local DP: it does not echo the ``(C, z)`` asked."""
        want = self.request()
        if not want:
            return None
        for crec in content.config_records.values():
            if all(crec.get(k) == v for k, v in want.items()):
                return None
        return (
            f"reply does not say it applied local DP ({CLIP_KEY}={self.c:g}, "
            f"{NOISE_KEY}={self.z or 0:g})"
        )

    def metrics(self) -> dict[str, float]:
        """``dp-epsilon`` and the round's clipping figures (empty when DP is off)."""
        if not self.enabled:
            return {}
        out: dict[str, float] = {}
        if self.accountant is not None:  # clipping only: no guarantee, no epsilon reported
            out["dp-epsilon"] = self.epsilon()
        if self.mode == "local":
            out["dp-noise-std"] = (self.z or 0.0) * self.c  # on each site's delta
        elif self.last is not None:
            out["dp-noise-std"] = self.last.std_of_mean
            if self.quantile is not None:  # the round's C; self.c is already the next one
                out["dp-clipping-norm"] = self.last.c
            if self.released_fraction is not None:  # the noised estimate, never the count
                out["dp-unclipped-fraction"] = self.released_fraction
        return out

    def describe(self) -> str:
        """One line for the strategy summary."""
        if not self.enabled:
            return "off"
        cap = "none" if self.max_epsilon is None else f"{self.max_epsilon:g}"
        adapt = ""
        if self.quantile is not None:
            adapt = (
                f" | adaptive C: quantile {self.quantile:g}, lr {self.clip_lr:g}, count std "
                f"{self.count_std:g}, update z {self.z_update:.4g}"
            )
        uniform = " | weights uniform (w_i = 1; weighting='examples' ignored)"
        return (
            f"{self.mode}, C {self.c:g} | z {self.z or 0:g} | delta {self.delta:g} | "
            f"max-epsilon {cap}{adapt}{uniform if self.uniform_forced else ''}"
        )

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> dict[str, Any] | None:
        """``{"accountant": Flower's accountant state, "noise_key": int}`` (JSON-able), None
        without noise. The key is secret: a checkpoint with DP is as private as the updates."""
        if self.accountant is None:
            return None
        out = {
            "accountant": self.accountant.state_dict(),
            "noise_key": self.noise_key,
            "run": self.run_id,  # names the run in its DP journal
        }
        if self.quantile is not None:
            out["clipping_norm"] = self.c  # a float: JSON keeps it bit for bit
        return out

    def restore(self, parsed: tuple) -> None:
        """Set what :meth:`parse_state` returned (or ``(accountant, key, c)`` as they are)."""
        p = ParsedDP(*parsed)
        self.accountant, self.noise_key, self.c = p.accountant, p.noise_key, p.c
        if p.run_id is not None:
            self.run_id = p.run_id

    def parse_state(self, state: Any, server_round: int) -> ParsedDP:
        """``(accountant, noise key, clipping norm, run id)`` restored from :meth:`state` (the
        accountant validated by Flower's ``load_state_dict``, then charged with the journal's
        releases after ``server_round``: :meth:`_charge_journal`; nothing is set here; the
        clipping norm is the constructor's unless adaptive clipping saved one). ``ValueError``
        when a checkpoint of ``server_round > 0`` rounds has no accountant but this strategy
        has noise (its earlier rounds were not private), or the other way round, or when the
        run's DP journal is not attached or not the run's."""
        if self.accountant is None:
            if state is not None:
                raise ValueError("field 'dp' holds an accountant but this strategy has no DP noise")
            return ParsedDP(None, self.noise_key, self.c)
        if state is None:
            if server_round > 0:
                raise ValueError(
                    "field 'dp' is absent: the checkpoint's rounds were not accounted, so "
                    "resuming with noise_multiplier would report a wrong epsilon"
                )
            return ParsedDP(_accountant(self.delta), self.noise_key, self.c)
        key = state.get("noise_key") if isinstance(state, dict) else None
        if (
            not isinstance(key, int)
            or isinstance(key, bool)
            or not isinstance(state.get("accountant"), dict)
        ):
            raise ValueError("field 'dp' must hold 'accountant' (a dict) and 'noise_key' (an int)")
        fresh = _accountant(self.delta)
        fresh.load_state_dict(state["accountant"])  # ValueError naming what is wrong
        run, c = state.get("run"), self._saved_clip(state)
        self._charge_journal(fresh, run, server_round)  # last: it logs what it charges
        return ParsedDP(fresh, key, c, run)

    def _charge_journal(self, accountant: Any, run: Any, server_round: int) -> None:
        """:func:`~flwr_isoloco.strategies.diloco.dp_journal.charge_unsaved` with this run's event."""
        charge_unsaved(self.journal, accountant, run, server_round, self._event(), self.delta)

    def _saved_clip(self, state: dict) -> float:
        """The adaptive clipping norm of a checkpoint (``ValueError`` if it is missing, not a
        finite positive float, or present without adaptive clipping)."""
        c = state.get("clipping_norm")
        if self.quantile is None:
            if c is not None:
                raise ValueError(
                    "field 'dp' holds an adaptive clipping norm, but this strategy "
                    "clips at a fixed clipping_norm"
                )
            return self.c
        ok = isinstance(c, float) and math.isfinite(c) and c > 0
        if not ok:
            raise ValueError(f"field 'dp.clipping_norm' must be a float > 0, got {c!r}")
        return c


# ---------------------------------------------------------------------- secure aggregation
def secagg_problems(s: Any) -> list[str]:
    """The options of DiLoCo/IsoLoCo ``s`` that need to see single replies, so that Flower's
    SecAgg+ (the server sees only the masked sum) cannot serve them (the table of
    the repository's ``docs/privacy.md`` ("Privacy")).
    Empty: compatible."""
    out = []
    if not getattr(s.merger.rule_for_g(), "streaming", False):
        out.append(f"merge={s.merge_name!r} needs every delta (use mean or an Iso-C rule)")
    v = s.train_validator
    if v.max_norm_ratio or v.max_update_norm:
        out.append(
            "ReplyChecks.max_norm_ratio / max_update_norm need each reply's norm (clip on clients)"
        )
    if s.weighting == "examples" and s.max_weight_ratio:
        out.append(
            "ReplyChecks.max_weight_ratio needs every weight (use weighting='uniform' or ratio 0)"
        )
    if s.upload_codec != "none":
        out.append(f"upload={s.upload_codec!r}: {composition.refusal('secagg', 'upload')}")
    if s.quorum is not None or s.grace_s:
        out.append(f"Rounds.quorum / grace_s: {composition.refusal('secagg', 'quorum')}")
    if getattr(s, "robust", "none") != "none":
        out.append(f"robust={s.robust!r}: {composition.refusal('secagg', 'robust')}")
    if s.dp.enabled and s.dp.mode == "central":
        out.append(composition.refusal("secagg", "central-dp"))
    return out


def require_secagg(s: Any) -> None:
    """``ValueError`` naming every option of ``s`` that SecAgg+ cannot serve."""
    problems = secagg_problems(s)
    if problems:
        raise ValueError("not compatible with secure aggregation: " + "; ".join(problems))
