"""Token routings the benchmarks impose: uniform, skewed, and a routing replayed from a real
training run (docs/emulation.md, "Routing replayed from a run").

    mpipemoe routing --run gpt-s-20261205 --step 50 --out out/routing-gpt-s-50.json
    mpipemoe bench --model gpt-xl --emulate 8x8 --experts 64 --routing uniform,skewed,replay:out/routing-gpt-s-50.json

A routing file is what `mpipemoe train` logged (workers/load.py: ``moe_load/l{l}/tokens_e{e}``,
the (token, choice) pairs routed to each expert of each MoE layer since the previous log
step, summed over the ranks) at one step, as JSON::

    {"kind": "routing", "source": ..., "step": 50, "num_experts": 8, "layers": [[c_0, ..., c_7], ...]}

The benches replay it by pushing each token's input towards the router rows of the experts
it should pick: the (token, choice) pairs are dealt to the experts in proportion to the
layer's shares, ``top_k`` distinct experts per token (`assign_experts`), and each token gets
PUSH times the unit router row of each of its experts added to its input, which puts them on
top of its logits (a random token's logit has a standard deviation of the row's norm; the
push adds PUSH of them). An expert can take a token once, so its share is capped at 1 / top_k. ``skewed`` is the layer bench's: every other token pushed towards expert 0 alone (SKEWED_TOKENS).

A file from a run with fewer experts than the bench's E (a multiple of it) spreads each of
its experts' shares evenly over E / E_file bench experts. The experts are then laid out so
the rank that receives the most rows is rank 0: an emulated cluster times rank 0, and a real
step waits for its busiest rank (the layer bench swaps router rows to the same end).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

PUSH = 8.0  # router-row norms added to a token's logit for each expert it is pushed towards
LOAD_KEY = re.compile(r"^moe_load/l(\d+)/tokens_e(\d+)$")
REPLAY = "replay:"
NAMED = ("uniform", "skewed")
# The skewed routing's hot tokens: every other token of the batch, so that they are spread
# over it as a real batch's are and every partition of a token split carries the same share.
# (Until 2026-12-07 they were the first half: MPipeMoE's first partition then held them all,
# and n = 2 gained nothing over n = 1 in the skewed records of that time.)
SKEWED_TOKENS = slice(0, None, 2)


@dataclass(frozen=True)
class RoutingFile:
    """Per-expert loads of every MoE layer of a run at one step (module docstring)."""

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
        ``num_experts`` experts (module docstring: a file with fewer experts is spread)."""
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
                         f"`mpipemoe routing --run RUN --out {path}`") from None
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


def check_routing(spec: str) -> None:
    """Raise ValueError unless ``spec`` is uniform, skewed or replay:FILE of a readable routing file."""
    if spec in NAMED:
        return
    if spec.startswith(REPLAY):
        load_routing(spec[len(REPLAY):])
        return
    raise ValueError(f"--routing {spec!r} is unknown: choose from uniform, skewed, replay:FILE "
                     f"(a file from `mpipemoe routing`)")


def target_shares(spec: str, num_experts: int, layer: int | None = None) -> list[float] | None:
    """The expert shares ``spec`` asks for at MoE layer ``layer`` (None: the file's most
    imbalanced layer, as the layer bench replays); None for uniform and skewed."""
    if not spec.startswith(REPLAY):
        return None
    routing = load_routing(spec[len(REPLAY):])
    return routing.shares(routing.most_imbalanced_layer() if layer is None else layer, num_experts)


def busiest_rank_first(shares_E: list[float], ranks: int) -> list[float]:
    """The shares with the rank blocks rotated so that rank 0's experts take the most rows."""
    local = len(shares_E) // ranks
    per_rank = [sum(shares_E[r * local:(r + 1) * local]) for r in range(ranks)]
    hot = max(range(ranks), key=per_rank.__getitem__)
    return shares_E[hot * local:] + shares_E[:hot * local]


