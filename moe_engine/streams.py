"""Streams and events for the pipelined schedule, on CUDA and on CPU.

The pipeline (pipeline.py) is written once against `StreamSet`:

* ``on_comm()`` / ``on_copy()`` select a side stream for the next kernels (after it
  waits for everything queued so far on the caller's current stream);
* ``record_*()`` returns a `Pending` marking "everything issued so far on that stream";
* ``Pending.wait()`` makes the *current* stream (CUDA) or the host (CPU) wait for it.

CUDA: compute runs on whatever stream is current when the layer is called (the default
stream, a side stream of the caller's, a stream capturing a CUDA graph): it is read at
every use, never fixed, so the layer's inputs and outputs need no extra synchronisation
and `join()` orders the caller's stream after the side streams. Communication gets a
side stream of high priority (its kernels are short and gate the next partition's
compute), host copies another.

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


def sm_carveout(count: int, sm_count: int) -> int | None:
    """The carve-out to set for leaving ``count`` SMs of a GPU with ``sm_count`` free: None
    for none (count <= 0), at most ``sm_count - 1`` (torch refuses a carve-out that leaves
    the GEMMs no SM, mid-pass)."""
    return None if count <= 0 else min(count, sm_count - 1)


def sm_carveout_available() -> bool:
    """Whether this torch has the SM carve-out (`torch._C._set_sm_carveout_experimental`,
    torch >= 2.7; an experimental, process-wide setting)."""
    return hasattr(torch._C, "_set_sm_carveout_experimental") and hasattr(torch._C, "_get_sm_carveout_experimental")


@contextlib.contextmanager
def honouring_sm_carveout():
    """Per-expert GEMMs (`torch.mm`) issued inside honour a carve-out that is on: plain
    cuBLAS ignores it, cuBLASLt targets the SMs it leaves (torch sets
    CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET from it), so while a carve-out is on torch's
    preferred BLAS is cuBLASLt, and the caller's preference is restored after."""
    if not (sm_carveout_available() and torch._C._get_sm_carveout_experimental()):
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    if previous == torch._C._BlasBackend.Cublaslt:  # already (a caller's, e.g. holding_sm_carveout): no write
        yield
        return
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


@contextlib.contextmanager
def holding_sm_carveout(device: torch.device, count: int):
    """Every GEMM launched inside, from any thread, leaves ``count`` SMs of ``device`` free
    (`sm_carveout`), with cuBLASLt preferred so that per-expert GEMMs honour it; both are set
    once on entry and the caller's settings restored on exit. No-op off CUDA, for 0, or on
    a torch without the carve-out.

    The carve-out and the preferred BLAS are process-wide settings that torch reads at each
    GEMM's launch without a lock (it checks that the carve-out has a value, then reads it):
    a thread changing them while another thread launches a GEMM can fail that launch ("bad
    optional access", seen on an H100 in the overlapped step bench). Where two host threads
    launch GEMMs (the overlapped micro-batch schedule: a forward beside a backward, whose
    GEMMs autograd launches from its own thread) one setting is held while both threads launch;
    `StreamSet.reserving_sms` and `honouring_sm_carveout` inside leave it as it is."""
    if device.type != "cuda" or count <= 0 or not sm_carveout_available():
        yield
        return
    carve_out = torch._C._get_sm_carveout_experimental()
    library = torch.backends.cuda.preferred_blas_library()
    torch._C._set_sm_carveout_experimental(sm_carveout(count, torch.cuda.get_device_properties(device).multi_processor_count))
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(library)
        torch._C._set_sm_carveout_experimental(carve_out)


class Pending:
    """Something issued asynchronously; `wait()` orders the caller after it."""

    __slots__ = ("_wait", "event")

    def __init__(self, wait: Optional[Callable[[], None]] = None, event=None):
        self._wait = wait
        self.event = event  # the CUDA event behind it, when there is one

    @classmethod
    def done(cls) -> "Pending":
        return cls(None)

    @classmethod
    def from_event(cls, event: "torch.cuda.Event") -> "Pending":
        return cls(lambda: torch.cuda.current_stream().wait_event(event), event)

    def wait(self) -> None:
        if self._wait is not None:
            self._wait()


class StreamSet:
    """Communication and host-copy side streams of one device; compute is the caller's
    current stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            high_priority = torch.cuda.Stream.priority_range()[1]  # type: ignore[call-arg]  # (torch stubs it as a method; it is static)
            self.comm = torch.cuda.Stream(device, priority=high_priority)
            self.copy = torch.cuda.Stream(device)
        self._used: set[str] = set()  # side streams given work since the last join

    @property
    def compute(self):
        """The caller's current stream (CUDA), read now."""
        return torch.cuda.current_stream(self.device) if self.is_cuda else None

    # -- where work runs -------------------------------------------------------
    def _on(self, stream_name: str):
        if not self.is_cuda:
            return contextlib.nullcontext()
        stream = getattr(self, stream_name)
        self._used.add(stream_name)
        # The side stream first waits for everything already queued on the stream
        # that is current now, so it sees the inputs that stream produced.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    def on_comm(self):
        return self._on("comm")

    def on_copy(self):
        return self._on("copy")

    def on_compute(self):
        """The current stream (kept for callers that name the stream they time)."""
        return contextlib.nullcontext()

    # -- events -----------------------------------------------------------------
    def _record(self, stream) -> Pending:
        if not self.is_cuda:
            return Pending.done()
        event = torch.cuda.Event()
        event.record(stream)
        return Pending.from_event(event)

    def record_comm(self) -> Pending:
        return self._record(self.comm if self.is_cuda else None)

    def record_copy(self) -> Pending:
        return self._record(self.copy if self.is_cuda else None)

    def record_compute(self) -> Pending:
        return self._record(self.compute)

    @contextlib.contextmanager
    def reserving_sms(self, count: int):
        """GEMMs launched inside leave `count` SMs free for the communication kernels that
        run beside them (torch's SM carve-out, which its grouped GEMMs and cuBLASLt honour;
        the per-expert loops ask for cuBLASLt, `honouring_sm_carveout`), at most all SMs
        but one (`sm_carveout`); it is unset after. No-op off CUDA, for 0, on a torch
        without the carve-out, or while a carve-out is already on: the caller's, which it
        leaves as it is. The carve-out is one setting for the whole process: where two
        threads launch GEMMs (the overlapped micro-batch schedule) the schedule holds one
        while both its threads launch (`holding_sm_carveout`), so no lane writes it while another
        launches."""
        if not self.is_cuda or count <= 0 or not sm_carveout_available() or \
                torch._C._get_sm_carveout_experimental() is not None:
            yield
            return
        torch._C._set_sm_carveout_experimental(
            sm_carveout(count, torch.cuda.get_device_properties(self.device).multi_processor_count))
        try:
            yield
        finally:
            torch._C._set_sm_carveout_experimental(None)

    def join(self) -> None:
        """The caller's current stream waits for every side stream given work since the
        last join (end of a pipelined pass). Streams the pass never used are left alone:
        under CUDA graph capture, waiting on a stream the capture never forked is an error."""
        if self.is_cuda:
            current = torch.cuda.current_stream(self.device)
            for name in sorted(self._used):
                current.wait_stream(getattr(self, name))
        self._used.clear()
