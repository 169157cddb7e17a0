"""Tier 1/2: every tensor a collective receives lives on the data's device.

NCCL process groups reject CPU tensors, so a collective fed a tensor built with
``torch.tensor(...)`` (no ``device=``) fails on the first multi-GPU run. On CPU every
tensor is on 'cpu', so a device check cannot catch it; provenance can:

* `DefaultDeviceTracker` (a TorchFunctionMode) marks each tensor a factory function
  (``torch.tensor``, ``torch.zeros``, ``torch.arange``, ...) makes without ``device=``
  as "made on the default device"; an op whose tensor inputs are all marked marks its
  results (``marked + 1``, ``marked.clone()``), in forward and in backward. An
  explicit device (``device=x.device``, ``.to(x.device)``) clears the mark, and
  ``*_like`` / ``Tensor.new_*`` follow their source tensor (they inherit its device).
  (``data.cpu()`` cannot be caught here: on CPU it returns ``data`` itself.)
* `collectives_checked` wraps the ``torch.distributed`` collectives so that a marked
  tensor argument raises `WrongDeviceError`, naming the collective and where the
  tensor was made.

The engines then run forward + backward on 2 gloo ranks under both.
"""
from __future__ import annotations

import contextlib
import os
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from moe_engine import FastMoE, FasterMoE, MoEConfig, MPipeMoE
from moe_engine.granularity import GranularitySearch
from tests.distributed import run_on_ranks

_MARK = "_made_on_default_device_at"  # attribute: where the marked tensor's lineage began

# Factories whose result lands on the default device unless given device= (or, for the
# ones that copy data, unless the data is a tensor: then they follow it).
_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.zeros, torch.ones, torch.empty,
              torch.full, torch.arange, torch.linspace, torch.logspace, torch.eye, torch.rand,
              torch.randn, torch.randint, torch.randperm, torch.empty_strided, torch.scalar_tensor,
              torch.tril_indices, torch.triu_indices}
_MOVES_TO_DEVICE = {torch.Tensor.cuda}          # explicit device: clears the mark

# The collectives of torch.distributed that take tensors (object collectives build their
# own tensors on the right device).
COLLECTIVES = ("all_reduce", "all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter",
               "send", "recv", "isend", "irecv", "batch_isend_irecv")

CONFIG = MoEConfig(d_model=8, d_hidden=16, num_experts=4, top_k=2)


class WrongDeviceError(AssertionError):
    """A collective received a tensor made on the default device, not the data's."""


def _origin(func) -> str:
    """'tensor at moe_engine/granularity.py:219 in _agreed_means': the call, and the
    innermost frame outside torch and the tracker."""
    here = os.path.abspath(__file__)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    tracker = {"_origin", "__torch_function__", "_backward"}
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if not path.startswith(torch_dir) and not (path == here and frame.name in tracker):
            return f"{getattr(func, '__name__', func)} at {os.path.relpath(path)}:{frame.lineno} in {frame.name}"
    return f"{getattr(func, '__name__', func)} (no caller outside torch)"


def made_on_default_device(tensor: torch.Tensor) -> str | None:
    """Where ``tensor``'s default-device lineage began, or None if it is not marked."""
    return getattr(tensor, _MARK, None)


