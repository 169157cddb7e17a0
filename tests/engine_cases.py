"""The reference matrix: every engine × partitions × strategy on several routing
scenarios, compared with the brute-force reference (moe_engine/reference.py) in float64.
The engines run in float64 (the experts' per-expert loop: the grouped kernel has no
float64) and in float32 (the grouped kernel, `torch._grouped_mm`, on CPU).

Runs inside each rank (see tests/distributed.py); returns, per (scenario, engine),
the largest error of each compared quantity, so the test can name what broke. With an
expert-parallel degree P < W (``check_matrix(..., degree=P)``) the layers run on expert
groups of P consecutive ranks (workers/distributed.py), and a rank's expert gradients are
the reference's summed over its expert group's ranks only.

The sync-free capacity mode joins as engines named with a ``+capacity`` suffix (the layer
built with ``sync_free_capacity=CAPACITY_FACTOR``, room for every pair: nothing overflows,
so it must equal the reference); it runs on the scenarios where every rank has the same
token count, as the mode needs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_engine import MoEConfig, build_layer
from moe_engine.config import STRATEGIES
from moe_engine.factory import EngineSpec
from moe_engine.reference import reference_moe


@dataclass(frozen=True)
class Scenario:
    name: str
    config: MoEConfig
    tokens: tuple  # tokens per rank, indexed by rank % len(tokens)
    three_d: bool = False
    skew_to_expert: int | None = None  # every token's first choice is this expert
    seed: int = 0

    @property
    def same_tokens_on_every_rank(self) -> bool:
        return len(set(self.tokens)) == 1


SCENARIOS = [
    Scenario("k2_dropless_gelu", MoEConfig(8, 12, 8, top_k=2, activation="gelu"), (9, 13, 6, 11)),
    Scenario("k1_capacity_overflow_relu", MoEConfig(8, 12, 8, top_k=1, capacity_factor=0.5, activation="relu"),
             (12, 9, 14, 7)),
    Scenario("k2_capacity_swiglu_3d", MoEConfig(8, 12, 8, top_k=2, capacity_factor=1.0, activation="swiglu"),
             (10, 8, 12, 6), three_d=True),
    Scenario("all_tokens_to_one_expert", MoEConfig(8, 12, 8, top_k=2, capacity_factor=None), (10, 7, 9, 12),
             skew_to_expert=3),
    Scenario("one_expert_capacity_overflow_k1", MoEConfig(8, 12, 8, top_k=1, capacity_factor=1.0, bias=False),
             (10, 11, 8, 9), skew_to_expert=5),
    # Mixtral's gate without biases: weight 1 for the one choice (softmax-then-topk gives its
    # probability), so an engine that ignores the rule fails here
    Scenario("k1_topk_then_softmax_swiglu_no_bias",
             MoEConfig(8, 12, 8, top_k=1, activation="swiglu", bias=False, router_rule="topk-then-softmax"),
             (9, 12, 7, 10)),
    Scenario("empty_experts", MoEConfig(8, 12, 8, top_k=1, activation="relu"), (2, 3, 1, 2)),
    Scenario("empty_batch_on_some_ranks", MoEConfig(8, 12, 8, top_k=2), (0, 7, 0, 5)),
    # the same token count on every rank (the sync-free capacity mode's condition)
    Scenario("k2_same_tokens_swiglu", MoEConfig(8, 12, 8, top_k=2, activation="swiglu"), (10,)),
    # the router's capacity drops pairs, and at n = 3 one partition has no token
    Scenario("k1_same_tiny_batch_capacity_skewed", MoEConfig(8, 12, 8, top_k=1, capacity_factor=1.0,
                                                             activation="relu"), (2,), skew_to_expert=2),
]

# C_i = ceil(8 · K · T_i / E) rows per expert: at least T_i with E = 8, the most pairs one
# expert can get from a partition of T_i tokens, so nothing overflows
CAPACITY_FACTOR = 8.0
CAPACITY = "+capacity"

ENGINES = (["fastmoe"]
           + [f"mpipemoe:{n}:{s}" for n in (1, 2, 3, 4, 7) for s in STRATEGIES]
           + [f"fastermoe:{g}" for g in (1, 2, 4)]
           # split by peers: n divides the expert group's size, so each runs where it can
           + [f"mpipemoe:2:{s}:peers" for s in STRATEGIES] + [f"mpipemoe:4:{s}:peers" for s in ("none", "S4")]
           # the sync-free capacity mode
           + [f"fastmoe{CAPACITY}"] + [f"mpipemoe:{n}:{s}{CAPACITY}" for n in (1, 2, 3) for s in ("none", "S1", "S4")])


def runs_on(spec: str, expert_group_size: int, scenario: Scenario | None = None) -> bool:
    """Whether the engine spec can run on an expert group of that many ranks (a peer split's
    n must divide it) and, given, on the scenario (the capacity mode: the same token count
    on every rank)."""
    if spec.endswith(CAPACITY):
        return scenario is None or scenario.same_tokens_on_every_rank
    parsed = EngineSpec.parse(spec)
    return not (parsed.split == "peers" and expert_group_size % parsed.partitions)


def build_engine(spec: str, config: MoEConfig, group=None, dtype=torch.float64):
    """The layer of an engine spec, or of a spec with the ``+capacity`` suffix."""
    if spec.endswith(CAPACITY):
        return build_layer(spec[:-len(CAPACITY)], config, group, dtype=dtype, sync_free_capacity=CAPACITY_FACTOR)
    return build_layer(spec, config, group, dtype=dtype)


@dataclass
class Problem:
    """Global parameters, every rank's input and upstream gradient, and the reference answer."""

    params: dict
    x: list
    grad_y: list
    aux_coef: float
    ref_y: list = field(default_factory=list)
    ref_aux: list = field(default_factory=list)
    ref_dx: list = field(default_factory=list)
    ref_router_grad: list = field(default_factory=list)   # per rank (its own loss only)
    ref_expert_grads: dict = field(default_factory=dict)  # summed over ranks
    ref_expert_grads_by_rank: list = field(default_factory=list)  # each rank's own loss

    def expert_grads_of(self, ranks) -> dict:
        """The reference expert gradients summed over the losses of ``ranks``."""
        return {name: sum(self.ref_expert_grads_by_rank[r][name] for r in ranks)
                for name in self.ref_expert_grads_by_rank[0]}


