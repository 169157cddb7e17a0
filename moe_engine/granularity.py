"""Online search of the partition count n (the paper's Algorithm 1, guarded).

The best n depends on the token count B, the model and the hardware. The
search times candidate n on real forward+backward passes (after a warm-up; a
candidate's time is its fastest timed pass, since stalls only add time), all
ranks agree on the result (slowest rank's times), and the cache maps token
counts to n. A new B between two cached counts with the same n reuses it (the
paper's assumption that the best n does not decrease as B grows); between two
different n only the candidates in between are timed.

A setting the search times is n and a *split* (layers.MPipeMoE's `split`): "tokens"
(n token ranges, the paper's) or "peers" (n groups of destination ranks, FasterMoE's).
`splits` says which it times at each candidate n; a layer drops the peer settings its
world size cannot run (`limit_to_world`). With one split the search is the paper's.

Unlike the paper, the cache is not trusted forever:
  * every `recheck_every` uses of a cached n, that n is re-timed against its
    neighbouring candidates; if a neighbour is faster by more than `tolerance`,
    the entry is replaced and the rest of the cache dropped (it was built on
    the same now-doubtful assumption);
  * a shift of routing skew since the entry was made triggers a new search:
    skew is log2(max expert load / mean load) rounded, and a change of at least
    `skew_shift` buckets (default 2, i.e. a 4x change) counts, so the ordinary
    drift of routing during training does not restart the search every step.
Among the candidates within `tolerance` of the fastest, the largest n wins: more
partitions mean smaller shared buffers, so memory is saved at a bounded time cost —
unless the caller asks for the fastest (`decide(prefer_fastest=True)`): where a memory
budget already bounds n from below, or the strategy shares no buffers, a larger n buys
nothing (on one H200, 8 stacked gpt-xl layers: 4/S4 fit the budget and ran 10% faster
than the 8/S4 this rule kept; `results/stacked-h200/`).
Candidates are timed in increasing n; once one is slower than the one before it of
the same split and more than `give_up_slower` (default 50%) slower than the fastest so
far, the larger ones of that split are not timed (each would be a slow training step; on
one GPU, where there is no All-to-All to hide, n = 16 runs several times slower than n = 1).
Every decision is appended to `decisions` and logged; a setting is named by its n
alone when split by tokens, "n:peers" otherwise (`label`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import torch

from .comm import ExpertGroup
from .timing import Stopwatch

log = logging.getLogger(__name__)

DEFAULT_CANDIDATES = (1, 2, 4, 8, 16)
SEARCH_SPLITS = ("tokens", "peers")


class Setting(NamedTuple):
    """What one timed pass runs: n partitions, split by tokens or by peers."""

    partitions: int
    split: str = "tokens"

    @property
    def label(self) -> int | str:
        """n for a token split, "n:peers" for a peer split (the decision log's key)."""
        return self.partitions if self.split == "tokens" else f"{self.partitions}:peers"


def _order(setting: Setting) -> tuple[int, int]:
    """Increasing n, the token split first at equal n."""
    return setting.partitions, SEARCH_SPLITS.index(setting.split)


@dataclass
class CacheEntry:
    tokens: int
    partitions: int
    skew_bucket: int
    uses: int = 0
    split: str = "tokens"

    @property
    def setting(self) -> Setting:
        return Setting(self.partitions, self.split)


@dataclass
class PassTiming:
    """Forward and backward stopwatches of one pass of one layer."""

    forward: Stopwatch
    backward: Stopwatch
    backward_done: bool = False

    def seconds(self) -> float | None:
        if not self.backward_done:
            return None
        return self.forward.elapsed_s() + self.backward.elapsed_s()


@dataclass
class ActiveSearch:
    tokens: int
    skew_bucket: int
    candidates: list[Setting]
    reason: str
    calls_per_candidate: int
    call: int = 0
    samples: dict[Setting, list[PassTiming]] = field(default_factory=dict)
    checked_after: int = 0                        # candidates timed when last checked for a cut
    device: torch.device | None = None            # the timed passes' data device (set by timing_for_pass)

    def current(self) -> Setting:
        return self.candidates[self.call // self.calls_per_candidate]

    @property
    def finished(self) -> bool:
        return self.call >= len(self.candidates) * self.calls_per_candidate


def skew_bucket(expert_load: torch.Tensor) -> torch.Tensor:
    """Routing skew as a small integer: round(log2(max load / mean load)) (0 = balanced),
    as a 0-d int64 tensor on the load's device (computed there: reading it is the caller's
    one host sync)."""
    if expert_load.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=expert_load.device)
    load = expert_load.double()
    mean = load.mean()
    ratio = torch.where(mean > 0, load.max() / mean.clamp_min(1e-300), torch.ones_like(mean))
    return torch.round(torch.log2(ratio.clamp_min(1.0))).to(torch.int64)


def _labels(settings: Sequence[Setting]) -> list[int | str]:
    return [s.label for s in settings]


class GranularitySearch:
    """Chooses n (and, with two `splits`, the split) for each pass of one MPipeMoE layer.
    Call `choose` (or, with the timings agreed elsewhere, `decide` / `decide_setting`)
    once per forward."""

    def __init__(self, candidates: Sequence[int] = DEFAULT_CANDIDATES, warmup: int = 1, repeats: int = 2,
                 recheck_every: int = 100, tolerance: float = 0.05, skew_shift: int = 2,
                 give_up_slower: float | None = 0.5, splits: Sequence[str] = ("tokens",)):
        if not candidates or any((not isinstance(c, int)) or c < 1 for c in candidates):
            raise ValueError(f"candidates={candidates!r} is invalid: give integers >= 1, e.g. (1, 2, 4, 8)")
        if warmup < 0 or repeats < 1:
            raise ValueError(f"warmup={warmup}, repeats={repeats} are invalid: warmup >= 0, repeats >= 1")
        if give_up_slower is not None and not give_up_slower > 0:
            raise ValueError(f"give_up_slower={give_up_slower!r} is invalid: give a fraction > 0 (0.5 = stop at "
                             f"a candidate 50% slower than the fastest so far), or None to time every candidate")
        if not splits or any(s not in SEARCH_SPLITS for s in splits) or len(set(splits)) != len(splits):
            raise ValueError(f"splits={splits!r} is invalid: give one or both of {', '.join(SEARCH_SPLITS)}")
        self.give_up_slower = give_up_slower
        self.candidates = sorted(set(candidates))
        self.splits = tuple(sorted(splits, key=SEARCH_SPLITS.index))
        # n = 1 is one partition however it is split: timed once, as the token split
        self.settings = sorted({Setting(n, s if n > 1 or len(self.splits) == 1 else "tokens")
                                for n in self.candidates for s in self.splits}, key=_order)
        self.warmup, self.repeats = warmup, repeats
        self.recheck_every, self.tolerance, self.skew_shift = recheck_every, tolerance, skew_shift
        self.cache: list[CacheEntry] = []
        self.active: ActiveSearch | None = None
        self._floor = 1
        self._prefer_fastest = False
        self.decisions: list[dict[str, Any]] = []

    def limit_to_world(self, world_size: int) -> None:
        """Drop the peer settings a world of ``world_size`` ranks cannot run (a peer split's
        n divides W); raise if no setting is left. Called by the layer, before any pass."""
        kept = [s for s in self.settings if s.split == "tokens" or world_size % s.partitions == 0]
        if not kept:
            raise ValueError(f"search candidates {self.candidates} split by peers: none divides the expert-parallel "
                             f"world size {world_size}; give divisors of it")
        self.settings = kept

    @property
    def partition_counts(self) -> list[int]:
        """Every n the search may run, increasing (whatever its split)."""
        return sorted({s.partitions for s in self.settings})

    @property
    def token_candidates(self) -> list[int]:
        """The n the search may run split by tokens (the count exchange's chunks must be a
        multiple of each)."""
        return [s.partitions for s in self.settings if s.split == "tokens"]

    # -- the decision for one pass ----------------------------------------------------------
    def choose(self, tokens: int, skew: int, group: ExpertGroup, timing_wanted: bool,
               min_partitions: int = 1, prefer_fastest: bool = False) -> int:
        """n for a pass over `tokens` tokens (the same on every rank: tokens and skew are
        agreed beforehand). Collective when the search needs the ranks' timings
        (`timing_agreement_due`): all ranks call it together. A layer agrees on the timings
        in its count exchange instead and calls `decide_setting` (planner.py)."""
        seconds = self.agreed_seconds(group) if self.timing_agreement_due() else None
        return self.decide(tokens, skew, seconds, timing_wanted, min_partitions, prefer_fastest)

    def decide(self, tokens: int, skew: int, agreed_seconds: dict[Setting, float] | None, timing_wanted: bool,
               min_partitions: int = 1, prefer_fastest: bool = False) -> int:
        """Local. n of `decide_setting`'s setting."""
        return self.decide_setting(tokens, skew, agreed_seconds, timing_wanted, min_partitions,
                                   prefer_fastest).partitions

    def decide_setting(self, tokens: int, skew: int, agreed_seconds: dict[Setting, float] | None,
                       timing_wanted: bool, min_partitions: int = 1, prefer_fastest: bool = False) -> Setting:
        """Local. The setting for a pass over `tokens` tokens from agreed values only: tokens
        and skew (the max over ranks), and, when `timing_agreement_due` said so before this
        call, the slowest rank's fastest pass per setting, in seconds (`agreed_seconds`;
        None otherwise).

        min_partitions: the smallest n allowed (e.g. the fewest partitions that fit a
        memory budget); cached choices below it are ignored and not searched.
        prefer_fastest: a search ending now keeps the fastest setting, not the largest n within
        `tolerance` (agreed values only: the same on every rank)."""
        self._floor = min(min_partitions, self.settings[-1].partitions)
        self._prefer_fastest = prefer_fastest
        if self.active is not None and self.active.tokens == tokens and timing_wanted:
            self._maybe_cut_short(agreed_seconds)
        if self.active is not None and self.active.finished:
            self._finish(agreed_seconds)
        if self.active is not None and (self.active.tokens != tokens or not timing_wanted):
            self._decide("search abandoned", self.active.tokens, None, reason="token count changed or no backward")
            self.active = None
        if self.active is None and timing_wanted:
            self._maybe_start(tokens, skew)
        if self.active is not None:
            return self.active.current()
        entry = self._lookup(tokens)
        return entry.setting if entry is not None else self._allowed(self.settings)[0]

    def timing_agreement_due(self) -> bool:
        """Local, from the search's state (the same on every rank). Whether `decide` may
        compare the candidates' times this pass: at the end of the search, or at the start
        of a candidate where it may cut the search short."""
        search = self.active
        if search is None:
            return False
        if search.finished:
            return True
        timed = search.call // search.calls_per_candidate
        return (self.give_up_slower is not None and search.call % search.calls_per_candidate == 0
                and 2 <= timed < len(search.candidates) and timed != search.checked_after)

    def local_seconds(self) -> list[float]:
        """Local. This rank's fastest timed pass per setting (in `settings` order) of the
        active search; inf where nothing was timed to its end.

        The fastest, not the mean: a stall (the host descheduled, the caching allocator
        freeing and re-allocating under memory pressure) only adds time. Emulated 8x8 on
        the H200, gpt-xl 8k under skew, the mean of two passes timed n = 8 at 227.9 ms
        where the bench's own rounds timed that setting at 119.7, and the search kept n = 4
        at 128.2 ms (`results/bench-h200-emulated-8x8-dgx-h200.json`; docs/engine.md)."""
        samples = self.active.samples if self.active is not None else {}
        return [min(self._timed_seconds(samples.get(s, [])), default=math.inf) for s in self.settings]

    @staticmethod
    def _timed_seconds(timings: list[PassTiming]) -> list[float]:
        return [s for t in timings if (s := t.seconds()) is not None]

    def agreed_seconds(self, group: ExpertGroup) -> dict[Setting, float]:
        """Collective. The slowest rank's `local_seconds` (its fastest pass) per setting. The
        all-reduce runs on the timed passes' device (NCCL rejects CPU tensors)."""
        search = self.active
        if search is None or search.device is None:  # the search only advances in timing_for_pass
            raise RuntimeError("the granularity search has no timed passes to agree on: call "
                               "timing_for_pass(n, device) for each pass after choose")
        means = torch.tensor(self.local_seconds(), dtype=torch.float64, device=search.device)
        return dict(zip(self.settings, group.all_reduce_max(means).tolist()))

    def _allowed(self, settings: list[Setting]) -> list[Setting]:
        floor = self._floor
        return [s for s in settings if s.partitions >= floor] or [self.settings[-1]]

    def timing_for_pass(self, n: int, device: torch.device, split: str = "tokens") -> PassTiming | None:
        """A stopwatch pair for this pass when the search is measuring it.

        device: the pass's data device; the search's agreement (an all-reduce of the
        timings) runs on it, since NCCL process groups reject CPU tensors."""
        search = self.active
        if search is None:
            return None
        search.device = torch.device(device)
        search.call += 1
        if (search.call - 1) % search.calls_per_candidate < self.warmup:
            return None
        timing = self._new_timing(device)
        search.samples.setdefault(Setting(n, split), []).append(timing)
        return timing

    def _new_timing(self, device: torch.device) -> PassTiming:
        return PassTiming(Stopwatch(device), Stopwatch(device))

    # -- cache and searches ---------------------------------------------------------------------
    def _lookup(self, tokens: int) -> CacheEntry | None:
        entry = self._lookup_any(tokens)
        return entry if entry is not None and entry.partitions >= self._floor else None

    def _lookup_any(self, tokens: int) -> CacheEntry | None:
        for entry in self.cache:
            if entry.tokens == tokens:
                return entry
        below = [e for e in self.cache if e.tokens < tokens]
        above = [e for e in self.cache if e.tokens > tokens]
        lo = max(below, key=lambda e: e.tokens) if below else None
        hi = min(above, key=lambda e: e.tokens) if above else None
        if lo is not None and hi is not None and lo.setting == hi.setting:
            return lo
        return None

    def _with_n_between(self, lo_n: int, hi_n: int) -> list[Setting]:
        return [s for s in self.settings if lo_n <= s.partitions <= hi_n]

    def _maybe_start(self, tokens: int, skew: int) -> None:
        exact = next((e for e in self.cache if e.tokens == tokens), None)
        merged = self._lookup(tokens)
        if exact is not None and abs(exact.skew_bucket - skew) >= self.skew_shift:
            self._start(tokens, skew, self.settings, f"routing skew changed ({exact.skew_bucket} -> {skew})")
            self.cache.remove(exact)
            return
        if merged is not None:
            merged.uses += 1
            if merged.uses % self.recheck_every == 0:
                self._start(tokens, skew, self._neighbours(merged.setting),
                            f"periodic re-check of cached n={merged.setting.label}")
            return
        ns = self.partition_counts
        below = [e for e in self.cache if e.tokens < tokens]
        above = [e for e in self.cache if e.tokens > tokens]
        lo_n = max(below, key=lambda e: e.tokens).partitions if below else ns[0]
        hi_n = min(above, key=lambda e: e.tokens).partitions if above else ns[-1]
        if lo_n > hi_n:  # the cache itself violates monotonicity: search everything
            lo_n, hi_n = ns[0], ns[-1]
        # The bracket [lo_n, hi_n] is the paper's pruning; one n on each side of it is timed
        # too (every split of it), so a violation of the monotonicity assumption shows itself.
        inside = [i for i, n in enumerate(ns) if lo_n <= n <= hi_n]
        self._start(tokens, skew, self._with_n_between(ns[max(0, inside[0] - 1)], ns[min(len(ns) - 1, inside[-1] + 1)]),
                    "no cached n for this token count")

    def _neighbours(self, setting: Setting) -> list[Setting]:
        """The setting, the candidate n on either side of it in its split, and its n in the
        other split (n = 1 is every split's)."""
        ns = self.partition_counts
        i = ns.index(setting.partitions) if setting.partitions in ns else 0
        return [s for s in self._with_n_between(ns[max(0, i - 1)], ns[min(len(ns) - 1, i + 1)])
                if s.split == setting.split or s.partitions in (1, setting.partitions)]

    def _start(self, tokens: int, skew: int, candidates: list[Setting], reason: str) -> None:
        candidates = self._allowed(list(candidates))
        self.active = ActiveSearch(tokens, skew, candidates, reason, self.warmup + self.repeats)
        self._decide("search started", tokens, None, reason=reason, candidates=_labels(candidates))

    @staticmethod
    def _times(agreed_seconds: dict[Setting, float] | None, candidates: list[Setting]) -> list[float]:
        if agreed_seconds is None:
            raise RuntimeError("the granularity search needs the ranks' agreed timings this pass: pass "
                               "agreed_seconds to decide when timing_agreement_due() is true")
        return [agreed_seconds[s] for s in candidates]

    def _maybe_cut_short(self, agreed_seconds: dict[Setting, float] | None) -> None:
        """At the start of a candidate (the same pass on every rank): stop timing larger n of
        a split when its last one timed got slower than the one before it (of that split)
        and is `give_up_slower` behind the fastest."""
        search = self.active
        assert search is not None  # called during a search
        timed = search.call // search.calls_per_candidate
        if self.give_up_slower is None or search.call % search.calls_per_candidate or timed < 2 \
                or timed >= len(search.candidates) or timed == search.checked_after:
            return
        search.checked_after = timed
        done = search.candidates[:timed]
        times = self._times(agreed_seconds, done)
        if math.inf in times:  # a pass not yet timed to its end (e.g. micro-batches): no verdict
            return
        fastest = min(times)
        last = done[-1]
        # n = 1 is the first setting of every split (one partition is one partition)
        chain = [t for s, t in zip(done, times) if s.split == last.split or s.partitions == 1]
        if len(chain) < 2 or not (chain[-1] > chain[-2] and chain[-1] > (1 + self.give_up_slower) * fastest):
            return
        skipped = [s for s in search.candidates[timed:] if s.split == last.split]
        if not skipped:
            return
        search.candidates = [s for s in search.candidates if s not in skipped]
        previous = next(s for s in reversed(done[:-1]) if s.split == last.split or s.partitions == 1)
        self._decide("search cut short", search.tokens, None,
                     reason=f"n={last.label} is {chain[-1] / fastest - 1:.0%} slower than the fastest and slower "
                            f"than n={previous.label}: larger n{' split by peers' if last.split == 'peers' else ''} "
                            f"not timed",
                     skipped=_labels(skipped), times=dict(zip(_labels(done), times)))

    def _finish(self, agreed_seconds: dict[Setting, float] | None) -> None:
        search, self.active = self.active, None
        assert search is not None  # called during a search
        agreed = self._times(agreed_seconds, search.candidates)
        times = {s: t for s, t in zip(search.candidates, agreed)}
        # More partitions mean smaller shared buffers: among the settings within `tolerance`
        # of the fastest, take the largest n (at equal n the faster split), unless the caller
        # wants the fastest.
        fastest = min(agreed)
        if self._prefer_fastest:
            best = min(times, key=lambda s: times[s])
        else:
            best = max((s for s, t in times.items() if t <= (1 + self.tolerance) * fastest),
                       key=lambda s: (s.partitions, -times[s]))
        previous = next((e for e in self.cache if e.tokens == search.tokens), None)
        labelled = dict(zip(_labels(search.candidates), agreed))
        if previous is not None and previous.setting != best and \
                times.get(previous.setting, math.inf) > (1 + self.tolerance) * times[best]:
            self._decide("cache stale", search.tokens, best, reason=f"cached n={previous.setting.label} is slower "
                         f"than n={best.label} by more than {self.tolerance:.0%}", times=labelled)
            self.cache = []
        elif previous is not None:
            best = previous.setting  # within tolerance: keep the cached choice
            self.cache.remove(previous)
        self.cache.append(CacheEntry(search.tokens, best.partitions, search.skew_bucket, split=best.split))
        self.cache.sort(key=lambda e: e.tokens)
        # The timed passes of this rank, beside the agreed times (a log for readers; the
        # choice above used agreed values only).
        local_ms = {s.label: [round(1e3 * t, 3) for t in self._timed_seconds(search.samples.get(s, []))]
                    for s in search.candidates}
        self._decide("chose", search.tokens, best, reason=search.reason, times=labelled, local_passes_ms=local_ms)
        for violation in self.monotonicity_violations():
            if search.tokens in (violation[0], violation[2]):
                self._decide("monotonicity violated", search.tokens, best,
                             reason=f"{violation[0]} tokens -> n={violation[1]} but "
                                    f"{violation[2]} tokens -> n={violation[3]}")

    def _decide(self, event: str, tokens: int, setting: Setting | None, **details: Any) -> None:
        record = {"event": event, "tokens": tokens, "partitions": None if setting is None else setting.partitions,
                  **({"split": setting.split} if setting is not None and len(self.splits) > 1 else {}), **details}
        self.decisions.append(record)
        log.info("granularity: %s", record)

    # -- monotonicity check (reported, not assumed) ---------------------------------------------
    def monotonicity_violations(self) -> list[tuple[int, int, int, int]]:
        """(tokens_a, n_a, tokens_b, n_b) pairs with tokens_a < tokens_b but n_a > n_b."""
        entries = sorted(self.cache, key=lambda e: e.tokens)
        return [(a.tokens, a.partitions, b.tokens, b.partitions)
                for a, b in zip(entries, entries[1:]) if a.partitions > b.partitions]