def routing_push(spec: str, router_ED: torch.Tensor, tokens: int, top_k: int, ranks: int = 1,
                 layer: int | None = None, seed: int = 0, impose_uniform: bool = False) -> torch.Tensor | None:
    """Local. [tokens, D] to add to a layer's input so that its router routes as ``spec``
    says (module docstring), in the router's dtype and device. Uniform: None, the inputs'
    own routing (the layer bench's random inputs route near-uniformly), or with
    ``impose_uniform`` equal shares pushed like a replay's, and skewed's other half too:
    the step bench's, whose model routes its own activations (at initialization most of a
    layer's tokens can pick one expert: 28% of gpt-s's at 64 experts, on an H100), which
    an emulated cluster's ranks would all send to rank 0 (moe_sim/emulation.py)."""
    if spec == "uniform" and not impose_uniform:
        return None
    unit_ED = router_ED.detach().float()
    unit_ED = unit_ED / unit_ED.norm(dim=1, keepdim=True).clamp_min(1e-12)
    push_TD = torch.zeros(tokens, router_ED.shape[1], device=router_ED.device)
    equal_E = [1.0] * router_ED.shape[0]
    if spec == "skewed":
        push_TD[SKEWED_TOKENS] = PUSH * unit_ED[0]
        rest = tokens // 2  # the tokens between the hot ones
        if impose_uniform and rest:
            picks_TK = assign_experts(equal_E, rest, top_k, seed).to(router_ED.device)
            push_TD[1::2] += PUSH * unit_ED[picks_TK].sum(1)
        return push_TD.to(router_ED.dtype)
    shares_E = equal_E if spec == "uniform" else target_shares(spec, router_ED.shape[0], layer)
    assert shares_E is not None  # check_routing: a replay
    picks_TK = assign_experts(busiest_rank_first(shares_E, ranks), tokens, top_k, seed).to(router_ED.device)
    push_TD += PUSH * unit_ED[picks_TK].sum(1)
    return push_TD.to(router_ED.dtype)


def assign_experts(shares_E: list[float], tokens: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """Local. [tokens, top_k] distinct experts per token whose pair counts follow ``shares_E``
    (largest remainders; an expert's share capped at 1 / top_k, one pair per token): the
    pairs sorted by expert, token t taking pairs t, T + t, ... (distinct under the cap), the
    tokens then shuffled."""
    capped = _capped(shares_E, 1.0 / top_k)
    pairs = tokens * top_k
    exact = [share * pairs for share in capped]
    counts = [int(v) for v in exact]
    for e in sorted(range(len(exact)), key=lambda e: exact[e] - counts[e], reverse=True)[:pairs - sum(counts)]:
        counts[e] += 1
    ids_P = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    picks_TK = ids_P.view(top_k, tokens).t()
    return picks_TK[torch.randperm(tokens, generator=torch.Generator().manual_seed(seed))]


def _capped(shares_E: list[float], cap: float) -> list[float]:
    """Shares summing to 1 with none above ``cap``: the excess of the capped ones spread over
    the others in proportion."""
    shares = [s / sum(shares_E) for s in shares_E]
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


def extract_routing(tracking_uri: str, run: str, step: int | None = None, experiment: str | None = None
                    ) -> RoutingFile:
    """The routing a `mpipemoe train` run logged at ``step`` (None: its last log step), from
    the MLflow store; ``run`` is a run id or a run name (the newest run of that name)."""
    from app.tracking.store import client, metric_history

    mlflow_client = client(tracking_uri)
    run_id = _find_run(mlflow_client, run, experiment)
    keys = [key for key in mlflow_client.get_run(run_id).data.metrics if LOAD_KEY.match(key)]
    if not keys:
        raise ValueError(f"--run {run}: it logged no moe_load/ metrics; train with --log-every N (a log step "
                         f"writes the per-expert loads)")
    histories = {key: dict(metric_history(tracking_uri, run_id, key)) for key in keys}
    steps = sorted(set.intersection(*(set(h) for h in histories.values())))
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise ValueError(f"--step {step}: run {run} logged the loads at steps {', '.join(map(str, steps))}; "
                         f"give one of them")
    return routing_from_metrics({key: h[chosen] for key, h in histories.items()}, f"mlflow run {run}", chosen)


def _find_run(mlflow_client, run: str, experiment: str | None) -> str:
    try:
        return str(mlflow_client.get_run(run).info.run_id)
    except Exception:  # not an id: look the name up (MLflow raises its own exception types)
        pass
    experiments = [e.experiment_id for e in mlflow_client.search_experiments()
                   if experiment is None or e.name == experiment]
    found = mlflow_client.search_runs(experiments, filter_string=f"attributes.run_name = '{run}'",
                                      order_by=["attributes.start_time DESC"], max_results=1) if experiments else []
    if not found:
        raise ValueError(f"--run {run}: no MLflow run has that id or name"
                         f"{'' if experiment is None else f' in experiment {experiment!r}'}; list runs with "
                         f"`mpipemoe ui`")
    return str(found[0].info.run_id)