def make_problem(s: Scenario, world_size: int, dtype=torch.float64) -> Problem:
    c = s.config
    g = torch.Generator().manual_seed(1000 + s.seed)
    E, D, H = c.num_experts, c.d_model, c.d_hidden
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)  # noqa
    params = {
        "router.weight": rnd(E, D, scale=D ** -0.5),
        "experts.w1": rnd(E, D, H, scale=D ** -0.5),
        "experts.w2": rnd(E, H, D, scale=H ** -0.5),
    }
    if c.bias:
        params["experts.b1"] = rnd(E, H, scale=0.1)
        params["experts.b2"] = rnd(E, D, scale=0.1)
    if c.gated:
        params["experts.w3"] = rnd(E, D, H, scale=D ** -0.5)
    if s.skew_to_expert is not None:
        params["router.weight"][s.skew_to_expert, 0] = 4.0
    xs, grads = [], []
    for r in range(world_size):
        T = s.tokens[r % len(s.tokens)]
        x = rnd(T, D)
        if s.skew_to_expert is not None:
            x[:, 0] = 6.0 + rnd(T, scale=0.1)
        xs.append(x)
        grads.append(rnd(T, D))
    return Problem(params, xs, grads, aux_coef=0.37)


def solve_reference(problem: Problem, config: MoEConfig) -> None:
    """Fill in the reference answer with autograd over the brute-force layer."""
    for x, gy in zip(problem.x, problem.grad_y):
        leaves = {k: v.clone().requires_grad_(True) for k, v in problem.params.items()}
        x = x.clone().requires_grad_(True)
        router_w = leaves["router.weight"]
        y, aux = reference_moe(x, router_w, leaves["experts.w1"], leaves.get("experts.b1"),
                               leaves["experts.w2"], leaves.get("experts.b2"), leaves.get("experts.w3"), config)
        loss = (y * gy).sum() + problem.aux_coef * aux
        loss.backward()
        problem.ref_y.append(y.detach())
        problem.ref_aux.append(aux.detach())
        problem.ref_dx.append(x.grad if x.grad is not None else torch.zeros_like(x))
        problem.ref_router_grad.append(router_w.grad if router_w.grad is not None else torch.zeros_like(router_w))
        problem.ref_expert_grads_by_rank.append({k: v.grad if v.grad is not None else torch.zeros_like(v)
                                                 for k, v in leaves.items() if k.startswith("experts.")})
    problem.ref_expert_grads = problem.expert_grads_of(range(len(problem.x)))


