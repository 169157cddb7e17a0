"""Streams and events for the pipelined schedule, on CUDA and on CPU.

The pipeline (pipeline.py) is written once against `StreamSet`:

* ``on_compute()`` / ``on_comm()`` / ``on_copy()`` select where the next kernels run;
* ``record_*()`` returns a `Pending` marking "everything issued so far on that stream";
* ``Pending.wait()`` makes the *current* stream (CUDA) or the host (CPU) wait for it.

CUDA: three real streams. Compute is the caller's current stream, so the layer's
inputs and outputs need no extra synchronisation; communication and host copies
get side streams of their own.

CPU: kernels run synchronously on the host, so streams are no-ops and a recorded
event is already complete. Asynchrony comes only from gloo collectives, whose
work handles become `Pending`s (see comm.py).

A StreamSet belongs to one layer instance and is created lazily per device; no
module-level state.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch


class Pending:
    """Something issued asynchronously; `wait()` orders the caller after it."""

    __slots__ = ("_wait",)

    def __init__(self, wait: Optional[Callable[[], None]] = None):
        self._wait = wait

    @classmethod
    def done(cls) -> "Pending":
        return cls(None)

    @classmethod
    def from_event(cls, event: "torch.cuda.Event") -> "Pending":
        return cls(lambda: torch.cuda.current_stream().wait_event(event))

    def wait(self) -> None:
        if self._wait is not None:
            self._wait()


class StreamSet:
    """Compute, communication and host-copy streams of one device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.compute = torch.cuda.current_stream(device)
            self.comm = torch.cuda.Stream(device)
            self.copy = torch.cuda.Stream(device)

    # -- where work runs -------------------------------------------------------
    def _on(self, stream_name: str):
        if not self.is_cuda:
            return contextlib.nullcontext()
        stream = getattr(self, stream_name)
        # The side stream first waits for everything already queued on the stream
        # that is current now, so it sees the inputs that stream produced.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    def on_comm(self):
        return self._on("comm")

    def on_copy(self):
        return self._on("copy")

    def on_compute(self):
        if not self.is_cuda:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.compute)

    # -- events -----------------------------------------------------------------
    def _record(self, stream_name: str) -> Pending:
        if not self.is_cuda:
            return Pending.done()
        event = torch.cuda.Event()
        event.record(getattr(self, stream_name))
        return Pending.from_event(event)

    def record_comm(self) -> Pending:
        return self._record("comm")

    def record_copy(self) -> Pending:
        return self._record("copy")

    def record_compute(self) -> Pending:
        return self._record("compute")

    def join(self) -> None:
        """The compute stream waits for every side stream (end of a pipelined pass)."""
        if self.is_cuda:
            self.compute.wait_stream(self.comm)
            self.compute.wait_stream(self.copy)

    def keep_alive(self, tensor: torch.Tensor, stream_name: str) -> None:
        """Tell the caching allocator `tensor` is used on a side stream (record_stream)."""
        if self.is_cuda and tensor.is_cuda:
            tensor.record_stream(getattr(self, stream_name))
