"""The token routings the benchmarks impose and the simulator prices: one list of names, each
a share of the (token, choice) pairs per expert (docs/emulation.md, "Routings").

    uniform        every expert 1/E of the pairs.
    zipf:S         expert popularity proportional to 1 / rank**S (S >= 0; zipf:0 is uniform); which
                   expert holds which rank is a permutation drawn from the seed (`--seed`), so the
                   hot experts fall on ranks as chance puts them, the same under the same seed.
    hot-expert     the extreme case: every other token picks expert 0 first, so expert 0 takes
                   1/(2k) + 1/(2E) of the pairs (k = top_k) and the others share the rest.
                   (Named "skewed" until 2026-12-07; that name is still read, with a note.)
    hot:F          expert 0 takes the fraction F of the pairs, the others share the rest.
    replay:FILE    the loads a training run logged (`mpipemoe routing`, app/bench/routing_replay.py):
                   the step bench replays each MoE layer's own, the layer bench and the simulator
                   the file's most imbalanced layer.
    replay:early,  the committed records of a real gpt-s run (4 MoE layers, 64 experts):
    replay:late    results/routing/routing-gpt-s-20.json (steps 1-20) and -300.json (steps 21-300).

An expert can take a token once, so no expert's share exceeds 1 / top_k: a larger one is
capped and its excess spread over the others in proportion (`capped_shares`). A rank of T
tokens deals its T·k pairs by largest remainders of those shares (`pair_counts`); the benches
impose those counts (app/bench/routing_replay.py `assign_experts`) and the simulator prices the
shares themselves (`routing_load`), which the counts round by less than one pair per expert.

No torch: the simulator (moe_sim), the benches (app/bench) and the commands read it.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from moe_sim.network import hot_expert_load, uniform_load

REPLAY = "replay:"
HOT_EXPERT = "hot-expert"
OLD_HOT_EXPERT = "skewed"   # the name of hot-expert until 2026-12-07
# replay:NAME of the committed routing records (results/README.md says how they were made)
RECORDED_ROUTINGS = {"early": "results/routing/routing-gpt-s-20.json",
                     "late": "results/routing/routing-gpt-s-300.json"}
REPOSITORY = Path(__file__).resolve().parent.parent
CHOICES = ("uniform, zipf:S (popularity ~ 1/rank^S), hot-expert (every other token to expert 0 first), "
           "hot:F (expert 0 takes the fraction F), replay:FILE (a run's logged loads, `mpipemoe routing`), "
           "replay:early or replay:late (a gpt-s run's steps 1-20 or 21-300)")
LOAD_KEY = re.compile(r"^moe_load/l(\d+)/tokens_e(\d+)$")


# -- names ------------------------------------------------------------------------------------

def renamed(spec: str) -> tuple[str, str | None]:
    """(the name ``spec`` goes by now, a one-line note when it was an old name, else None)."""
    if spec == OLD_HOT_EXPERT:
        return HOT_EXPERT, (f"--routing {OLD_HOT_EXPERT} is now named {HOT_EXPERT} (every other token to expert 0 "
                            f"first); the records say {HOT_EXPERT}")
    return spec, None


def check_routing(spec: str) -> None:
    """Raise ValueError unless ``spec`` is one of the module docstring's routings (a replay's
    file is read). The old name ``skewed`` is refused here with the fix; the commands
    rename it first (`renamed`)."""
    if spec in ("uniform", HOT_EXPERT):
        return
    if spec == OLD_HOT_EXPERT:
        raise ValueError(f"--routing {OLD_HOT_EXPERT} is now named {HOT_EXPERT}: give --routing {HOT_EXPERT}")
    if spec.startswith(REPLAY):
        load_routing(replay_path(spec))
        return
    kind, _, value = spec.partition(":")
    if kind in ("zipf", "hot"):
        try:
            number = float(value)
        except ValueError:
            number = None
        if kind == "zipf" and number is not None and number >= 0:
            return
        if kind == "hot" and number is not None and 0 <= number <= 1:
            return
        raise ValueError(f"--routing {spec!r} is invalid: give zipf:S with S >= 0 (e.g. zipf:1.2) or hot:F "
                         f"with 0 <= F <= 1 (e.g. hot:0.5)")
    raise ValueError(f"--routing {spec!r} is unknown: choose from {CHOICES}")


def replay_path(spec: str) -> Path:
    """The routing file of ``replay:FILE`` (replay:early and replay:late: the committed records)."""
    name = spec[len(REPLAY):]
    return REPOSITORY / RECORDED_ROUTINGS[name] if name in RECORDED_ROUTINGS else Path(name)


# -- shares and counts ------------------------------------------------------------------------

def zipf_shares(num_experts: int, exponent: float, seed: int = 0) -> list[float]:
    """Expert shares proportional to 1 / rank**exponent, rank 1 the most popular; the expert
    holding each rank is a permutation of the experts drawn from ``seed``."""
    weights = [1.0 / (rank + 1) ** exponent for rank in range(num_experts)]
    total = sum(weights)
    order = list(range(num_experts))
    random.Random(seed).shuffle(order)  # order[rank] is the expert of that rank
    shares = [0.0] * num_experts
    for rank, expert in enumerate(order):
        shares[expert] = weights[rank] / total
    return shares


def hot_expert_fraction(num_experts: int, top_k: int) -> float:
    """Expert 0's share under hot-expert: half the tokens put their first pair there (T/2 of
    T·k pairs), the other half's pairs spread evenly over all E experts."""
    return min(1.0, 1.0 / (2 * top_k) + 1.0 / (2 * num_experts))