def load_params(layer, problem: Problem, rank: int) -> None:
    """Load the global parameters; ``rank``: the layer's rank in its expert group."""
    L = layer.local_experts
    with torch.no_grad():
        for name, p in layer.named_parameters():
            full = problem.params[name]
            p.copy_(full if name == "router.weight" else full[rank * L:(rank + 1) * L])


def max_errors(layer, problem: Problem, scenario: Scenario, rank: int, degree: int | None = None) -> dict:
    """Run the layer on this rank's problem; largest |engine − reference| per quantity.
    ``degree``: the expert-parallel degree P (None: all ranks, one expert group)."""
    dtype = layer.router.weight.dtype
    x = problem.x[rank].clone().to(dtype)
    if scenario.three_d:
        x = x.reshape(2, -1, x.shape[-1])
    x.requires_grad_(True)
    y, aux = layer(x)
    assert y.shape == x.shape, f"output shape {tuple(y.shape)} != input shape {tuple(x.shape)}"
    loss = (y.reshape(-1, y.shape[-1]) * problem.grad_y[rank].to(dtype)).sum() + problem.aux_coef * aux
    loss.backward()
    L = layer.local_experts
    P = degree or len(problem.x)
    first = rank - rank % P  # this rank's expert group: ranks first .. first + P - 1
    expert_grads = problem.expert_grads_of(range(first, first + P))
    expert_rank = rank % P
    err = lambda a, b: float((a.reshape(b.shape).double() - b).abs().max()) if b.numel() else 0.0  # noqa: E731
    errors = {
        "y": err(y.detach(), problem.ref_y[rank]),
        "aux_loss": err(aux.detach(), problem.ref_aux[rank]),
        "dx": err(x.grad, problem.ref_dx[rank]),
        "router.weight.grad": err(layer.router.weight.grad, problem.ref_router_grad[rank]),
    }
    for name, p in layer.named_parameters():
        if name.startswith("experts."):
            ref = expert_grads[name][expert_rank * L:(expert_rank + 1) * L]
            errors[name + ".grad"] = err(p.grad if p.grad is not None else torch.zeros_like(p), ref)
    if layer.sync_free_capacity is not None:
        errors["pairs overflowed"] = float(layer.overflowed)  # the matrix's capacity has room for all
    return errors


