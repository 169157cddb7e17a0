"""The tuning policy of an MoE layer: a `Planner` turns a pass's agreed values into a `PassPlan`.

Every choice that decides which collectives a pass runs (the partition count n, the restore
strategy, the fall-back to S4 when host memory is short) must be the same on every rank, or
ranks with different batches would wait in mismatched collectives. So the planner's decisions
take agreed values and nothing else (`decide`, `decide_host`); the per-rank values they come
from only reach them through an agreement. A pass, with the layer's steps (layers.py):

  1. `local_values`   Local. This rank's values besides the pass statistics: whether it holds
                      the hardware profile and that profile's digest (strategy "auto"), and the
                      search's time per candidate (its fastest pass) when it compares them this
                      pass (partitions "auto").
  2. the values ride in the count exchange with the pass statistics (NaN/Inf, the token count,
     the routing skew; dispatcher.exchange_counts, the collective dispatch needs anyway), so
     agreeing on them costs no collective and no device read of its own; `agree` takes the
     max over the ranks' rows, and compares every rank's profile digest with rank 0's
     (Local, on the host).
  3. `decide`         n from the online search (granularity.py), the strategy from the
                      performance model (perf_model.py). Collective only when the agreed values
                      say some rank lacks the hardware profile (then every rank measures it) or
                      that the ranks' profiles differ (a rank-local file, one store per node:
                      then every rank adopts rank 0's, one agreement, with a warning; with a
                      ProfileCache shared by the model's layers, once for all of them).
  4. `check_host_memory`  An offloading strategy's host buffers follow the rows this rank
                      receives, known only after the count exchange: whether they fit on every
                      rank is the pass's one agreement collective (`ExpertGroup.agree`, the min
                      headroom over ranks), run when the agreed pass shape changes;
                      `decide_host` keeps the strategy or falls back to S4.

The dtype every decision prices is the one the experts run in (experts.compute_dtype:
autocast's under autocast, where the layer's input is float32 but its GEMMs, All-to-Alls
and offloads are bf16): the profile's key and calibration, the model's bytes per row, the
host check's buffers.

The search's timings are floats riding in an int64 exchange: a non-negative float64 orders
like its int64 bit pattern, so the max over ranks of the bits is the bits of the max.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from .comm import ExpertGroup
from .config import STRATEGIES, MemoryBudget, MoEConfig
from .dispatcher import DispatchPlan, PassStats
from .granularity import GranularitySearch, PassTiming, Setting
from .memory import HostBufferPool, RestorePolicy, predict_memory
from .perf_model import SHARED_STRATEGIES, HardwareProfile, PerformanceModel, ProfileCache, adopt_rank0

log = logging.getLogger(__name__)


# Strategy choices a planner remembers before it starts afresh (token counts seen in training are few).
MAX_REMEMBERED_CHOICES = 256


@dataclass(frozen=True)
class AgreedValues:
    """The values of one pass that every rank holds alike: the max over ranks of each rank's
    values, and the pass's context (the same on every rank by construction)."""

    stats: PassStats                          # NaN/Inf anywhere, the largest token count, the routing skew
    profile_missing: bool                     # some rank holds no hardware profile: every rank measures it
    profile_differs: bool                     # the ranks' profiles differ: every rank adopts rank 0's
    search_seconds: dict[Setting, float] | None  # slowest rank's fastest pass per setting, s; None: not compared
    backward: bool                            # the pass records for backward (grad enabled)
    device: torch.device                      # the pass's data device (agreements run there)
    dtype: torch.dtype                        # the dtype the experts run in (experts.compute_dtype)


@dataclass(frozen=True)
class AgreedHeadroom:
    """Host memory left after this pass's offload buffers on the tightest rank (bytes; < 0:
    some rank is short)."""

    min_bytes: int


@dataclass(frozen=True)
class PassPlan:
    """What a pass runs: n partitions, the restore strategy, whether the host check moved
    it from an offload to S4, how the partitions split the pass ("tokens" or "peers":
    layers.MPipeMoE's `split`), and the experts FasterMoE shadows (agreed, like the rest)."""

    partitions: int
    strategy: str
    host_fallback: bool = False
    split: str = "tokens"
    shadowed: tuple[int, ...] = ()  # FasterMoE's shadowed experts this pass (shadowing.py), ascending


