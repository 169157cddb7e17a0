"""Tier 1: a user's activation checkpointing (`torch.utils.checkpoint`, non-reentrant) around
a block holding our layer cuts what the block keeps between forward and backward as it does
for a plain PyTorch layer, and the gradients stay those of the un-checkpointed block.

What a forward keeps is counted as the bytes of every storage the forward's operations
created that is still alive when it returns (output excluded): saved tensors, and anything
else holding tensors (autograd-node attributes, plans, host copies) alike.
"""
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from moe_engine import MoEConfig, MPipeMoE

CONFIG = MoEConfig(d_model=32, d_hidden=128, num_experts=4, top_k=2, activation="swiglu")
TOKENS = 512


class _Allocations(TorchDispatchMode):
    """Every storage the operations run under it create (weakly referenced)."""

    def __init__(self):
        super().__init__()
        self.storages = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        return out


def kept_bytes(block, x) -> tuple[int, torch.Tensor]:
    """(bytes the forward of `block` keeps alive besides its output, the output)."""
    allocations = _Allocations()
    with allocations:
        y = block(x)
    gc.collect()
    skip = {y.untyped_storage().data_ptr(), x.untyped_storage().data_ptr()}
    return sum(size for ptr, (ref, size) in allocations.storages.items()
               if ptr not in skip and not ref.expired()), y


class PlainSwiGLU(nn.Module):
    """A dense SwiGLU FFN of the same widths, in plain PyTorch."""

    def __init__(self):
        super().__init__()
        self.w13 = nn.Linear(CONFIG.d_model, 2 * CONFIG.d_hidden)
        self.w2 = nn.Linear(CONFIG.d_hidden, CONFIG.d_model)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up), x.new_zeros(())


def residual(layer):
    def block(x):
        y, aux = layer(x)
        return x + y + aux
    return block


def checkpointed(layer):
    return lambda x: checkpoint(residual(layer), x, use_reentrant=False)


