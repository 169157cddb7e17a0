"""Buffer sharing and the S1–S4 restore strategies (docs/design.md §2, §5).

A `RestorePolicy` says, for one strategy, how backward gets back the two
per-partition tensors the shared forward buffers overwrote:

| strategy | T_DI (expert input)   | A (pre-activation; T_M = act(A)) |
|----------|-----------------------|----------------------------------|
| none     | kept on the device    | kept on the device               |
| S1       | copy back from host   | copy back from host              |
| S2       | re-communication      | copy back from host              |
| S3       | copy back from host   | recomputation (GEMM1)            |
| S4       | re-communication      | recomputation (GEMM1)            |

We keep the pre-activation A rather than the activation output: act(A) is an
elementwise recomputation in backward, so every strategy needs one H-wide
tensor per row (a = 1 in §5), whatever the activation.

`HostBufferPool` owns pinned host memory for offloads. Each forward takes its
own buffers (so several micro-batches can be in flight), backward gives them
back, and later steps reuse them. Pass one pool to several layers to share it.
Before an offloading pass the layer compares the bytes the pool would add
(`bytes_to_grow`) with what it may still take (`usable_bytes`); when they do not
fit, the layer falls back to S4, which needs no host memory.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .config import ENGINES, STRATEGIES, MoEConfig


@dataclass(frozen=True)
class RestorePolicy:
    strategy: str
    share_buffers: bool          # forward overwrites T_DI / A of earlier partitions
    offload_input: bool          # T_DI copied to host in forward
    offload_preactivation: bool  # A copied to host in forward
    recommunicate_input: bool    # T_DI rebuilt by All-to-All in backward
    recompute_preactivation: bool  # A rebuilt by GEMM1 in backward

    @classmethod
    def of(cls, strategy: str) -> "RestorePolicy":
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r} is invalid: choose 'auto' or one of {', '.join(STRATEGIES)}")
        if strategy == "none":
            return cls("none", False, False, False, False, False)
        recommunicate = strategy in ("S2", "S4")
        recompute = strategy in ("S3", "S4")
        return cls(strategy, True, not recommunicate, not recompute, recommunicate, recompute)

    @property
    def offloads(self) -> bool:
        """True when forward copies T_DI or A to host memory (S1, S2, S3)."""
        return self.offload_input or self.offload_preactivation

    @property
    def needs_layer_input(self) -> bool:
        """Re-communication rebuilds T_DI from the layer input x, so backward keeps x."""
        return self.recommunicate_input


def _meminfo(field: str) -> int | None:
    """Bytes of one /proc/meminfo field (Linux), or None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_host_memory() -> int:
    """Bytes of host memory the OS can give now without swapping: ``MemAvailable`` of
    /proc/meminfo on Linux, else free physical pages (``os.sysconf``)."""
    available = _meminfo("MemAvailable")
    return available if available is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def total_host_memory() -> int:
    """Bytes of host memory installed: ``MemTotal`` of /proc/meminfo, else ``os.sysconf``."""
    total = _meminfo("MemTotal")
    return total if total is not None else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pinned_block_bytes(nbytes: int) -> int:
    """Bytes torch's caching host allocator takes from CUDA for a pinned tensor of
    ``nbytes``: the next power of two (it rounds every request so, to reuse blocks)."""
    return 1 << max(0, (max(nbytes, 1) - 1).bit_length())


def _capacity(numel: int, element_size: int = 4, pin: bool = False) -> int:
    """Buffer size (elements) the pool allocates for ``numel``. Pinned: the whole block torch's
    host allocator rounds the request up to (`pinned_block_bytes`), so no rounding is paid
    for and not used. Pageable: rounded up to a sixteenth of its power of two (at most 1/16
    more), so counts that differ a little share a size."""
    if pin:
        return pinned_block_bytes(max(numel, 1) * element_size) // element_size
    step = 1 << max(0, numel.bit_length() - 5)
    return -(-max(numel, 1) // step) * step


def empty_host_cache() -> None:
    """Give the pinned blocks torch's caching host allocator keeps unused back to CUDA (and
    the OS): ``torch.accelerator.empty_host_cache`` (torch >= 2.9), else the private call
    older builds have; a no-op where neither exists or CUDA is absent."""
    release = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) \
        or getattr(torch._C, "_host_emptyCache", None)
    if release is not None and torch.cuda.is_available():
        release()


