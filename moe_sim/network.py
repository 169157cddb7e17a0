"""Network model of a GPU cluster for the schedule simulator (docs/design.md §2, §7).

A cluster is `nodes` × G GPUs (W = nodes·G ranks, rank r on node r // G). Two
kinds of link carry an All-to-All:

* intra-node (NVLink through NVSwitch): per GPU, one direction,
  ``intra_bytes_per_s``; a message costs ``intra_message_s``;
* inter-node (InfiniBand, one NIC per GPU, rail-matched):
  per GPU, one direction, ``inter_bytes_per_s``; a message costs
  ``inter_message_s``.

Both links run at once, so a flat All-to-All takes

    collective_s + max(intra time, inter time),
    link time = messages on that link × message cost + bytes on it / bandwidth

where the bytes and messages are those of the busiest rank on that link, in
whichever direction is larger (the receiving side of a hot expert is usually
the bottleneck). A rank's own rows move through device memory and are not
network traffic. Routing decides which fraction of a rank's rows leaves its
node (`Traffic`): uniform routing over the nodes sends (nodes−1)/nodes of the rows off
the node and (G−1)/W over NVLink; a skewed routing (moe_sim/routing.py) loads the ranks
of the hot experts.

A hierarchical All-to-All (`hierarchical_all_to_all_s`) first exchanges over
NVLink so that each GPU holds the rows for "its" rail of every other node,
then sends one message per remote node over InfiniBand, then scatters over
NVLink again: nodes−1 inter-node messages of G·b/W bytes instead of W−G messages
of b/W — it pays when per-message costs dominate.

Defaults are datasheet figures (see PRESETS); a JSON file of measured figures
overrides them (`load_network`).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace


def _fail(field: str, value, fix: str) -> None:
    raise ValueError(f"NetworkProfile.{field}={value!r} is invalid: {fix}")


@dataclass(frozen=True)
class NetworkProfile:
    """Bandwidths are bytes per second per GPU in one direction; times are seconds.

    name:               what this profile describes.
    intra_bytes_per_s:  NVLink bandwidth of one GPU, one direction.
    inter_bytes_per_s:  InfiniBand bandwidth of one GPU (its NIC), one direction.
    intra_message_s:    cost of one message between GPUs of a node.
    inter_message_s:    cost of one message between nodes (NIC, switch, RDMA set-up).
    collective_s:       fixed cost of one collective call (launch and completion).
    source:             where the figures come from.
    """

    name: str
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    intra_message_s: float = 1e-6
    inter_message_s: float = 3e-6
    collective_s: float = 15e-6
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("intra_bytes_per_s", "inter_bytes_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                _fail(name, value, "give a bandwidth in bytes per second > 0 (e.g. 300e9 for NVLink3)")
        for name in ("intra_message_s", "inter_message_s", "collective_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                _fail(name, value, "give a time in seconds >= 0 (e.g. 3e-6)")

    def to_json(self) -> dict:
        return asdict(self)


GB = 1e9
# Datasheet figures, per GPU and direction. NVLink: NVIDIA's "GPU-to-GPU bandwidth" is
# the bidirectional aggregate, so one direction is half. InfiniBand: a DGX node has one
# compute NIC per GPU (8 per node); a link rate in Gb/s over 8 is bytes per second.
PRESETS: dict[str, NetworkProfile] = {
    "dgx-a100": NetworkProfile(
        "dgx-a100", intra_bytes_per_s=300 * GB, inter_bytes_per_s=200 / 8 * GB,
        source="NVIDIA A100 datasheet: NVLink3 600 GB/s per GPU bidirectional (300 GB/s each way); "
               "DGX A100 datasheet: 8x ConnectX-6 HDR InfiniBand 200 Gb/s compute NICs per node "
               "(one per GPU: 25 GB/s each way). Message and call costs are assumptions (1/3/15 us), "
               "not datasheet figures."),
    "dgx-h200": NetworkProfile(
        "dgx-h200", intra_bytes_per_s=450 * GB, inter_bytes_per_s=400 / 8 * GB,
        source="NVIDIA H200 datasheet: NVLink4 900 GB/s per GPU bidirectional (450 GB/s each way); "
               "DGX H200 datasheet: 8x ConnectX-7 NDR InfiniBand 400 Gb/s compute NICs per node "
               "(one per GPU: 50 GB/s each way). Message and call costs are assumptions (1/3/15 us), "
               "not datasheet figures."),
}


def load_network(name_or_path: str) -> NetworkProfile:
    """A preset by name, or a JSON file of measured figures.

    The file holds NetworkProfile fields; a ``"base"`` entry names the preset the
    other fields override (default dgx-a100), so a file may give only what was measured:
    ``{"base": "dgx-a100", "inter_bytes_per_s": 21.5e9, "name": "our-cluster"}``.
    """
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    try:
        with open(name_or_path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"network={name_or_path!r} is neither a preset ({', '.join(PRESETS)}) "
                         f"nor a JSON file") from None
    base_name = data.pop("base", "dgx-a100")
    if base_name not in PRESETS:
        raise ValueError(f"network file {name_or_path}: base={base_name!r} is unknown; "
                         f"choose one of {', '.join(PRESETS)}")
    known = {f.name for f in fields(NetworkProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"network file {name_or_path}: unknown field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    return replace(PRESETS[base_name], **{"source": f"measured ({name_or_path}) over {base_name}", **data})


@dataclass(frozen=True)
class ClusterLayout:
    """`nodes` × G GPUs; rank r is GPU r % G of node r // G."""

    nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ClusterLayout.{name}={value!r} is invalid: give an integer >= 1")

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node


