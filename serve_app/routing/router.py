"""The ingress's routing state around the pure policy: pool views, local load, learned models.

Board snapshots arrive a few times a second; between them, a burst of requests would all see the
same stale queue. So the router also counts this ingress's own requests per pool (dispatched and
waiting for a first token, with their prompt tokens, or streaming) and uses the larger of the two
counts.

Admission protects the requests decoding on the pool a request would go to, and those queued
there for their first token, and on the pools sharing its device (`colocated`): two engines on
one GPU or one CPU slow each other's steps. It protects every ingress's requests, not only this
one's: each ingress posts what it protects to the board (`protected`), and takes the others'
posts with the pools' state (a board round trip late; its own at once).

Views of the pools are built once for every decision taken at one moment: the requests held for
a pool (ingress/pipeline.py) are decided again together at each poll, and while nothing routing
reads has changed (a dispatch, a first token, an end, a board answer, a learned sample), a view
up to VIEWS_REUSE_S old serves them all. Its slacks are then that much older, which admission
reads as that much more time to spare: far less than its predictions' error.

If the board itself stops answering, the router keeps routing on the last replica counts it got
and its own load accounting (a dead board must not turn every request into a 503); a pool whose
replicas stop reporting to a live board still drops out.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

from serve_app.constants import STATS_STALE_AFTER_S
from serve_app.pool_state import PoolSnapshot
from serve_app.routing.config import Placement, Policy, Protect, RoutingConfig
from serve_app.routing.estimator import (
    DEFAULT_STEP_TOKENS,
    Decoding,
    LatencyModel,
    Load,
    Protected,
    Queued,
    decode_pace_ms,
    decode_slack_ms,
    queued_slack_ms,
)
from serve_app.routing.policy import (
    Decision,
    PoolView,
    RequestFeatures,
    decide,
    decide_plain,
)
from serve_app.routing.slo import SLO, SWITCHES

# How long the pools' views serve the decisions that follow, while no change reaches the router
VIEWS_REUSE_S = 0.005


@dataclass(slots=True)
class _Local:
    waiting: int = 0
    queued_tokens: int = 0
    running: int = 0


def _devices(snap: PoolSnapshot) -> set[tuple[str, str]]:
    """Where a pool's replicas run: (node, GPU id), or (node, "cpu") for one without GPUs."""
    return {(p.node_id, gpu) for _, p in snap.placements for gpu in (p.gpu_ids or ("cpu",))}


def sharing(snapshots: Mapping[str, PoolSnapshot]) -> dict[str, list[str]]:
    """Each pool's pools sharing a device with one of its replicas, itself included."""
    devices = {name: _devices(snap) for name, snap in snapshots.items()}
    return {
        name: sorted(other for other, theirs in devices.items() if other == name or mine & theirs)
        for name, mine in devices.items()
    }