def check_matrix(rank: int, world_size: int, scenario_names: list, engines: list,
                 dtype: torch.dtype = torch.float64, degree: int | None = None) -> dict:
    """Per rank: {(scenario, engine): {quantity: max error}}, the engines run in `dtype`
    against the float64 reference, on expert groups of ``degree`` ranks (None: the world)."""
    from moe_engine.comm import ExpertGroup
    from workers.distributed import ExpertLayout, expert_groups

    layout = ExpertLayout(rank, world_size, degree or world_size)
    group = ExpertGroup(expert_groups(layout)[0]) if world_size > 1 else None
    results = {}
    for scenario in SCENARIOS:
        if scenario.name not in scenario_names:
            continue
        problem = make_problem(scenario, world_size)
        solve_reference(problem, scenario.config)
        for spec in (e for e in engines if runs_on(e, layout.degree, scenario)):
            torch.manual_seed(0)
            layer = build_engine(spec, scenario.config, group, dtype=dtype)
            load_params(layer, problem, layout.expert_rank)
            results[(scenario.name, spec)] = max_errors(layer, problem, scenario, rank, layout.degree)
    return results


def check_layouts(rank: int, world_size: int, scenario_names: list, engines: list, layouts: list) -> dict:
    """Per rank: {(dtype, degree): check_matrix's result} for each (dtype, degree) of
    ``layouts``, in one process group: each group costs a start of ``world_size`` processes
    (torch imported in each), the longest part of a small layout's check on 2 cores."""
    return {(dtype, degree): check_matrix(rank, world_size, scenario_names, engines, dtype, degree)
            for dtype, degree in layouts}


def check_micro_batch_schedules(rank: int, world_size: int, scenario_names: list, engines: list,
                                schedule: str = "overlapped", micro_batches: int = 2) -> dict:
    """Per rank: {(scenario, engine): {quantity: max error}} of ``micro_batches`` micro-batches
    run by ``workers.schedules.forward_backward`` under ``schedule`` (the overlapped one: the
    forward of k+1 beside the backward of k, each on its lane), against the reference summed
    over the micro-batches: every micro-batch's output, aux loss and input gradient, and the
    accumulated router and expert gradients."""
    import dataclasses

    from workers.schedules import Lanes, forward_backward

    results: dict = {}
    lanes = None
    for scenario in SCENARIOS:
        if scenario.name not in scenario_names:
            continue
        problems = [make_problem(dataclasses.replace(scenario, seed=scenario.seed + m), world_size)
                    for m in range(micro_batches)]
        for problem in problems:
            problem.params = problems[0].params  # one model, different tokens per micro-batch
            solve_reference(problem, scenario.config)
        for spec in (e for e in engines if runs_on(e, world_size, scenario)):
            torch.manual_seed(0)
            layer = build_engine(spec, scenario.config)
            load_params(layer, problems[0], rank)
            if schedule == "overlapped":
                lanes = Lanes.create(layer) if lanes is None else lanes.reuse(layer)
            leaves = [p.x[rank].clone().requires_grad_(True) for p in problems]

            def loss_of(module, m):
                y, aux = module(leaves[m])
                loss = (y * problems[m].grad_y[rank]).sum() + problems[m].aux_coef * aux
                return loss, (y.detach(), aux.detach())

            records = forward_backward(layer, range(micro_batches), loss_of, schedule=schedule,
                                       lanes=lanes if schedule == "overlapped" else None)
            err = lambda a, b: float((a.reshape(b.shape).double() - b).abs().max()) if b.numel() else 0.0  # noqa: E731
            errors = {}
            for m, (problem, (y, aux)) in enumerate(zip(problems, records)):
                errors[f"y[{m}]"] = err(y, problem.ref_y[rank])
                errors[f"aux_loss[{m}]"] = err(aux, problem.ref_aux[rank])
                errors[f"dx[{m}]"] = err(leaves[m].grad, problem.ref_dx[rank])
            errors["router.weight.grad"] = err(layer.router.weight.grad,
                                               sum(p.ref_router_grad[rank] for p in problems))
            L = layer.local_experts
            for name, param in layer.named_parameters():
                if name.startswith("experts."):
                    ref = sum(p.ref_expert_grads[name] for p in problems)[rank * L:(rank + 1) * L]
                    errors[name + ".grad"] = err(param.grad if param.grad is not None else torch.zeros_like(param), ref)
            results[(scenario.name, spec)] = errors
    if lanes is not None:
        lanes.close()
    return results
