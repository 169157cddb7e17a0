"""What `mpipemoe simulate` predicts (app/bench/simulate.py): its settings (SimulateSettings),
validated at construction with errors that name the option and the fix."""
from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_PARTITIONS = (1, 2, 4, 8, 16)


def _fail(field: str, value, fix: str) -> None:
    raise ValueError(f"--{field.replace('_', '-')} {value!r} is invalid: {fix}")


@dataclass(frozen=True)
class SimulateSettings:
    """What to simulate; validated at construction (errors name the option and the fix).

    model:          a preset of lm.model (gpt-s, gpt-xl, bert-l, ...).
    tokens:         tokens per GPU, one or several.
    nodes:          node counts to simulate (one, or a sweep).
    gpus_per_node:  GPUs per node.
    experts:        experts per MoE layer; None = max(preset's experts, ranks): one expert per
                    GPU once there are more GPUs than the preset's experts.
    network:        a network preset name or a JSON file of measured figures.
    routing:        a routing of moe_sim/routing.py: uniform, zipf:S, hot-expert, hot:F, replay:FILE,
                    replay:early or replay:late, priced at the shares whose counts the benches impose.
    seed:           the routing's seed (zipf's ranking of the experts), as the bench's --seed.
    partitions:     candidate n for MPipeMoE.
    hierarchical:   use the two-level All-to-All instead of the flat one.
    step:           also simulate a training step of the whole preset.
    expert_parallel: expert-parallel degrees E to price side by side (empty: one expert group
                    of all GPUs, the per-engine table): per E, MPipeMoE's training step with its
                    MoE layers on a group of E GPUs and the expert gradients reduced over the
                    W / E groups; an E that does not divide the experts is shown as not possible.
    """

    model: str
    tokens: tuple
    nodes: tuple
    gpus_per_node: int = 8
    experts: int | None = None
    network: str = "dgx-a100"
    routing: str = "uniform"
    seed: int = 0
    partitions: tuple = DEFAULT_PARTITIONS
    hierarchical: bool = False
    step: bool = False
    expert_parallel: tuple = ()

    def __post_init__(self) -> None:
        from lm.model import PRESETS
        from moe_sim.network import PRESETS as NETWORKS
        from moe_sim.routing import check_routing

        if self.model not in PRESETS:
            _fail("model", self.model, f"choose one of {', '.join(PRESETS)}")
        if not self.tokens or any(t < 1 for t in self.tokens):
            _fail("tokens", self.tokens, "give positive token counts per GPU, e.g. 16384")
        if not self.nodes or any(n < 1 for n in self.nodes):
            _fail("nodes", self.nodes, "give node counts >= 1, e.g. 8 or 1,2,4,8")
        if self.gpus_per_node < 1:
            _fail("gpus_per_node", self.gpus_per_node, "give at least 1 GPU per node")
        if not self.partitions or any(n < 1 for n in self.partitions):
            _fail("partitions", self.partitions, "give partition counts >= 1, e.g. 1,2,4,8,16")
        check_routing(self.routing)
        if self.network not in NETWORKS and not os.path.exists(self.network):
            _fail("network", self.network, f"give {', '.join(NETWORKS)} or a JSON file of measured figures")
        if self.expert_parallel:
            self._check_expert_parallel()
            return
        for nodes in self.nodes:
            ranks = nodes * self.gpus_per_node
            experts = self.experts_for(ranks)
            if experts % ranks:
                _fail("experts", experts, f"it must be a multiple of the {ranks} GPUs of {nodes} node(s), or give "
                      f"--expert-parallel with a degree that divides it")

    def _check_expert_parallel(self) -> None:
        from moe_sim.network import ClusterLayout, expert_degrees

        for nodes in self.nodes:
            layout = ClusterLayout(nodes, self.gpus_per_node)
            valid = expert_degrees(layout)
            if any(e not in valid for e in self.expert_parallel):
                _fail("expert_parallel", ",".join(map(str, self.expert_parallel)),
                      f"on {nodes} node(s) x {self.gpus_per_node} GPUs each degree must divide the {layout.ranks} "
                      f"GPUs and either divide a node's GPUs or be whole nodes: choose from "
                      f"{', '.join(map(str, valid))}")
            experts = self.experts_for(layout.ranks)
            if all(experts % e for e in self.expert_parallel):
                _fail("expert_parallel", ",".join(map(str, self.expert_parallel)),
                      f"no degree divides the {experts} experts per layer: give one of "
                      f"{', '.join(str(e) for e in valid if experts % e == 0)} (or another --experts)")

    def experts_for(self, ranks: int) -> int:
        from lm.model import PRESETS

        return self.experts if self.experts is not None else max(PRESETS[self.model].num_experts, ranks)