class Router:
    def __init__(
        self,
        pools: Mapping[str, int],
        config: RoutingConfig,
        step_tokens: Mapping[str, int] | None = None,
        ingress_id: str = "local",
    ) -> None:
        """`pools` maps each pool name to its max_model_len; `step_tokens` to its engines'
        token budget per step (max_num_batched_tokens); `ingress_id`: this ingress, whose own
        posts on the board are not counted twice."""
        self._config = config
        self._ingress_id = ingress_id
        # the config under another placement or protection (`x-route-policy`)
        self._placements: dict[str, RoutingConfig] = {}
        self._max_len = dict(pools)
        steps = step_tokens or {}
        self._models = {
            name: LatencyModel(
                config.prior(name),
                half_life_s=config.factor_half_life_s,
                path_half_life_s=config.path_half_life_s,
                step_tokens=steps.get(name, DEFAULT_STEP_TOKENS),
            )
            for name in pools
        }
        self._local = {name: _Local() for name in pools}
        # this ingress's requests streaming on each pool with a TPOT target (admission keeps
        # them within it: routing/policy.py), and the pools each pool's prefills slow (those
        # sharing its device)
        self._decoding: dict[str, set[Decoding]] = {name: set() for name in pools}
        # and those waiting for their first token there, in dispatch order (dicts as ordered sets)
        self._queued: dict[str, dict[Queued, None]] = {name: {} for name in pools}
        # what the other ingresses protect on each pool (their latest posts on the board)
        self._others: dict[str, list[Protected]] = {name: [] for name in pools}
        self._sharing = {name: sorted(config.sharing(name) & set(pools)) for name in pools}
        self._snapshots: dict[str, PoolSnapshot] = {name: PoolSnapshot(name) for name in pools}
        self._board_at: float | None = None  # when the board last answered
        self._turn = 0
        # pool -> {failed replica -> until when it is counted out}
        self._failed: dict[str, dict[str, float]] = {name: {} for name in pools}
        # views() by what they were asked with: (changes seen, built at, views)
        self._version = 0  # changes to what views() reads (but the clock)
        self._views: dict[tuple[bool, bool, bool], tuple[int, float, list[PoolView]]] = {}

    def update(self, snapshots: Mapping[str, PoolSnapshot], now: float | None = None) -> None:
        self._board_at = time.time() if now is None else now
        self._version += 1
        for name, snap in snapshots.items():
            if name in self._snapshots:
                self._snapshots[name] = snap
                self._models[name] = self._models[name].with_prefill_rate(snap.prefill_tok_s)
                self._others[name] = [p for i, p in snap.protected if i != self._ingress_id]
        if self._config.colocated is None:
            self._sharing = sharing(self._snapshots)

    def sharing(self, pool: str) -> list[str]:
        """The pools whose decodes a prefill on `pool` slows (those sharing its device)."""
        return self._sharing[pool]

    @property
    def snapshots(self) -> Mapping[str, PoolSnapshot]:
        return self._snapshots

    def board_stale(self, now: float) -> bool:
        """The board has answered before but not within STATS_STALE_AFTER_S."""
        return self._board_at is not None and now - self._board_at > STATS_STALE_AFTER_S

    def replica_failed(self, pool: str, replica: str, now: float) -> None:
        """A replica of `pool` failed a request: count it out until the board has noticed (an
        unhealthy or silent replica leaves the snapshot within STATS_STALE_AFTER_S). Several
        requests failing on one replica count it once."""
        self._failed[pool][replica] = now + STATS_STALE_AFTER_S
        self._version += 1

    def _replicas(self, name: str, now: float) -> int:
        failed = self._failed[name]
        for replica in [r for r, until in failed.items() if until <= now]:
            del failed[replica]
        return max(0, self._snapshots[name].replicas - len(failed))

    def protected(self, now: float | None = None) -> dict[str, Protected]:
        """What this ingress's admission protects on each pool where it protects anything
        (its post to the board)."""
        now = time.time() if now is None else now
        out = {}
        for name in self._snapshots:
            decode = decode_slack_ms(self._decoding[name], now)
            queued = tuple(self._queued[name])
            pace = decode_pace_ms(d.measured_pace_ms() for d in self._decoding[name])
            if decode is not None or queued or pace is not None:
                out[name] = Protected(decode, queued, pace)
        return out

    def _decode_pace_ms(self, name: str, others_too: bool) -> float | None:
        """The pace `name`'s engines keep now, from the requests decoding there: this
        ingress's, and each other ingress's as it posted it (`others_too`)."""
        mine = [d.measured_pace_ms() for d in self._decoding[name]]
        theirs = [o.decode_pace_ms for o in self._others[name]] if others_too else []
        return decode_pace_ms(mine + theirs)

    def _all_queued(self, pool: str, others_too: bool) -> list[Queued]:
        """Every ingress's requests queued on `pool` (`others_too`; else this one's), in
        dispatch order."""
        others = [q for p in self._others[pool] for q in p.queued] if others_too else []
        if not others:
            return list(self._queued[pool])
        return sorted(chain(self._queued[pool], others), key=attrgetter("dispatched_at"))

    def _decode_slack_ms(
        self, name: str, mine: Mapping[str, float | None], others_too: bool
    ) -> float | None:
        """The smallest slack of the requests decoding on `name` and the pools sharing its
        device: this ingress's now (`mine`, per pool), the others' (`others_too`) as they
        posted it (a request keeping its pace keeps its slack)."""
        sharing = self._sharing[name]
        theirs = (o.decode_slack_ms for p in sharing for o in self._others[p] if others_too)
        slacks = chain((mine[p] for p in sharing), theirs)
        return min((s for s in slacks if s is not None), default=None)

    def views(
        self,
        now: float | None = None,
        queued: bool = True,
        others_too: bool = True,
        pace: bool = True,
    ) -> list[PoolView]:
        """What the policy sees of each pool; `queued`: with the slack of the requests queued
        for their first token (admission protects them too); `others_too`: the slacks of the
        other ingresses' requests too; `pace`: with the pace its decoding requests keep (a
        floor under its predicted TPOT). Reused for VIEWS_REUSE_S while nothing changes."""
        now = time.time() if now is None else now
        key = (queued, others_too, pace)
        cached = self._views.get(key)
        if cached is not None:
            version, at, views = cached
            if version == self._version and 0 <= now - at <= VIEWS_REUSE_S:
                return views
        views = self._build_views(now, queued, others_too, pace)
        self._views[key] = (self._version, now, views)
        return views

    def _build_views(
        self, now: float, queued: bool, others_too: bool, pace: bool
    ) -> list[PoolView]:
        board_stale = self.board_stale(now)
        # each pool's slacks once: pools sharing a device each take the smallest of theirs
        by_pool = {
            p: queued_slack_ms(
                self._all_queued(p, others_too), self._models[p].ms_per_prefill_token, now
            )
            for p in self._queued
        }
        decoding = {p: decode_slack_ms(d, now) for p, d in self._decoding.items()}
        views = []
        for name, snap in self._snapshots.items():
            local = self._local[name]
            views.append(
                PoolView(
                    name=name,
                    max_model_len=self._max_len[name],
                    replicas=self._replicas(name, now),
                    waiting=max(snap.waiting, local.waiting),
                    running=max(snap.running, local.running),
                    model=self._models[name],
                    # a silent board is no news of the pools: route on what was last known
                    updated_at=now if board_stale else snap.updated_at,
                    queued_tokens=max(snap.queued_tokens, local.queued_tokens),
                    decode_slack_ms=self._decode_slack_ms(name, decoding, others_too),
                    queued_slack_ms=self._queued_slack_ms(name, by_pool) if queued else None,
                    decode_pace_ms=self._decode_pace_ms(name, others_too) if pace else None,
                )
            )
        return views

    def _queued_slack_ms(self, name: str, by_pool: Mapping[str, float | None]) -> float | None:
        """The smallest slack of the requests queued on `name` and on the pools sharing its
        device (`by_pool`: each pool's, its queue at its own prefill rate)."""
        slacks = [slack for p in self._sharing[name] if (slack := by_pool[p]) is not None]
        return min(slacks, default=None)

    def decide(
        self,
        features: RequestFeatures,
        slo: SLO,
        now: float,
        policy: Policy = Policy.SLO,
        policy_arg: str | None = None,
        commit: bool = True,
    ) -> Decision:
        """Route one request. `policy_arg`: the pool of Policy.SINGLE, or for Policy.SLO
        `<placement>[:<protect>]` other than the configured ones. `commit=False` asks without
        taking a turn (an admission check ahead of the real decision must not advance
        round-robin)."""
        if policy is Policy.SLO:
            config = self._config
            if policy_arg is not None:
                config = self._placements.get(policy_arg) or self._placements.setdefault(
                    policy_arg, self._variant(policy_arg)
                )
            views = self.views(
                now,
                queued=config.protect is Protect.QUEUED,
                others_too=config.protect_across_ingresses,
                pace=config.tpot_at_least_pace,
            )
            return decide(features, slo, views, config, now)
        if commit:
            self._turn += 1
        only = policy_arg if policy is Policy.SINGLE else None
        least_load = policy is Policy.LEAST_LOAD
        return decide_plain(features, self.views(now), now, self._turn, only, least_load)

    def _variant(self, policy_arg: str) -> RoutingConfig:
        """The config with the placement, protection and switches
        `<placement>[:<protect>[:<switch>[+<switch>]]]` name (slo.py `SWITCHES`)."""
        placement, _, rest = policy_arg.partition(":")
        protect, _, switches = rest.partition(":")
        update: dict[str, Placement | Protect | bool] = {}
        if placement:
            update["placement"] = Placement(placement)
        if protect:
            update["protect"] = Protect(protect)
        for switch in filter(None, switches.split("+")):
            setting, value = SWITCHES[switch]
            update[setting] = value
        return self._config.model_copy(update=update)

    def dispatched(self, pool: str, prompt_tokens: int, queued: Queued | None = None) -> None:
        """A request went to `pool`; `queued`: its TPOT target, to protect until its first
        token (then its `Decoding` is protected instead)."""
        self._version += 1
        local = self._local[pool]
        local.waiting += 1
        local.queued_tokens += prompt_tokens
        if queued is not None:
            self._queued[pool][queued] = None

    def first_token(
        self,
        pool: str,
        prompt_tokens: int,
        decoding: Decoding | None = None,
        queued: Queued | None = None,
    ) -> None:
        """A request's first token came; `decoding`: its decode, to keep within its TPOT target
        (updated by the caller as tokens come)."""
        self._version += 1
        local = self._local[pool]
        local.waiting -= 1
        local.queued_tokens -= prompt_tokens
        local.running += 1
        if queued is not None:
            self._queued[pool].pop(queued, None)
        if decoding is not None:
            self._decoding[pool].add(decoding)

    def finished(
        self,
        pool: str,
        prompt_tokens: int,
        got_first_token: bool,
        decoding: Decoding | None = None,
        queued: Queued | None = None,
    ) -> None:
        self._version += 1
        local = self._local[pool]
        if queued is not None:
            self._queued[pool].pop(queued, None)
        if decoding is not None:
            self._decoding[pool].discard(decoding)
        if got_first_token:
            local.running -= 1
        else:
            local.waiting -= 1
            local.queued_tokens -= prompt_tokens

    def learn(
        self,
        pool: str,
        prompt_tokens: int,
        load: Load,
        ttft_ms: float | None,
        tpot_ms: float | None,
        now: float | None = None,
        path_ms: float | None = None,
        queue_ms: float | None = None,
    ) -> None:
        now = time.time() if now is None else now
        self._version += 1
        self._models[pool] = self._models[pool].learn(
            prompt_tokens,
            load,
            ttft_ms,
            tpot_ms,
            self._config.learning_rate,
            now,
            path_ms,
            queue_ms,
        )

    def model(self, pool: str) -> LatencyModel:
        return self._models[pool]