@pytest.mark.parametrize("partitions, strategy", [(1, "none"), (3, "S1"), (3, "S3"), (3, "S4")])
def test_checkpointing_our_layer_keeps_as_little_as_a_plain_layer(partitions, strategy):
    x = torch.randn(TOKENS, CONFIG.d_model, generator=torch.Generator().manual_seed(0), requires_grad=True)
    plain_kept, _ = kept_bytes(checkpointed(PlainSwiGLU()), x)
    torch.manual_seed(0)
    layer = MPipeMoE(CONFIG, partitions=partitions, strategy=strategy)
    full_kept, y_full = kept_bytes(residual(layer), x)
    (y_full.square().sum()).backward()
    want = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad(set_to_none=True)
    held_before = layer.host_pool.bytes_held
    ours_kept, y = kept_bytes(checkpointed(layer), x)
    # What remains: the plan's row indices (a few int64 per routed row), no activations.
    index_bytes = 8 * 8 * CONFIG.top_k * TOKENS
    assert ours_kept <= plain_kept + index_bytes, (ours_kept, plain_kept)
    if strategy != "S4":  # S4 keeps only the layer input (recommunication + recomputation)
        assert full_kept > 4 * ours_kept  # without checkpointing the layer does keep activations
    (y.square().sum()).backward()
    got = [x.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # The host copies of the discarded forward and of the recomputation are not held on to.
    assert layer.host_pool.bytes_held <= held_before


def _checkpointed_search_matches_fixed_n(rank, world_size):
    from moe_engine.granularity import GranularitySearch

    torch.manual_seed(0)
    layer = MPipeMoE(CONFIG, partitions="auto", strategy="S1",
                     search=GranularitySearch(candidates=(1, 2), warmup=0, repeats=1, give_up_slower=None))
    g = torch.Generator().manual_seed(1 + rank)
    seen = []
    for _ in range(3):
        x = torch.randn(32, CONFIG.d_model, generator=g, requires_grad=True)
        checkpointed(layer)(x).square().sum().backward()
        n = layer.last_partitions
        seen.append(n)
        got = [x.grad] + [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
        fixed = MPipeMoE(CONFIG, partitions=n, strategy="S1")
        fixed.load_state_dict(layer.state_dict())
        x_again = x.detach().clone().requires_grad_(True)
        residual(fixed)(x_again).square().sum().backward()
        for a, b in zip(got, [x_again.grad] + [p.grad for p in fixed.parameters()]):
            torch.testing.assert_close(a, b)
    return seen


@pytest.mark.gloo
def test_a_checkpointed_forward_with_the_online_search_replays_its_plan():
    """partitions="auto" moves n on from pass to pass while it searches (several ranks: on
    one, auto runs n = 1); the recomputation inside backward must run the n (and strategy)
    of the forward it repeats, or checkpoint finds other tensors saved. Gradients equal
    those of the same n without checkpointing."""
    from tests.distributed import run_on_ranks

    seen = run_on_ranks(2, _checkpointed_search_matches_fixed_n)
    assert seen[0] == seen[1] and len(set(seen[0])) > 1  # the search did move n between passes, on both ranks


def test_a_reentrant_checkpoint_runs_and_leaves_no_plan_behind():
    """use_reentrant=True: the first forward runs without grad (nothing to replay), the
    recomputation decides afresh and records nothing; gradients equal the plain block's."""
    torch.manual_seed(0)
    layer = MPipeMoE(CONFIG, partitions=2, strategy="S1")
    x = torch.randn(32, CONFIG.d_model, generator=torch.Generator().manual_seed(2), requires_grad=True)
    residual(layer)(x).square().sum().backward()
    want = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad(set_to_none=True)
    layer._recorded_plans.clear()
    checkpoint(residual(layer), x, use_reentrant=True).square().sum().backward()
    assert not layer._recorded_plans
    for a, b in zip([x.grad] + [p.grad for p in layer.parameters()], want):
        torch.testing.assert_close(a, b)


class _AfterNextForward(torch.autograd.Function):
    """Identity whose backward waits (up to 20 s) until ``event`` is set: the backward of a
    micro-batch goes on only once the next micro-batch's forward has run."""

    @staticmethod
    def forward(ctx, x, event):
        ctx.event = event
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        assert ctx.event.wait(timeout=20)
        return grad, None


def test_checkpointed_forwards_under_the_overlapped_schedule_replay_their_own_lanes_plans():
    """Under the overlapped micro-batch schedule the forward of micro-batch k+1 (the other
    lane) records its plan before the backward of k recomputes (made certain here): each
    recomputation replays the plan its own forward recorded, not the layer's latest.
    Gradients equal the sequential schedule's."""
    import threading

    from workers.schedules import Lanes, forward_backward

    xs = [torch.randn(24, CONFIG.d_model, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    grads = {}
    for schedule in ("sequential", "overlapped"):
        torch.manual_seed(0)
        layer = MPipeMoE(CONFIG, partitions=2, strategy="S1")
        recorded, replayed = [], []
        record, replay = layer._record_plan, layer._replayed_plan
        layer._record_plan = lambda plan: recorded.append(record(plan)) or recorded[-1]
        layer._replayed_plan = lambda: replayed.append(replay()) or replayed[-1]  # (None outside a recomputation)
        forwarded = [threading.Event() for _ in xs]

        def loss_of(module, k):
            y = checkpoint(residual(module), xs[k], use_reentrant=False)
            forwarded[k].set()
            if schedule == "overlapped" and k + 1 < len(xs):
                y = _AfterNextForward.apply(y, forwarded[k + 1])
            return y.square().sum(), k

        lanes = Lanes.create(layer) if schedule == "overlapped" else None
        forward_backward(layer, range(len(xs)), loss_of, schedule=schedule, lanes=lanes)
        replayed = [plan for plan in replayed if plan is not None]
        assert len(replayed) == len(recorded) == len(xs)
        assert all(got is want for got, want in zip(replayed, recorded)), schedule
        grads[schedule] = [p.grad.clone() for p in layer.parameters()]
    for a, b in zip(grads["overlapped"], grads["sequential"]):
        torch.testing.assert_close(a, b)