def expert_shares(spec: str, num_experts: int, top_k: int, seed: int = 0, layer: int | None = None) -> list[float]:
    """Each expert's share of the pairs under ``spec`` (capped at 1 / top_k: module docstring).
    ``layer``: a replay's MoE layer (None: the file's most imbalanced one)."""
    check_routing(spec)
    if spec == "uniform":
        shares = uniform_load(num_experts)
    elif spec == HOT_EXPERT:
        shares = hot_expert_load(num_experts, hot_expert_fraction(num_experts, top_k))
    elif spec.startswith(REPLAY):
        routing = load_routing(replay_path(spec))
        shares = routing.shares(routing.most_imbalanced_layer() if layer is None else layer, num_experts)
    else:
        kind, _, value = spec.partition(":")
        shares = zipf_shares(num_experts, float(value), seed) if kind == "zipf" else hot_expert_load(num_experts,
                                                                                                float(value))
    return capped_shares(shares, 1.0 / top_k)


def capped_shares(shares_E: list[float], cap: float) -> list[float]:
    """Shares summing to 1 with none above ``cap``: the excess of the capped ones spread over
    the others in proportion (shares that sum to 1 with none above it come back as they are)."""
    total = sum(shares_E)
    if abs(total - 1) < 1e-12 and max(shares_E) <= cap + 1e-12:
        return list(shares_E)
    shares = [s / total for s in shares_E]
    for _ in range(len(shares)):
        over = [e for e, s in enumerate(shares) if s > cap + 1e-12]
        if not over:
            break
        excess = sum(shares[e] - cap for e in over)
        rest = sum(s for e, s in enumerate(shares) if e not in over and s < cap)
        for e in range(len(shares)):
            if e in over:
                shares[e] = cap
            elif rest > 0 and shares[e] < cap:
                shares[e] += excess * shares[e] / rest
    return shares


def pair_counts(shares_E: list[float], tokens: int, top_k: int) -> list[int]:
    """The tokens·top_k pairs of one rank dealt to the experts by largest remainders of the
    capped shares (no expert above ``tokens``: one pair per token)."""
    capped = capped_shares(shares_E, 1.0 / top_k)
    pairs = tokens * top_k
    exact = [share * pairs for share in capped]
    counts = [int(v) for v in exact]
    for e in sorted(range(len(exact)), key=lambda e: exact[e] - counts[e], reverse=True)[:pairs - sum(counts)]:
        counts[e] += 1
    return counts


def routing_load(spec: str, num_experts: int, top_k: int, seed: int = 0, layer: int | None = None) -> list[float]:
    """The simulator's load under ``spec``: each expert's share of the pairs, the shares the
    benches deal their counts from (`pair_counts`: within one pair per expert of them)."""
    return expert_shares(spec, num_experts, top_k, seed, layer)


