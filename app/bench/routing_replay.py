"""How the benchmarks impose a routing of moe_sim/routing.py (uniform, zipf:S, hot-expert, hot:F,
replay:FILE, replay:early, replay:late; docs/emulation.md, "Routings") on a layer's router, and
`extract_routing`: a training run's logged loads as a routing file (`mpipemoe routing`).

    mpipemoe routing --run gpt-s-20261205 --step 50 --out out/routing-gpt-s-50.json
    mpipemoe bench --model gpt-xl --emulate 8x8 --experts 64 --routing uniform,zipf:1.2,replay:out/routing-gpt-s-50.json

The benches impose a routing by pushing each token's input towards the router rows of the
experts it should pick: the (token, choice) pairs are dealt to the experts by the counts of
moe_sim/routing.py `pair_counts` (of the shares the simulator prices), ``top_k`` distinct
experts per token (`assign_experts`), and each token gets PUSH times the unit router row of
each of its experts added to its input, which puts them on top of its logits (a random
token's logit has a standard deviation of the row's norm; the push adds PUSH of them).
``hot-expert`` pushes every other token towards expert 0 alone (HOT_EXPERT_TOKENS); the layer
bench's ``uniform`` and the other half of its ``hot-expert`` tokens route as its random inputs
do (near-uniformly).

The experts are then laid out so the rank that receives the most rows is rank 0: an emulated
cluster times rank 0, and a real step waits for its busiest rank (the layer bench swaps router
rows to the same end).
"""
from __future__ import annotations

import torch

from moe_sim.routing import HOT_EXPERT, LOAD_KEY, RoutingFile, expert_shares, pair_counts, routing_from_metrics

PUSH = 8.0  # router-row norms added to a token's logit for each expert it is pushed towards
# The hot-expert routing's hot tokens: every other token of the batch, so that they are spread
# over it as a real batch's are and every partition of a token split carries the same share.
# (Until 2026-12-07 they were the first half: MPipeMoE's first partition then held them all,
# and n = 2 gained nothing over n = 1 in the skewed records of that time.)
HOT_EXPERT_TOKENS = slice(0, None, 2)


def busiest_rank_first(shares_E: list[float], ranks: int) -> list[float]:
    """The shares with the rank blocks rotated so that rank 0's experts take the most rows."""
    local = len(shares_E) // ranks
    per_rank = [sum(shares_E[r * local:(r + 1) * local]) for r in range(ranks)]
    hot = max(range(ranks), key=per_rank.__getitem__)
    return shares_E[hot * local:] + shares_E[:hot * local]


def routing_push(spec: str, router_ED: torch.Tensor, tokens: int, top_k: int, ranks: int = 1,
                 layer: int | None = None, seed: int = 0, impose_uniform: bool = False) -> torch.Tensor | None:
    """Local. [tokens, D] to add to a layer's input so that its router routes as ``spec``
    says (module docstring), in the router's dtype and device; ``layer`` picks a replay's MoE
    layer (None: the file's most imbalanced one), ``seed`` zipf's ranking (every layer's
    alike, as the simulator prices it) and, plus ``layer``, the tokens' shuffle. Uniform: None, the inputs' own routing (the layer bench's random inputs route
    near-uniformly), or with ``impose_uniform`` equal shares pushed like the others, and
    hot-expert's other half too: the step bench's, whose model routes its own activations (at
    initialization most of a layer's tokens can pick one expert: 28% of gpt-s's at 64
    experts, on an H100), which an emulated cluster's ranks would all send to rank 0
    (moe_sim/emulation.py)."""
    if spec == "uniform" and not impose_uniform:
        return None
    unit_ED = router_ED.detach().float()
    unit_ED = unit_ED / unit_ED.norm(dim=1, keepdim=True).clamp_min(1e-12)
    push_TD = torch.zeros(tokens, router_ED.shape[1], device=router_ED.device)
    num_experts = router_ED.shape[0]
    shuffle_seed = seed + (layer or 0)
    if spec == HOT_EXPERT:
        push_TD[HOT_EXPERT_TOKENS] = PUSH * unit_ED[0]
        rest = tokens // 2  # the tokens between the hot ones
        if impose_uniform and rest:
            picks_TK = assign_experts([1.0] * num_experts, rest, top_k, shuffle_seed).to(router_ED.device)
            push_TD[1::2] += PUSH * unit_ED[picks_TK].sum(1)
        return push_TD.to(router_ED.dtype)
    shares_E = expert_shares(spec, num_experts, top_k, seed, layer)
    picks_TK = assign_experts(busiest_rank_first(shares_E, ranks), tokens, top_k, shuffle_seed).to(router_ED.device)
    push_TD += PUSH * unit_ED[picks_TK].sum(1)
    return push_TD.to(router_ED.dtype)


def assign_experts(shares_E: list[float], tokens: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """Local. [tokens, top_k] distinct experts per token whose pair counts are
    moe_sim/routing.py `pair_counts` of ``shares_E`` (an expert's share capped at 1 / top_k,
    one pair per token): the pairs sorted by expert, token t taking pairs t, T + t, ...
    (distinct under the cap), the tokens then shuffled."""
    counts = pair_counts(shares_E, tokens, top_k)
    ids_P = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    picks_TK = ids_P.view(top_k, tokens).t()
    return picks_TK[torch.randperm(tokens, generator=torch.Generator().manual_seed(seed))]


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