class HostBufferPool:
    """Reusable host buffers for offloaded activations (pinned when CUDA is present),
    bounded: what it holds stays within ``REUSE_SLACK`` of the largest set of buffers ever
    asked for at once, and within ``max_bytes``.

    `take` hands out a buffer no one else holds: the best-fitting free one (the smallest
    that holds the request and is at most ``REUSE_SLACK`` times it), else a new one; a
    free buffer no request fits is released once the pool holds more than ``REUSE_SLACK``
    times its peak request, or to make room under ``max_bytes``. `give_back` returns a
    buffer for reuse. A buffer handed out and then dropped (e.g. a host copy an activation
    checkpoint discarded) is no longer counted once it is freed.

    Pinned buffers are counted as torch's caching host allocator holds them: each is the
    power-of-two block the allocator rounds a request up to (`pinned_block_bytes`; the pool
    asks for the whole block), and a released pinned buffer is freed, not left in that
    allocator's cache (`empty_host_cache` once the buffers are dropped: the blocks whose
    copies are done go back to CUDA, which waits for the device; the pool releases when it
    shrinks, not every pass). So ``bytes_held`` is the pinned memory the pool costs and
    ``max_bytes`` bounds it.

    A buffer can go back while a copy that reads it is still queued on a CUDA stream
    (backward's host-to-device restore): `give_back(buffer, in_use_until=event)` with
    the event recorded after that copy. `take` never hands such a buffer out unordered:
    it makes the taker's `stream` wait for the event (the writer's copy then runs after
    the reader's), or, with no stream, waits for the event on the host. Without this, a
    later offload (another layer's copy stream, when layers share the pool) could
    overwrite data not yet restored.

    available_bytes: returns the host bytes free now (default `available_host_memory`;
                     pass your own to test or to account for other users of the host).
    usable_fraction: the share of those bytes this pool may take when it grows; the
                     rest stays for the process, the OS and other ranks on the node
                     (with R ranks per node, about 0.8 / R: workers/loop.py passes that).
    max_bytes:       the most the pool holds (handed out and free); default
                     ``usable_fraction`` of the host's installed memory. The layers' host
                     check (planner.py) falls back to S4 rather than pass it.
    """

    REUSE_SLACK = 1.2

    def __init__(self, available_bytes: Callable[[], int] = available_host_memory,
                 usable_fraction: float = 0.8, max_bytes: int | None = None):
        if isinstance(usable_fraction, bool) or not isinstance(usable_fraction, (int, float)) \
                or not 0 < usable_fraction <= 1:
            raise ValueError(f"usable_fraction={usable_fraction!r} is invalid: give a number in (0, 1], "
                             f"e.g. 0.8 / (ranks per node)")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes <= 0):
            raise ValueError(f"max_bytes={max_bytes!r} is invalid: give a positive number of bytes, or None "
                             f"for {usable_fraction} of the host's memory")
        self.available_bytes = available_bytes
        self.usable_fraction = usable_fraction
        self.max_bytes = max_bytes if max_bytes is not None else int(usable_fraction * total_host_memory())
        # free buffers, oldest given back first: (buffer, event after the last queued copy reading it, or None)
        self._free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        # buffers handed out, by address: (weak reference to the storage, bytes, bytes asked for)
        self._taken: dict[int, tuple[StorageWeakRef, int, int]] = {}
        self.peak_request_bytes = 0  # the most bytes asked for by buffers out at once
        self._pinned: dict[int, bool] = {}  # buffer address -> allocated pinned (set at each allocation)
        # The overlapped micro-batch schedule (workers/schedules.py) takes buffers in one
        # micro-batch's forward while another's backward, on a second thread, gives them back.
        self._lock = threading.RLock()
        # `deferring_cache_release`: sections open, and whether a release waits for their end
        self._deferring = 0
        self._release_deferred = False

    @contextlib.contextmanager
    def deferring_cache_release(self) -> Iterator[None]:
        """Local. Inside, dropping pinned buffers leaves torch's host cache as it is; the
        cache is emptied once the outermost such section ends (`empty_host_cache` waits for
        the device: inside the overlapped micro-batch schedule, where two host threads issue
        the two lanes' collectives, a device wait on one thread stalls the other's issue in
        an order that differs between ranks; workers/schedules.py)."""
        with self._lock:
            self._deferring += 1
        try:
            yield
        finally:
            with self._lock:
                self._deferring -= 1
                release = self._deferring == 0 and self._release_deferred
                if release:
                    self._release_deferred = False
            if release:
                empty_host_cache()

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy`` of a model holding the pool) gets its own lock."""
        state = self.__dict__.copy()
        del state["_lock"]
        state.update(_deferring=0, _release_deferred=False)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def _is_pinned(self, buffer: torch.Tensor) -> bool:
        """Whether the pool allocated ``buffer`` pinned (noted then: asking the tensor is an
        operator call per buffer per pass)."""
        return self._pinned.get(buffer.data_ptr(), False)

    def _bytes(self, buffer: torch.Tensor) -> int:
        """Host bytes ``buffer`` costs (pinned: its allocator block)."""
        nbytes = buffer.numel() * buffer.element_size()
        return pinned_block_bytes(nbytes) if self._is_pinned(buffer) else nbytes

    @staticmethod
    def _allocate(capacity: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        return torch.empty(capacity, dtype=dtype, pin_memory=pin)

    def _live_taken(self) -> dict[int, tuple[StorageWeakRef, int, int]]:
        """The handed-out buffers still alive (dropped ones are forgotten)."""
        with self._lock:
            self._taken = {ptr: entry for ptr, entry in self._taken.items() if not entry[0].expired()}
        return self._taken

    def take(self, numel: int, dtype: torch.dtype, pin: bool,
             stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Local. Thread-safe: see `_take`."""
        with self._lock:
            return self._take(numel, dtype, pin, stream)

    def _take(self, numel: int, dtype: torch.dtype, pin: bool,
              stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Local. A buffer of at least ``numel`` elements that no one holds and no queued
        copy still reads: the best-fitting free one (one whose copies are done if there is
        one, else the oldest, with ``stream`` (the CUDA stream that will write it) made to
        wait for its copies, or, with ``stream=None``, after waiting for them on the host),
        else a new one."""
        element_size = dtype.itemsize
        capacity = _capacity(numel, element_size, pin)
        fits = [i for i, (b, _) in enumerate(self._free)
                if b.dtype == dtype and self._is_pinned(b) == pin and self._fits(numel, b.numel(), capacity)]
        if fits:
            done = [i for i in fits if (event := self._free[i][1]) is None or event.query()]
            i = min(done or fits, key=lambda j: self._free[j][0].numel())
            buffer, event = self._free.pop(i)
            if not done:
                assert event is not None  # no free buffer is done, so each has a pending copy
                if stream is not None:
                    stream.wait_event(event)
                else:
                    event.synchronize()
        else:
            self._release(self.max_bytes - capacity * element_size)
            buffer = self._allocate(capacity, dtype, pin)
            self._pinned[buffer.data_ptr()] = pin
        # what the request costs: its bytes, or the allocator block a pinned one needs
        asked = capacity * element_size if pin else numel * element_size
        self._taken[buffer.data_ptr()] = (StorageWeakRef(buffer.untyped_storage()), self._bytes(buffer), asked)
        in_use = sum(entry[2] for entry in self._live_taken().values())
        self.peak_request_bytes = max(self.peak_request_bytes, in_use)
        self._release(int(self.REUSE_SLACK * self.peak_request_bytes))
        return buffer

    def give_back(self, buffer: torch.Tensor, in_use_until: torch.cuda.Event | None = None) -> None:
        """Local, thread-safe. Return ``buffer`` (one `take` handed out; anything else is ignored) for
        reuse. in_use_until: a CUDA event recorded after the last queued copy that reads
        ``buffer`` (None when no copy is pending)."""
        with self._lock:
            if self._taken.pop(buffer.data_ptr(), None) is None:
                return
            self._free.append((buffer, in_use_until))
            self._release(int(self.REUSE_SLACK * self.peak_request_bytes))

    def _fits(self, numel: int, size: int, capacity: int) -> bool:
        """Whether a free buffer of ``size`` elements serves a request of ``numel`` whose new
        buffer would hold ``capacity``: it holds the request and is at most ``REUSE_SLACK``
        times it, or no larger than the new buffer would be."""
        return numel <= size <= max(self.REUSE_SLACK * max(numel, 1), capacity)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in a buffer this pool handed out and not yet got back."""
        return tensor.untyped_storage().data_ptr() in self._live_taken()

    def _release(self, limit: int) -> None:
        """Drop free buffers, oldest given back first, until the pool holds at most
        ``limit`` bytes or none is free. Pinned ones are then freed (`empty_host_cache`:
        torch's host allocator frees each block once the copies recorded against it are
        done), not kept in that allocator's cache; inside `deferring_cache_release`, when it ends."""
        held = self.bytes_held
        pinned = False
        while self._free and held > limit:
            buffer, _ = self._free.pop(0)
            held -= self._bytes(buffer)
            pinned |= self._is_pinned(buffer)
            del buffer
        if pinned and self._deferring:
            self._release_deferred = True
        elif pinned:
            empty_host_cache()

    def bytes_to_grow(self, requests: list[tuple[int, torch.dtype]], pin: bool = False) -> int:
        """Bytes the pool would allocate to serve ``requests`` ((numel, dtype) pairs) now,
        after reusing its free buffers (best fit, as `take`); ``pin``: pinned buffers (each
        a power-of-two block of torch's host allocator)."""
        free = [(b.dtype, b.numel()) for b, _ in self._free if self._is_pinned(b) == pin]
        grow = 0
        for numel, dtype in sorted(requests, key=lambda r: -r[0]):
            element_size = dtype.itemsize
            capacity = _capacity(numel, element_size, pin)
            fits = [i for i, (d, size) in enumerate(free) if d == dtype and self._fits(numel, size, capacity)]
            if fits:
                free.pop(min(fits, key=lambda i: free[i][1]))
            else:
                grow += capacity * element_size
        return grow

    def usable_bytes(self) -> int:
        """Host bytes this pool may still take now: ``usable_fraction`` of what is available,
        and no more than ``max_bytes`` less what is handed out (free buffers can be released)."""
        return max(0, min(int(self.available_bytes() * self.usable_fraction), self.max_bytes - self.bytes_in_use))

    @property
    def free_buffers(self) -> int:
        return len(self._free)

    @property
    def bytes_free(self) -> int:
        """Bytes of the buffers given back and not taken again (all of them between steps)."""
        return sum(self._bytes(b) for b, _ in self._free)

    @property
    def bytes_in_use(self) -> int:
        """Bytes of the buffers handed out and alive."""
        return sum(entry[1] for entry in self._live_taken().values())

    @property
    def bytes_held(self) -> int:
        """Bytes the pool holds now, handed out and free: the figure to log per layer
        (or per pool, when layers share one)."""
        return self.bytes_in_use + self.bytes_free

    @property
    def bytes_allocated(self) -> int:
        """The same as `bytes_held` (the name earlier code reads)."""
        return self.bytes_held


# -- memory model (docs/design.md §5; derivation in docs/engine.md) ---------------------------

@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank for one micro-batch of one MoE layer.

    saved_bytes:   kept on the device from forward until backward (what autograd
                   and the pipeline save), parameters excluded.
    host_bytes:    offloaded to pinned host memory (S1–S3).
    forward_working_bytes / backward_working_bytes: transient tensors of a pass.
    peak_bytes:    saved + the larger working set: the layer's activation peak
                   above its parameters and input.
    """

    saved_bytes: int
    host_bytes: int
    forward_working_bytes: int
    backward_working_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.saved_bytes + max(self.forward_working_bytes, self.backward_working_bytes)


def predict_memory(config: MoEConfig, tokens: int, world_size: int = 1, partitions: int = 1, strategy: str = "none",
                   engine: str = "mpipemoe", dtype: torch.dtype = torch.bfloat16,
                   rows_sent: int | None = None, rows_received: int | None = None,
                   largest_partition_received: int | None = None,
                   sync_free_capacity: float | None = None, replicas: int = 0, replica_rows: int = 0
                   ) -> MemoryEstimate:
    """Predict the layer's activation memory per rank (derivation in docs/engine.md).

    tokens: T on this rank. rows_sent / rows_received: R and N when known (e.g.
    measured; the busiest rank's N under skewed routing); by default R = N = k·T, exact
    for dropless routing on one rank (and for any routing there: one rank computes
    every pair) and the balanced-routing expectation on several.
    largest_partition_received: the most rows one partition received (a pass's plan knows
    it); by default ⌈N/n⌉. Under skewed routing partitions receive unevenly and the
    per-partition buffers are as large as the fullest one.
    sync_free_capacity: the layer's capacity factor f in the sync-free capacity mode (several
    ranks): every partition of T_i tokens sends and receives E·⌈f·K·T_i/E⌉ rows, padding
    included, so R, N and the fullest partition follow from f (give no rows then).
    replicas, replica_rows: hot experts replicated on this rank (MPipeMoE's ``hot_replicas``,
    FasterMoE's shadowing) and the rows it computes with them itself (rows_sent and
    rows_received then leave those rows out: the layer's `last_rows` do). A replica's weights
    are saved (X values each, X = `shadowing.expert_parameters`), and so are its rows' GEMM
    inputs, pre-activation and activation (D + A + H, SwiGLU's act(A) once more), their
    outputs in the combine's dtype (D) with their gate weight, and two indices per row; its
    gradient and the copy that is reduced onto the owner are backward working memory.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is invalid: choose one of {', '.join(ENGINES)}")
    if engine != "mpipemoe":
        strategy, partitions = "none", (partitions if engine == "fastermoe" else 1)
    policy = RestorePolicy.of(strategy)
    T, K, E, D, H = tokens, config.top_k, config.num_experts, config.d_model, config.d_hidden
    L = config.experts_per_rank(world_size)
    A_width = 2 * H if config.gated else H
    s = torch.empty((), dtype=dtype).element_size()
    r = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    index = 8
    single = world_size == 1
    if sync_free_capacity is not None and not single:
        if (rows_sent, rows_received, largest_partition_received) != (None, None, None):
            raise ValueError(f"sync_free_capacity={sync_free_capacity!r} sets the rows (padded to the capacity): "
                             f"give no rows_sent, rows_received or largest_partition_received with it")
        parts = max(1, partitions)
        slots = [math.ceil(sync_free_capacity * K * (-(-(i + 1) * T // parts) - -(-i * T // parts)) / E)
                 for i in range(parts)]
        rows_sent = rows_received = E * sum(slots)
        largest_partition_received = E * max(slots)
    R = K * T if rows_sent is None or single else rows_sent
    N = K * T if rows_received is None or single else rows_received
    n = max(1, partitions)
    Rn = -(-R // n)
    Nn = -(-N // n) if largest_partition_received is None or single else largest_partition_received
    # Rows of the partitions beside the fullest one: the previous (or next) partition, and
    # a third one (a middle step holds both). Under skewed routing the fullest partition
    # can hold almost every row; its neighbours then hold the rest, not Nn each.
    Nb = min(Nn, max(N - Nn, 0))
    Nb2 = min(Nn, max(N - Nn - Nb, 0)) if n > 2 else 0
    keep_activation = engine == "fastmoe"
    reorder = not single and L > 1  # received rows are re-ordered by expert (a copy each way)
    bias = config.bias

    # Saved by every engine: X (router GEMM), router probabilities, top-k indices and
    # weights, f (balance loss), the (token, choice) rows and weights of un-permute (the
    # combine keeps its weights in the router's dtype, float32 or wider: dispatcher.unpermute).
    saved = s * (T * D + T * K * D) + r * (T * K + T * E + E) + index * 2 * T * K + T * K  # + keep mask (bool)
    if K > 1:
        saved += r * (T * K + T)  # top-k values and their sum (renormalisation)
    if not policy.share_buffers:
        saved += s * N * (D + A_width + (H if keep_activation else 0))
    host = s * N * ((D if policy.offload_input else 0) + (A_width if policy.offload_preactivation else 0))
    held_input = D if policy.offload_input else 0            # restored from the host in backward
    held_preact = A_width if policy.offload_preactivation else 0

    # Forward (pipeline.pipelined_forward), at partition i's GEMM2, the fullest partition
    # sizing every buffer: the combined rows (several ranks: R·D, from the start; they are
    # the saved (token, choice) rows) or the earlier partitions' outputs (one rank); the
    # next partition's rows, gathered (and sent) ahead; this partition's T_DI and A (in
    # `saved` when not shared), act(A), T_DO, the bias rows added into it, and T_DO in
    # source order when rows are re-ordered; the previous partition's T_DO (several ranks:
    # its combine may still read it) and, when shared, its T_DI and A (still referenced
    # while their host copies or the combine run). One rank ends with the partitions'
    # outputs and their concatenation.
    current = Nn * (H + D + (D if bias else 0) + (D if reorder else 0))
    if policy.share_buffers:
        current += Nn * (D + A_width)
    # The fullest partition beside its neighbours: the previous one holds Nb rows; the
    # next one's, gathered ahead, Nb2 (with two partitions no step has both; the previous
    # one's weigh more per row).
    previous = Nb * ((D + A_width if policy.share_buffers else 0) + (0 if single else D))
    if single:
        outputs = (n - 1) * Rn * D + Nb2 * D
        finish = (2 if n > 1 else 1) * R * D  # the partitions' outputs and their concatenation
    else:
        outputs = R * D + ((Rn + Nb2) * D if n > 2 else 0)
        finish = R * D
    forward_working = s * max(outputs + current + (previous if n > 1 else 0) - T * K * D, finish)

    # Backward (pipeline.pipelined_backward), per partition step, as live tensors (counted
    # op by op on CPU: tests/moe_engine/test_memory_peak.py): the dy rows and, unless one
    # partition on one rank hands its dx straight on, the dx rows (R·D each; the saved
    # (token, choice) rows are freed by then); this partition's dy (received, several ranks;
    # on one rank a view of the dy rows), its T_DI and A (restored, re-sent or recomputed
    # when shared; in `saved` otherwise); then the larger of two phases: the input gradient
    # (Experts.input_grad: dh and the activation's temporaries, three Nn·H for SwiGLU, and
    # dx) and the weight gradients (act(A) and dA, dx and its copy in source order when
    # rows are re-ordered, one weight-sized product). The first step runs before any
    # gradient exists and holds the next partition's inputs, fetched ahead; a later step
    # holds all the gradients, the previous partition's dx still travelling (several
    # ranks) and, but for the last step, the next partition's inputs.
    base = R * D + (0 if single and n == 1 else R * D) - T * K * D
    if not single:
        base += Nn * D                                           # this partition's dy
    restore = Nn * (D + A_width) if policy.share_buffers else 0
    dx_rows = Nn * D * (2 if reorder else 1)                     # dx (and its copy in source order)
    # The next partition's inputs, fetched while this one computes: its dy (several ranks),
    # T_DI from the host or re-sent (with the x rows sent for it), A from the host.
    # The first step fetches the second partition's (Nb rows); a middle step the next
    # one's while the previous one's dx travels (Nb2 and Nb rows, or the other way round).
    def prefetch(rows: int) -> int:
        if not rows:
            return 0
        ahead = rows * (held_input + held_preact)
        if not single:
            ahead += rows * D + (rows * D + Rn * D if policy.recommunicate_input else 0)
        return ahead
    travelling = 0 if single else Nb * D                          # the previous partition's dx
    # Hidden-width tensors of each phase: the input gradient's (dh and the activation's
    # temporaries: three Nn·H for SwiGLU, experts.swiglu_backward; GELU's dA and act(A),
    # kernels.gelu_backward_and_activation), and the weight gradients' (act(A) and dA, then
    # dA alone once act(A) has served w2's gradient; FastMoE's act(A) is saved, not working;
    # SwiGLU's and GELU's act(A) come from the input gradient).
    if config.gated:
        input_phase, weight_hidden, after_w2_hidden = 3 * Nn * H, 3 * Nn * H, 2 * Nn * H
        input_phase += Nn * D                                     # dup's product, added into dx
    else:
        activation_made = config.activation == "gelu" and not keep_activation
        input_phase = (2 if activation_made else 1) * Nn * H
        weight_hidden, after_w2_hidden = (1 if keep_activation else 2) * Nn * H, Nn * H
    input_phase += Nn * D                                         # dx, written by the last GEMM
    param_grads = L * (2 * D * H + (D * H if config.gated else 0) + (H + D if bias else 0))
    weight_grad = L * D * H  # one weight's gradient
    first_step = base + restore + prefetch(Nb) + max(
        input_phase, weight_hidden + dx_rows + weight_grad, after_w2_hidden + dx_rows + param_grads)
    later_steps = 0
    if n > 1:
        later_steps = (base + restore + prefetch(Nb2) + travelling + param_grads
                       + max(input_phase, weight_hidden + dx_rows + weight_grad))
    finish = 3 * R * D + T * D - T * K * D + param_grads  # dy, dx rows, their gather and sum
    backward_working = s * max(first_step, later_steps, finish)
    if replicas or replica_rows:
        X = 2 * D * H + (D * H if config.gated else 0) + ((H + D) if bias else 0)
        saved += s * replicas * X + replica_rows * (s * (D + A_width + H + (H if config.gated else 0))
                                                    + r * (D + 1) + 2 * index)
        backward_working += s * 2 * replicas * X
    return MemoryEstimate(saved, host, forward_working, backward_working)