# -- routing files ----------------------------------------------------------------------------

@dataclass(frozen=True)
class RoutingFile:
    """Per-expert loads of every MoE layer of a run at one step::

        {"kind": "routing", "source": ..., "step": 50, "num_experts": 8, "layers": [[c_0, ..., c_7], ...]}

    (workers/load.py: ``moe_load/l{l}/tokens_e{e}``, the pairs routed to each expert since the
    previous log step, summed over the ranks)."""

    source: str
    step: int | None
    num_experts: int
    layers: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"routing file of {self.source}: no layer loads; the run logged no moe_load/ "
                             f"metrics (train with --log-every N so it logs them)")
        for index, counts in enumerate(self.layers):
            if len(counts) != self.num_experts or any(c < 0 for c in counts) or sum(counts) <= 0:
                raise ValueError(f"routing file of {self.source}: layer {index} has loads {list(counts)}: give "
                                 f"{self.num_experts} non-negative counts with a positive sum")

    def to_json(self) -> dict:
        return {"kind": "routing", "source": self.source, "step": self.step, "num_experts": self.num_experts,
                "layers": [list(c) for c in self.layers]}

    @classmethod
    def from_json(cls, data: dict, where: str = "routing file") -> "RoutingFile":
        if data.get("kind") != "routing" or "layers" not in data or "num_experts" not in data:
            raise ValueError(f"{where} is not a routing file (kind 'routing', num_experts, layers): make one "
                             f"with `mpipemoe routing --run RUN --out FILE`")
        return cls(source=str(data.get("source", where)), step=data.get("step"), num_experts=int(data["num_experts"]),
                   layers=tuple(tuple(int(c) for c in counts) for counts in data["layers"]))

    def imbalance(self, layer: int) -> float:
        counts = self.layers[layer]
        return max(counts) / (sum(counts) / len(counts))

    def most_imbalanced_layer(self) -> int:
        return max(range(len(self.layers)), key=self.imbalance)

    def shares(self, layer: int, num_experts: int) -> list[float]:
        """Layer ``layer``'s (modulo the file's layers) share of the pairs for each of
        ``num_experts`` experts; a file with fewer experts (a divisor of ``num_experts``)
        spreads each of its experts' shares evenly over num_experts / its experts."""
        counts = self.layers[layer % len(self.layers)]
        if num_experts % self.num_experts:
            raise ValueError(f"routing file {self.source} has {self.num_experts} experts per layer; the bench has "
                             f"{num_experts}: give --experts a multiple of {self.num_experts}")
        spread = num_experts // self.num_experts
        total = sum(counts)
        return [counts[e // spread] / total / spread for e in range(num_experts)]


def load_routing(path: str | Path) -> RoutingFile:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--routing replay:{path}: no such file; make one with "
                         f"`mpipemoe routing --run RUN --out {path}`, or give replay:early or replay:late") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--routing replay:{path} is not JSON ({error}): give a file from `mpipemoe routing`") \
            from None
    return RoutingFile.from_json(data, f"--routing replay:{path}")


def save_routing(routing: RoutingFile, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(routing.to_json(), indent=1) + "\n")


def routing_from_metrics(metrics: dict, source: str, step: int | None) -> RoutingFile:
    """The routing in a dict of logged metrics (``moe_load/l{l}/tokens_e{e}`` keys; others ignored)."""
    table: dict[int, dict[int, int]] = {}
    for key, value in metrics.items():
        match = LOAD_KEY.match(key)
        if match:
            table.setdefault(int(match.group(1)), {})[int(match.group(2))] = int(round(value))
    if not table:
        raise ValueError(f"{source}: no moe_load/l<layer>/tokens_e<expert> metrics at step {step}: was it a "
                         f"`mpipemoe train` run that reached a log step (--log-every)?")
    experts = 1 + max(e for row in table.values() for e in row)
    layers = tuple(tuple(table[layer].get(e, 0) for e in range(experts)) for layer in sorted(table))
    return RoutingFile(source=source, step=step, num_experts=experts, layers=layers)