def _has_device_argument(func, args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    if func is torch.Tensor.to:  # .to(device), .to(device, dtype), .to(other), .to("cpu") ...
        return any(isinstance(a, (torch.device, str, torch.Tensor)) or type(a) is int for a in args[1:])
    return False


class DefaultDeviceTracker(TorchFunctionMode):
    """Marks tensors made on the default device (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.backward:
            return self._backward(*args, **kwargs)
        result = func(*args, **kwargs)
        moved = func in _MOVES_TO_DEVICE or _has_device_argument(func, args, kwargs)
        if moved and result is args[0] and made_on_default_device(result):
            # On CPU .to(x.device) returns its input; on a GPU it would be a copy on x's
            # device: a view stands for that copy, and the input keeps its mark.
            result = result.view_as(result)
        outputs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        if not outputs:
            return result
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(any(out is t for t in inputs) for out in outputs):
            return result  # in place (or the input itself): its device did not change
        if func in _FACTORIES and not inputs:
            origin = None if moved else _origin(func)
        elif moved:
            origin = None
        elif inputs and all(made_on_default_device(t) for t in inputs):
            origin = made_on_default_device(inputs[0])
        else:
            origin = None
        if origin is not None:
            for out in outputs:
                setattr(out, _MARK, origin)
        return result

    def _backward(self, tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """``tensor.backward()`` with this mode active in the backward pass: the handler of
        a mode runs with the mode popped, and autograd captures the modes active when the
        engine starts, so the engine is started here, inside the mode."""
        if inputs is not None:
            raise NotImplementedError("DefaultDeviceTracker: backward(inputs=...) is not supported")
        with self:
            gradient = torch.ones_like(tensor) if gradient is None else gradient
            torch.autograd.Variable._execution_engine.run_backward(
                (tensor,), (gradient,), bool(create_graph if retain_graph is None else retain_graph),
                create_graph, (), allow_unreachable=True, accumulate_grad=True)


def _check_tensors(name: str, args, kwargs) -> None:
    leaves = tree_flatten((args, kwargs))[0]
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    tensors += [op.tensor for op in leaves if isinstance(op, dist.P2POp)]
    for tensor in tensors:
        origin = made_on_default_device(tensor)
        if origin is not None:
            raise WrongDeviceError(
                f"torch.distributed.{name} got a {tuple(tensor.shape)} {tensor.dtype} tensor made on the "
                f"default device ({origin}); NCCL rejects CPU tensors: build it on the data's device "
                f"(device=x.device, x.new_tensor(...), torch.zeros_like(x))")


@contextlib.contextmanager
def collectives_checked(namespace=dist):
    """Within: each collective of ``namespace`` (torch.distributed) raises `WrongDeviceError`
    when a tensor argument was made on the default device; restored on exit."""
    originals = {name: getattr(namespace, name) for name in COLLECTIVES if hasattr(namespace, name)}

    def checked(name, collective):
        def call(*args, **kwargs):
            _check_tensors(name, args, kwargs)
            return collective(*args, **kwargs)
        return call

    for name, collective in originals.items():
        setattr(namespace, name, checked(name, collective))
    try:
        yield
    finally:
        for name, collective in originals.items():
            setattr(namespace, name, collective)


# -- tier 1: the tracker itself -----------------------------------------------------------

def _fake_distributed():
    sent = []
    return SimpleNamespace(**{name: (lambda *a, **k: sent.append(a[0])) for name in COLLECTIVES}), sent


def test_tracker_flags_a_host_tensor_sent_to_a_collective():
    x = torch.randn(3, 2, device="cpu")
    fake, sent = _fake_distributed()
    with DefaultDeviceTracker(), collectives_checked(fake):
        with pytest.raises(WrongDeviceError, match=r"all_reduce got a \(1,\) torch.float32 tensor made on the "
                                                   r"default device \(tensor at tests/moe_engine/test_collective_devices"):
            fake.all_reduce(torch.tensor([1.0]))
        derived = (torch.tensor([1.0, 2.0], dtype=torch.float64) * 2).clone()[:1]
        with pytest.raises(WrongDeviceError, match="tensor made on the default device"):
            fake.broadcast(derived, src=0)
        with pytest.raises(WrongDeviceError, match="all_to_all_single got"):
            fake.all_to_all_single(torch.empty_like(x), torch.arange(6.0).reshape(3, 2).contiguous())
        with pytest.raises(WrongDeviceError, match="all_gather got"):
            fake.all_gather([x.new_empty(1), torch.zeros(1)], x.new_empty(1))
        assert sent == []

        fake.all_reduce(x.new_tensor([1.0]))
        fake.all_reduce(torch.tensor([1.0], device=x.device))
        fake.all_reduce(torch.zeros_like(x))
        fake.all_reduce(torch.tensor([1.0]).to(x.device))
        fake.all_reduce(torch.tensor([1.0]).to(x))
        fake.all_reduce(torch.zeros(3, dtype=torch.int64, device=x.device) + torch.tensor(1))
        fake.all_reduce(x * 2)
        assert len(sent) == 7
    assert made_on_default_device(x.new_tensor([1.0])) is None  # outside the tracker: nothing marked


def test_tracker_follows_backward():
    x = torch.randn(4, requires_grad=True, device="cpu")
    grads = []

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            grads.append(torch.tensor([1.0]))
            return grad * 2

    with DefaultDeviceTracker():
        Scale.apply(x).sum().backward()
    assert made_on_default_device(grads[0]) is not None
    torch.testing.assert_close(x.grad, torch.full((4,), 2.0))


# -- tier 2: the engines on 2 gloo ranks ---------------------------------------------------

def _engine(name: str):
    torch.manual_seed(0)
    if name == "auto":
        search = GranularitySearch(candidates=(1, 2), warmup=0, repeats=1, give_up_slower=None)
        return MPipeMoE(CONFIG, partitions="auto", strategy="auto", search=search)
    if name == "auto-S4":
        search = GranularitySearch(candidates=(1, 2), warmup=0, repeats=1, give_up_slower=None)
        return MPipeMoE(CONFIG, partitions="auto", strategy="S4", search=search)
    if name.startswith("mpipemoe-"):
        return MPipeMoE(CONFIG, partitions=2, strategy=name.split("-")[1])
    if name == "fastmoe":
        return FastMoE(CONFIG)
    return FasterMoE(CONFIG, group_size=1)


def _passes(layer, xs) -> None:
    for x in xs:
        y, aux = layer(x.requires_grad_(True))
        (y.square().sum() + aux).backward()


def _every_engine(rank, world_size, cases):
    """Each case's forward + backward passes under the tracker; the layer and the data
    are made before it (parameters and inputs are the data, on their device). Returns
    {case: (error or None, the search's events)}."""
    with collectives_checked():
        with DefaultDeviceTracker(), pytest.raises(WrongDeviceError):  # the check is live here
            dist.all_reduce(torch.tensor([1.0]))
    results = {}
    for name, passes in cases:
        layer = _engine(name)
        xs = [torch.randn(12 + rank, CONFIG.d_model, generator=torch.Generator().manual_seed(10 * rank + i))
              for i in range(passes)]
        error = None
        try:
            with DefaultDeviceTracker(), collectives_checked():
                _passes(layer, xs)
        except WrongDeviceError as caught:  # raised before the collective, on every rank alike
            error = str(caught)
        events = [d["event"] for d in layer.search.decisions] if name.startswith("auto") else []
        results[name] = (error, events)
    return results


# n="auto" runs 4 passes: candidates (1, 2) timed once each, then the agreed choice.
ENGINE_PASSES = [("auto", 4), ("auto-S4", 4), ("mpipemoe-none", 1), ("mpipemoe-S1", 1), ("mpipemoe-S2", 1),
                 ("mpipemoe-S3", 1), ("mpipemoe-S4", 1), ("fastmoe", 1), ("fastermoe", 1)]


@pytest.fixture(scope="module")
def engine_results():
    return run_on_ranks(2, _every_engine, ENGINE_PASSES, timeout=120, collective_timeout_s=20)


@pytest.mark.gloo
@pytest.mark.parametrize("name", [n for n, _ in ENGINE_PASSES])
def test_collectives_get_tensors_on_the_data_device(engine_results, name):
    for rank, results in enumerate(engine_results):
        error, events = results[name]
        assert error is None, f"rank {rank}: {error}"
        if name.startswith("auto"):  # the search ran to its end (its agreement is a collective)
            assert "chose" in events, f"rank {rank}: the search did not finish: {events}"