EXPERT_PARALLEL_FLAG = "--expert-parallel"


def expert_degrees(layout: ClusterLayout) -> list[int]:
    """The expert-parallel degrees P the simulator and the emulator take on ``layout``: P
    divides W and every expert group lies alike on the nodes (P divides a node's GPUs, or
    is whole nodes)."""
    G = layout.gpus_per_node
    return [p for p in range(1, layout.ranks + 1) if layout.ranks % p == 0 and (G % p == 0 or p % G == 0)]


def expert_group_layouts(layout: ClusterLayout, degree: int | None) -> tuple[ClusterLayout, ClusterLayout]:
    """(expert group, expert-data-parallel group) of ``layout`` with expert-parallel degree
    ``degree`` (None: W, one expert group): the P consecutive ranks whose All-to-Alls run
    together (inside one node when P <= G), and the W / P ranks P apart that hold the same
    experts and reduce their gradients (one per node when P >= G; G / P per node otherwise).
    Raises ValueError naming ``--expert-parallel`` and the valid degrees."""
    W, G = layout.ranks, layout.gpus_per_node
    degree = W if degree is None else degree
    if isinstance(degree, bool) or not isinstance(degree, int) or degree not in expert_degrees(layout):
        valid = ", ".join(str(p) for p in expert_degrees(layout))
        raise ValueError(f"expert_parallel={degree!r} is invalid on {layout.nodes}x{G}: the expert-parallel degree "
                         f"must divide the {W} ranks and either divide a node's {G} GPUs or be whole nodes; use "
                         f"{EXPERT_PARALLEL_FLAG} {valid}")
    if degree >= G:
        return ClusterLayout(degree // G, G), ClusterLayout(W // degree, 1)
    return ClusterLayout(1, degree), ClusterLayout(layout.nodes, G // degree)


# -- load vectors (the routings that make them: moe_sim/routing.py) ---------------------------

def uniform_load(num_experts: int) -> list[float]:
    """Every expert gets the same share of the routed rows."""
    return [1.0 / num_experts] * num_experts


def hot_expert_load(num_experts: int, hot_fraction: float) -> list[float]:
    """Expert 0 gets `hot_fraction` of the rows, the others share the rest evenly
    (hot_fraction = 1: every row to one expert)."""
    if not 0 <= hot_fraction <= 1:
        raise ValueError(f"hot_fraction={hot_fraction!r} is invalid: give a fraction in [0, 1]")
    if num_experts == 1:
        return [1.0]
    rest = (1 - hot_fraction) / (num_experts - 1)
    return [hot_fraction] + [rest] * (num_experts - 1)


def rank_load(load_E: list[float], ranks: int) -> list[float]:
    """Share of the routed rows each rank's experts receive (expert e on rank e // (E / W))."""
    if len(load_E) % ranks:
        raise ValueError(f"{len(load_E)} experts do not spread evenly over {ranks} ranks; "
                         f"use a multiple of {ranks} experts")
    per_rank = len(load_E) // ranks
    total = sum(load_E)
    return [sum(load_E[r * per_rank:(r + 1) * per_rank]) / total for r in range(ranks)]


@dataclass(frozen=True)
class Traffic:
    """What one All-to-All asks of the busiest rank, as multiples of the rows one rank
    sends (every rank sends the same number of rows, b = k·T/n).

    intra: rows over the busiest rank's NVLink (max of its send and receive);
    inter: rows over the busiest rank's NIC (max of send and receive);
    intra_messages / inter_messages: peers that rank exchanges rows with per link;
    received: rows the busiest receiver gets (its expert work), including its own;
    leaving_node: mean fraction of a rank's rows that leave its node.
    """

    intra: float
    inter: float
    intra_messages: int
    inter_messages: int
    received: float
    leaving_node: float


def all_to_all_traffic(layout: ClusterLayout, load_E: list[float], peers: list[int] | None = None) -> Traffic:
    """Traffic of one All-to-All in which every rank sends its rows by `load_E`.

    peers: ring offsets this exchange covers (FasterMoE steps talk to a group of peers);
    None means every rank. Rows for ranks outside `peers` are not part of this exchange.
    """
    import numpy as np

    W, G = layout.ranks, layout.gpus_per_node
    share_W = np.asarray(rank_load(load_E, W))
    offsets_J = np.arange(W) if peers is None else np.asarray(peers)
    src_WJ = np.repeat(np.arange(W)[:, None], len(offsets_J), axis=1)
    dst_WJ = (src_WJ + offsets_J[None, :]) % W
    rows_WJ = share_W[dst_WJ]
    remote_WJ = (dst_WJ != src_WJ) & (rows_WJ > 0)
    inter_WJ = remote_WJ & (dst_WJ // G != src_WJ // G)
    intra_WJ = remote_WJ & ~inter_WJ

    def received_by_destination(mask_WJ):
        out_W = np.zeros(W)
        np.add.at(out_W, dst_WJ[mask_WJ], rows_WJ[mask_WJ])
        return out_W

    received_W = received_by_destination(np.ones_like(remote_WJ))
    send_intra_W, send_inter_W = (rows_WJ * intra_WJ).sum(1), (rows_WJ * inter_WJ).sum(1)
    recv_intra_W, recv_inter_W = received_by_destination(intra_WJ), received_by_destination(inter_WJ)
    return Traffic(intra=float(max(send_intra_W.max(), recv_intra_W.max())),
                   inter=float(max(send_inter_W.max(), recv_inter_W.max())),
                   intra_messages=int(intra_WJ.sum(1).max()), inter_messages=int(inter_WJ.sum(1).max()),
                   received=float(received_W.max()), leaving_node=float(send_inter_W.sum() / W))


def rank_traffic(layout: ClusterLayout, rank: int, send_rows: list[int], recv_rows: list[int]) -> Traffic:
    """Traffic of one rank's own All-to-All from its actual split sizes, **in rows** (price
    it with the bytes of one row): it sends send_rows[r] rows to rank r and receives
    recv_rows[r] from rank r. Its own rows move through device memory, not the network.
    Each link carries the larger of the rank's send and receive on it, as in
    `all_to_all_traffic`; for a balanced exchange (b/W rows to and from every rank) the
    two agree: this one is `all_to_all_traffic(layout, uniform_load(W))` times b."""
    W = layout.ranks
    if len(send_rows) != W or len(recv_rows) != W:
        raise ValueError(f"rank_traffic needs one split per rank of the {W}-rank layout; got "
                         f"{len(send_rows)} send and {len(recv_rows)} receive splits")
    sums = {"intra": [0, 0], "inter": [0, 0]}
    messages = {"intra": [0, 0], "inter": [0, 0]}
    for peer in range(W):
        if peer == rank:
            continue
        link = "intra" if layout.node_of(peer) == layout.node_of(rank) else "inter"
        for side, rows in enumerate((send_rows[peer], recv_rows[peer])):
            sums[link][side] += rows
            messages[link][side] += rows > 0
    sent = sum(send_rows)
    return Traffic(intra=float(max(sums["intra"])), inter=float(max(sums["inter"])),
                   intra_messages=max(messages["intra"]), inter_messages=max(messages["inter"]),
                   received=float(sum(recv_rows)), leaving_node=sums["inter"][0] / sent if sent else 0.0)


def flat_all_to_all_s(network: NetworkProfile, traffic: Traffic, rank_bytes: float) -> float:
    """Seconds of one All-to-All in which each rank sends `rank_bytes` (spread by `traffic`)."""
    intra = traffic.intra_messages * network.intra_message_s + traffic.intra * rank_bytes / network.intra_bytes_per_s
    inter = traffic.inter_messages * network.inter_message_s + traffic.inter * rank_bytes / network.inter_bytes_per_s
    return network.collective_s + max(intra, inter)


def hierarchical_all_to_all_s(network: NetworkProfile, layout: ClusterLayout, traffic: Traffic,
                              rank_bytes: float) -> float:
    """Seconds of a two-level All-to-All: NVLink gather to the rail GPU, one message per
    remote node over InfiniBand, NVLink scatter. Same bytes over the NIC as the flat one
    (the busiest rank's inter share), but nodes−1 messages instead of W−G."""
    nodes, G = layout.nodes, layout.gpus_per_node
    if nodes == 1:
        return flat_all_to_all_s(network, traffic, rank_bytes)
    # Each NVLink phase moves the inter-node rows once more inside the node (G−1 peers).
    nvlink_phase = (G - 1) * network.intra_message_s + traffic.inter * rank_bytes * (G - 1) / G \
        / network.intra_bytes_per_s
    inter = (nodes - 1) * network.inter_message_s + traffic.inter * rank_bytes / network.inter_bytes_per_s
    intra = traffic.intra_messages * network.intra_message_s + traffic.intra * rank_bytes / network.intra_bytes_per_s
    return 3 * network.collective_s + 2 * nvlink_phase + max(inter, intra)


def all_reduce_s(network: NetworkProfile, layout: ClusterLayout, nbytes: float) -> float:
    """Ring all-reduce of `nbytes` per rank: 2(W−1)/W of the bytes through the slowest link
    on the ring (InfiniBand once the ring leaves the node), 2(W−1) messages."""
    W = layout.ranks
    if W == 1:
        return 0.0
    multi_node = layout.nodes > 1
    bandwidth = network.inter_bytes_per_s if multi_node else network.intra_bytes_per_s
    message = network.inter_message_s if multi_node else network.intra_message_s
    return network.collective_s + 2 * (W - 1) * message + 2 * (W - 1) / W * nbytes / bandwidth


def small_collective_s(network: NetworkProfile, layout: ClusterLayout) -> float:
    """A few bytes agreed by all ranks (max/sum or the count exchange): latency only,
    a tree of depth log2(W) over the slowest link."""
    W = layout.ranks
    if W == 1:
        return 0.0
    message = network.inter_message_s if layout.nodes > 1 else network.intra_message_s
    return network.collective_s + 2 * math.ceil(math.log2(W)) * message