class Planner:
    """The tuning policy of one MoE layer (see the module docstring).

    partitions:    "auto" (online search) or an int >= 1.
    strategy:      "auto" (performance model), "none", "S1", "S2", "S3" or "S4".
    profile:       a HardwareProfile, or a ProfileCache (default: one of this planner's own).
    memory_budget: bytes the layer's activations may use, or a MemoryBudget shared by a
                   stack of such layers (None: no budget).
    search:        the GranularitySearch for partitions="auto" (default: GranularitySearch()); its
                   `splits` say how the partitions may split a pass.
    host_pool:     the pool offloads take host buffers from (its headroom is checked).
    split:         with a fixed n, how its partitions split a pass ("tokens" or "peers").
    """

    def __init__(self, config: MoEConfig, group: ExpertGroup, partitions: int | str = 1, strategy: str = "none", *,
                 profile: HardwareProfile | ProfileCache | None = None,
                 memory_budget: int | MemoryBudget | None = None,
                 search: GranularitySearch | None = None, host_pool: HostBufferPool | None = None,
                 split: str = "tokens"):
        if partitions != "auto" and (isinstance(partitions, bool) or not isinstance(partitions, int)
                                     or partitions < 1):
            raise ValueError(f"partitions={partitions!r} is invalid: give 'auto' or an integer >= 1")
        if strategy != "auto" and strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r} is invalid: give 'auto' or one of {', '.join(STRATEGIES)}")
        self.config, self.group = config, group
        self.partitions, self.strategy, self.split = partitions, strategy, split
        self.profile = profile if profile is not None else ProfileCache()
        self.memory_budget = MemoryBudget.of(memory_budget)
        self.search = search if search is not None else GranularitySearch()
        self.host_pool = host_pool if host_pool is not None else HostBufferPool()
        self.host_fallback_reason: str | None = None  # why the last host check chose S4 over an offload
        self._host_check: tuple | None = None         # (pass shape, AgreedHeadroom) of the last host check
        # (tokens, n, dtype, memory budget) -> (profile, strategy): the model's choice, remembered (the
        # same for the same agreed values and profile; pricing it costs the host ~0.3 ms a pass)
        self._strategy_choices: dict[tuple[int, int, torch.dtype, MemoryBudget | None], tuple[HardwareProfile, str]] = {}

    @property
    def count_chunks(self) -> int:
        """Chunks the counts are exchanged in: n when fixed; with the online search, a
        multiple of every candidate n split by tokens (n is chosen only once the agreed
        values arrive). A split by peers needs only the per-expert totals (one chunk)."""
        if self.partitions != "auto":
            return 1 if self.split == "peers" else self.partitions  # type: ignore[return-value]  # (partitions is an int unless "auto")
        return math.lcm(*self.search.token_candidates) if self.search.token_candidates else 1

    @property
    def wants_skew(self) -> bool:
        """Whether the decision reads the routing skew (the search re-runs when it shifts)."""
        return self.partitions == "auto"

    # -- 1. this rank's values (local) -----------------------------------------------------------
    def local_values(self, device: torch.device, dtype: torch.dtype) -> list[int]:
        """Local. This rank's values for the agreement, as int64s: [profile missing, profile
        digest (0 when missing)] with strategy "auto", then the search's seconds per candidate
        (float64 bits) with partitions "auto". The same length on every rank. ``dtype``: the
        dtype the experts run in (experts.compute_dtype), the profile's key."""
        values = []
        if self.strategy == "auto":
            held = (self.profile.held(self.group.size, device, dtype) if isinstance(self.profile, ProfileCache)
                    else self.profile)
            values += [int(held is None), held.digest() if held is not None else 0]
        if self.partitions == "auto":
            due = self.search.timing_agreement_due()
            seconds = self.search.local_seconds() if due else [0.0] * len(self.search.settings)
            values += np.asarray(seconds, dtype=np.float64).view(np.int64).tolist()
        return values

    # -- 2. agreement (local: the rows rode in the count exchange) ------------------------------------
    def agree(self, stats: PassStats, values_W: np.ndarray, device: torch.device, dtype: torch.dtype
              ) -> AgreedValues:
        """Local. The agreed values from the pass statistics (already the max over ranks) and
        every rank's `local_values` (rows of values_W, one per rank): the max over ranks, and
        whether any rank's profile digest differs from rank 0's."""
        profile_missing = profile_differs = False
        if self.strategy == "auto":
            profile_missing = bool(values_W[:, 0].max())
            profile_differs = not profile_missing and bool((values_W[:, 1] != values_W[0, 1]).any())
            values_W = values_W[:, 2:]
        top = values_W.max(axis=0) if values_W.size else values_W.reshape(-1)
        search_seconds = None
        if self.partitions == "auto" and self.search.timing_agreement_due():
            search_seconds = dict(zip(self.search.settings, top.astype(np.int64).view(np.float64).tolist()))
        return AgreedValues(stats, profile_missing, profile_differs, search_seconds, torch.is_grad_enabled(),
                            torch.device(device), dtype)

    # -- 3. the decision (agreed values only) -----------------------------------------------------
    def decide(self, agreed: AgreedValues) -> PassPlan:
        """n and the strategy of this pass, from agreed values only. Collective when
        ``agreed.profile_missing`` (every rank measures the hardware profile) or
        ``agreed.profile_differs`` (every rank adopts rank 0's)."""
        tokens = agreed.stats.max_tokens
        if self.partitions == "auto" and not self.group.distributed:
            # One rank: no All-to-All for partitions to hide, and each partition adds host
            # work (one H100, gpt-s layer at 256 tokens: +0.7-1.0 ms a partition over n = 1's
            # 3.7 ms): the fewest partitions that fit the memory budget, 1 without one.
            n, split = self._fewest_partitions_within_budget(tokens, agreed.dtype), "tokens"
        elif self.partitions == "auto":
            # Under a budget the fewest partitions that fit bound n already, and with "none"
            # more partitions share no buffers: keep the fastest n, not the largest near it.
            # The fit prices the activations in the dtype the experts run in (bf16 under
            # autocast), as the strategy model and the job's memory check do: priced in the
            # float32 parameters' dtype, a budget that n = 1 fits forced n = 16 (gpt-xl).
            n, split = self.search.decide_setting(
                tokens, agreed.stats.skew_bucket, agreed.search_seconds, agreed.backward,
                min_partitions=self._fewest_partitions_within_budget(tokens, agreed.dtype, agreed.stats.skew_bucket),
                prefer_fastest=self.memory_budget is not None or self.strategy == "none")
        else:
            n, split = self.partitions, self.split  # type: ignore[assignment]  # (partitions is an int unless "auto")
        strategy = self.strategy
        if strategy == "auto":
            strategy = self._model_strategy(agreed, tokens, n)
        return PassPlan(n, strategy, split=split)

    def _model_strategy(self, agreed: AgreedValues, tokens: int, n: int) -> str:
        """The performance model's strategy for ``tokens`` at ``n`` (agreed values and the
        agreed profile: the same on every rank), remembered per (tokens, n, dtype, budget)."""
        profile = self._profile(agreed)
        key = (tokens, n, agreed.dtype, self.memory_budget)
        known = self._strategy_choices.get(key)
        if known is not None and known[0] is profile:
            return known[1]
        strategy = PerformanceModel(profile).choose(self.config, tokens, self.group.size, agreed.dtype, [n],
                                                    SHARED_STRATEGIES, self.memory_budget).strategy
        if len(self._strategy_choices) >= MAX_REMEMBERED_CHOICES:
            self._strategy_choices.clear()
        self._strategy_choices[key] = (profile, strategy)
        return strategy

    def _profile(self, agreed: AgreedValues) -> HardwareProfile:
        """The profile every rank holds alike (collective when the agreed flags say so)."""
        if not isinstance(self.profile, ProfileCache):
            if agreed.profile_differs:
                self.profile = adopt_rank0(self.profile, self.group, agreed.device)
            return self.profile
        return self.profile.agreed(self.config, max(agreed.stats.max_tokens, 1), self.group, agreed.device,
                                   agreed.dtype, agreed.profile_missing, agreed.profile_differs)

    def _fewest_partitions_within_budget(self, tokens: int, dtype: torch.dtype, skew_bucket: int = 0) -> int:
        """With a memory budget, the smallest candidate n whose leanest strategy fits
        (the memory model shrinks as n grows); 1 without a budget. Under skewed routing the
        busiest rank receives more than k·T rows: the agreed skew bucket b (max expert load
        over mean, 2^b within a factor √2, on the busiest sender) bounds them by
        k·T·min(W, 2^(b+1/2)) (a source sends one rank at most L experts' rows, each at most
        2^(b+1/2) times the mean k·T/E), and the fit is checked on that bound."""
        if self.memory_budget is None:
            return 1
        world = self.group.size
        received = None
        if skew_bucket > 0 and world > 1:
            received = math.ceil(self.config.top_k * tokens * min(world, 2 ** (skew_bucket + 0.5)))
        budget = self.memory_budget
        for n in self.search.partition_counts:
            estimates = [predict_memory(self.config, tokens, world, n, s, dtype=dtype, rows_received=received)
                         for s in STRATEGIES]
            leanest = min(budget.need_of(e) for e in estimates)
            if leanest <= budget.bytes:
                return n
        return self.search.partition_counts[-1]

    def timing_for_pass(self, plan: PassPlan, device: torch.device) -> PassTiming | None:
        """Local. The stopwatches of a pass the search measures (None: not measured)."""
        return self.search.timing_for_pass(plan.partitions, device, plan.split) if self.partitions == "auto" else None

    # -- 4. host memory (one agreement collective, when the pass shape changes) --------------------
    def check_host_memory(self, plan: PassPlan, dispatch: DispatchPlan, agreed: AgreedValues) -> PassPlan:
        """``plan``, or S4 (no host memory) on every rank when the host buffers of an offloading
        pass do not fit on some rank. Collective (`ExpertGroup.agree`) when the agreed pass
        shape (tokens, skew, n, strategy) differs from the last one checked; else local."""
        if not (agreed.backward and RestorePolicy.of(plan.strategy).offloads):
            return plan
        key = (agreed.stats.max_tokens, agreed.stats.skew_bucket, plan.partitions, plan.split, plan.strategy)
        if self._host_check is not None and self._host_check[0] == key:
            return self.decide_host(plan, self._host_check[1])
        grow, usable = self._host_need(plan.strategy, dispatch, agreed.dtype, pin=agreed.device.type == "cuda")
        headroom = AgreedHeadroom(-self.group.agree([grow - usable], agreed.device)[0])
        self._host_check = (key, headroom)
        checked = self.decide_host(plan, headroom)
        if checked.host_fallback:
            where = (f"needs {grow:,} more bytes of host memory, {usable:,} usable" if grow > usable
                     else "does not fit on another rank")
            self.host_fallback_reason = (f"{plan.strategy} for {agreed.stats.max_tokens} tokens, n={plan.partitions} "
                                         f"{where}: using S4 (re-communication + recomputation) instead")
            log.warning("MPipeMoE: %s", self.host_fallback_reason)
        else:
            self.host_fallback_reason = None
        return checked

    @staticmethod
    def decide_host(plan: PassPlan, headroom: AgreedHeadroom) -> PassPlan:
        """Local. ``plan`` when its host buffers fit on every rank, else S4 (from agreed values only)."""
        return replace(plan, strategy="S4", host_fallback=True) if headroom.min_bytes < 0 else plan

    def _host_need(self, strategy: str, dispatch: DispatchPlan, dtype: torch.dtype, pin: bool) -> tuple[int, int]:
        """Local. (bytes the pool would grow by for this pass's offloads, bytes it may take);
        the host memory is asked only when the pool must grow."""
        policy = RestorePolicy.of(strategy)
        widths = [self.config.d_model] * policy.offload_input + \
            [self.config.pre_activation_width] * policy.offload_preactivation
        requests = [(p.rows_received * w, dtype) for p in dispatch.partitions for w in widths]
        grow = self.host_pool.bytes_to_grow(requests, pin)
        return grow, (self.host_pool.usable_bytes() if grow else 0)
