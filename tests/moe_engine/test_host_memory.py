"""Tier 1-2: offload strategies (S1-S3) check the host memory their buffers need against
what is available and fall back to S4 (no host memory) on every rank, with a logged reason.

The available-memory source is injected (``HostBufferPool(available_bytes=...)``), so the
tests force the fallback without touching the machine's memory.
"""
import contextlib
import logging
import random

import pytest
import torch

from moe_engine import HostBufferPool, MoEConfig, MPipeMoE
from moe_engine.memory import available_host_memory
from tests.distributed import run_on_ranks

CONFIG = MoEConfig(d_model=8, d_hidden=16, num_experts=4, top_k=2)
PLENTY = 64 * 2**30


def _step(layer: MPipeMoE, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Forward + backward; (y, {parameter name: grad}) and x.grad under 'x'."""
    x = x.clone().requires_grad_(True)
    y, aux = layer(x)
    (y.pow(2).sum() + aux).backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    grads["x"] = x.grad
    layer.zero_grad(set_to_none=True)
    return y.detach(), grads


def _layer(strategy: str, available_bytes) -> MPipeMoE:
    torch.manual_seed(0)
    return MPipeMoE(CONFIG, partitions=2, strategy=strategy,
                    host_pool=HostBufferPool(available_bytes=available_bytes))


def test_available_host_memory_reads_the_machine():
    assert 0 < available_host_memory() < 2**50


def test_pool_settings_are_validated():
    with pytest.raises(ValueError, match=r"usable_fraction=0 is invalid: give a number in \(0, 1\]"):
        HostBufferPool(usable_fraction=0)


def test_pool_counts_the_bytes_it_would_grow_by():
    pool = HostBufferPool()
    assert pool.bytes_to_grow([(100, torch.float32), (3, torch.float64)]) == 100 * 4 + 3 * 8
    pool.give_back(pool.take(100, torch.float32, pin=False))
    assert pool.bytes_to_grow([(100, torch.float32)]) == 0           # reuses the free buffer
    assert pool.bytes_to_grow([(100, torch.float32)] * 2) == 100 * 4  # only one is free
    assert HostBufferPool(available_bytes=lambda: 1000, usable_fraction=0.5).usable_bytes() == 500


class _PinnedOnPaper(HostBufferPool):
    """A pool whose buffers count as pinned (CPU tensors stand in for them), with the
    host-cache releases recorded: the pool's own accounting without a GPU."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.cache_emptied = 0

    def _is_pinned(self, buffer):
        return True

    @staticmethod
    def _allocate(capacity, dtype, pin):
        assert pin
        return torch.empty(capacity, dtype=dtype)


def test_pinned_buffers_are_counted_as_the_host_allocator_rounds_them_and_released_for_real(monkeypatch):
    """torch's caching host allocator rounds a pinned request up to a power of two and keeps
    freed blocks in its cache: the pool asks for the whole block, counts it, and empties
    that cache when it drops pinned buffers, so what it says it holds is what it costs."""
    from moe_engine import memory

    pool = _PinnedOnPaper(max_bytes=2**20)
    monkeypatch.setattr(memory, "empty_host_cache", lambda: setattr(pool, "cache_emptied", pool.cache_emptied + 1))
    assert memory.pinned_block_bytes(4100) == 8192 and memory.pinned_block_bytes(4096) == 4096
    assert pool.bytes_to_grow([(1025, torch.float32)], pin=True) == 8192  # 4100 bytes: an 8 KiB block
    assert pool.bytes_to_grow([(1025, torch.float32)], pin=False) == 1088 * 4  # pageable: 1/16 steps
    buffer = pool.take(1025, torch.float32, pin=True)
    assert buffer.numel() == 2048 and pool.bytes_held == 8192  # the block, used whole
    pool.give_back(buffer)
    again = pool.take(1500, torch.float32, pin=True)  # fits the block a new request would take
    assert again.data_ptr() == buffer.data_ptr() and pool.bytes_to_grow([(1025, torch.float32)], pin=True) == 8192
    pool.give_back(again)
    assert pool.cache_emptied == 0
    large = pool.take(200_000, torch.float32, pin=True)  # 800 KB: a 1 MiB block; the free 8 KiB one must go
    assert pool.free_buffers == 0 and pool.bytes_held == 2**20 == large.numel() * 4 and pool.cache_emptied == 1


@pytest.mark.parametrize("strategy", ["S1", "S2", "S3"])
def test_offload_falls_back_to_s4_when_host_memory_is_short(strategy, caplog):
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    short = _layer(strategy, available_bytes=lambda: 0)
    with caplog.at_level(logging.WARNING, logger="moe_engine.layers"):
        y, grads = _step(short, x)
    assert short.last_strategy == "S4"
    assert short.host_pool.bytes_allocated == 0
    assert f"{strategy} for 12 tokens" in short.host_fallback_reason
    assert "using S4" in caplog.text and "more bytes of host memory" in caplog.text
    # Same numbers as the offloading run with enough memory.
    enough = _layer(strategy, available_bytes=lambda: PLENTY)
    y_ref, grads_ref = _step(enough, x)
    assert enough.last_strategy == strategy and enough.host_pool.bytes_allocated > 0
    assert enough.host_fallback_reason is None
    torch.testing.assert_close(y, y_ref)
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


def test_memory_is_asked_only_when_the_pass_shape_changes():
    calls = []

    def available():
        calls.append(1)
        return PLENTY

    layer = _layer("S1", available)
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        _step(layer, x)
    assert len(calls) == 1 and layer.last_strategy == "S1"
    _step(layer, torch.randn(40, 8))    # more tokens: checked again
    assert len(calls) == 2
    with torch.no_grad():               # no backward, nothing offloaded: no check
        layer(torch.randn(7, 8))
    assert len(calls) == 2


def test_no_memory_check_for_non_offloading_strategies():
    layer = _layer("S4", available_bytes=lambda: pytest.fail("S4 needs no host memory"))
    _step(layer, torch.randn(12, 8))
    assert layer.last_strategy == "S4" and layer.host_pool.bytes_allocated == 0


def _one_rank_short(rank, world_size):
    """Rank 0 has no host memory to spare, rank 1 plenty: both must run S4 (the strategy
    decides whether backward re-communicates, so a split decision would hang)."""
    x = torch.randn(10 + 5 * rank, 8, generator=torch.Generator().manual_seed(rank))
    layer = MPipeMoE(CONFIG, partitions=2, strategy="S1",
                     host_pool=HostBufferPool(available_bytes=(lambda: 0) if rank == 0 else (lambda: PLENTY)))
    _step(layer, x)
    return layer.last_strategy, layer.host_fallback_reason, layer.host_pool.bytes_allocated


@pytest.mark.gloo
def test_one_short_rank_moves_every_rank_to_s4():
    (s0, reason0, bytes0), (s1, reason1, bytes1) = run_on_ranks(2, _one_rank_short, collective_timeout_s=30)
    assert s0 == s1 == "S4" and bytes0 == bytes1 == 0
    assert "more bytes of host memory" in reason0 and "does not fit on another rank" in reason1


# -- buffers whose host-to-device copy is still queued --------------------------------------

class FakeEvent:
    """A CUDA event stand-in: pending until `synchronize` (or ``done=True``)."""

    def __init__(self, done=False):
        self.done = done
        self.synchronized = False

    def query(self):
        return self.done

    def synchronize(self):
        self.synchronized = self.done = True


class FakeStream:
    """A CUDA stream stand-in that records the events it was made to wait for."""

    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def test_a_buffer_whose_copy_is_pending_orders_its_taker_after_the_copy():
    pool = HostBufferPool()
    buffer = pool.take(100, torch.float32, pin=False)
    copy = FakeEvent()
    pool.give_back(buffer, in_use_until=copy)
    assert pool.free_buffers == 1 and pool.bytes_free == 100 * 4
    assert pool.bytes_to_grow([(100, torch.float32)]) == 0
    writer = FakeStream()
    assert pool.take(100, torch.float32, pin=False, stream=writer) is buffer
    assert writer.waited == [copy] and not copy.synchronized   # ordered on the device, host not blocked
    copy = FakeEvent()
    pool.give_back(buffer, in_use_until=copy)
    assert pool.take(100, torch.float32, pin=False) is buffer   # no stream: the host waits
    assert copy.synchronized


def test_a_buffer_whose_copy_is_done_is_preferred_and_needs_no_wait():
    pool = HostBufferPool()
    busy, idle, bare = (pool.take(100, torch.float32, pin=False) for _ in range(3))
    busy_copy, idle_copy = FakeEvent(), FakeEvent(done=True)
    pool.give_back(busy, in_use_until=busy_copy)
    pool.give_back(idle, in_use_until=idle_copy)
    pool.give_back(bare)
    writer = FakeStream()
    assert {id(pool.take(100, torch.float32, pin=False, stream=writer)) for _ in range(2)} == {id(idle), id(bare)}
    assert writer.waited == [] and not busy_copy.synchronized
    assert pool.take(100, torch.float32, pin=False, stream=writer) is busy and writer.waited == [busy_copy]
    assert pool.free_buffers == 0 and pool.bytes_allocated == 3 * 100 * 4


def test_the_pool_never_hands_out_a_pending_buffer_unordered():
    """Random give-backs (copy pending, done or none) and takes (on a stream or the host):
    each buffer taken while its copy is pending was ordered after that copy."""
    rng = random.Random(0)
    pool = HostBufferPool()
    held = [pool.take(128, torch.float32, pin=False) for _ in range(6)]
    copies = {}                                   # id(buffer) -> the event it went back with
    for _ in range(400):
        if not pool.free_buffers or (held and rng.random() < 0.5):
            buffer = held.pop(rng.randrange(len(held)))
            copies[id(buffer)] = rng.choice((None, FakeEvent(), FakeEvent(done=True)))
            pool.give_back(buffer, in_use_until=copies[id(buffer)])
        else:
            for event in copies.values():       # some queued copies finish meanwhile
                if event is not None and rng.random() < 0.2:
                    event.done = True
            stream = rng.choice((None, FakeStream()))
            pending_before = {key: event is not None and not event.done for key, event in copies.items()}
            buffer = pool.take(rng.choice((110, 120, 128)), torch.float32, pin=False, stream=stream)
            event = copies.pop(id(buffer), None)
            if pending_before.get(id(buffer)):
                assert (stream is not None and stream.waited == [event]) or (stream is None and event.synchronized)
            else:
                assert stream is None or stream.waited == []
            held.append(buffer)
    assert pool.bytes_allocated == 6 * 128 * 4   # every take reused a free buffer


def _restore_then_reuse(device: torch.device, taker: str, numel: int) -> None:
    """Restore a pooled host buffer to ``device`` (on CUDA: on stream A behind a long
    kernel), give it back with the copy's event, take it again at once and overwrite it (on
    stream B, or by the host). The restore must still read the original data."""
    cuda = device.type == "cuda"
    pool = HostBufferPool()
    original = torch.arange(numel, dtype=torch.float32)
    host = pool.take(numel, torch.float32, pin=cuda)
    host.copy_(original)
    restored = torch.empty(numel, device=device)
    newer = torch.full((numel,), -1.0, device=device)
    a, b = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)
    restore_done = None
    if a is not None and b is not None:
        a.wait_stream(torch.cuda.current_stream(device))
        b.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(a):
            torch.cuda._sleep(50_000_000)             # the restore queues behind ~tens of ms of work
            restored.copy_(host, non_blocking=True)
            restore_done = a.record_event()
    else:
        restored.copy_(host)
    pool.give_back(host, in_use_until=restore_done)
    if taker == "stream":
        reused = pool.take(numel, torch.float32, pin=cuda, stream=b)
        with torch.cuda.stream(b) if b is not None else contextlib.nullcontext():
            reused.copy_(newer, non_blocking=True)  # the next offload
    else:
        reused = pool.take(numel, torch.float32, pin=cuda)
        reused.fill_(-1.0)
    assert reused.data_ptr() == host.data_ptr()
    if cuda:
        torch.cuda.synchronize(device)
    assert torch.equal(restored.cpu(), original), "the restore read data written after the buffer went back"
    assert torch.equal(reused, torch.full((numel,), -1.0))


def test_pool_stays_within_a_quarter_of_the_largest_need_over_200_random_passes():
    """Per pass, S1 with n = 4 offloads T_DI (N_i × D) and A (N_i × 2H) of each partition,
    where N_i, the rows a rank receives, moves with the routing (here: uniform within ±30%
    of balanced, as on two ranks with random routing). The pool reuses what fits, frees what
    nothing fits, and never holds more than 1.25x the most any pass asked for (the pool of
    power-of-two bins that never freed held 2.6x)."""
    rng = random.Random(0)
    pool = HostBufferPool(available_bytes=lambda: PLENTY)
    D, A = 64, 256
    needs, held = [], []
    for _ in range(200):
        requests = [rows * width for rows in (rng.randint(700, 1300) for _ in range(4)) for width in (D, A)]
        needs.append(4 * sum(requests))
        buffers = [pool.take(numel, torch.float32, pin=False) for numel in requests]
        held.append(pool.bytes_held)
        for buffer in reversed(buffers):
            pool.give_back(buffer)
        held.append(pool.bytes_held)
    assert max(held) <= 1.25 * max(needs), (max(held), max(needs))
    assert pool.bytes_held >= needs[-1]  # and it keeps what the passes reuse


def test_an_offloading_layer_holds_what_its_passes_need():
    """The engine's own passes (S1, n = 2, random token counts): the pool's bytes stay
    within 1.25x the largest pass's offloads."""
    layer = _layer("S1", available_bytes=lambda: PLENTY)
    g = torch.Generator().manual_seed(3)
    needs, held = [], []
    for _ in range(30):
        tokens = int(torch.randint(24, 64, (), generator=g))
        x = torch.randn(tokens, CONFIG.d_model, generator=g, requires_grad=True)
        y, aux = layer(x)
        # the offloads of a pass: T_DI (k·T × D) and A (k·T × H), in float32
        needs.append(4 * CONFIG.top_k * tokens * (CONFIG.d_model + CONFIG.d_hidden))
        held.append(layer.host_pool.bytes_held)
        (y.square().sum() + aux).backward()
        held.append(layer.host_pool.bytes_held)
    assert max(held) <= 1.25 * max(needs), (max(held), max(needs))


@pytest.mark.gpu
@pytest.mark.parametrize("taker", ["stream", "host"])
def test_a_queued_restore_reads_the_data_it_was_given(taker):
    _restore_then_reuse(torch.device("cuda"), taker, 1 << 20)


def test_a_queued_restore_reads_the_data_it_was_given_cpu_twin():
    for taker in ("stream", "host"):
        _restore_then_reuse(torch.device("cpu"), taker, 1 << 10)  # a pool capacity (a power of two)


@pytest.mark.gpu
def test_the_pinned_pool_holds_what_torchs_host_allocator_says_and_frees_what_it_releases():
    """On CUDA: the bytes the pool says it holds are the bytes torch's caching host allocator
    took for it (its power-of-two blocks), and a release gives them back to CUDA."""
    from moe_engine.memory import empty_host_cache

    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        pytest.skip("this torch has no torch.cuda.host_memory_stats")
    torch.cuda.synchronize()
    empty_host_cache()

    def allocated():
        return stats().get("allocated_bytes.current", 0)

    before = allocated()
    pool = HostBufferPool(available_bytes=lambda: PLENTY)
    buffers = [pool.take(numel, torch.bfloat16, pin=True) for numel in (3000, 70_001, 1 << 20)]
    assert all(b.is_pinned() for b in buffers)
    assert allocated() - before == pool.bytes_held == 8192 + 262_144 + 2 * 2**20
    for buffer in buffers:
        pool.give_back(buffer)
    del buffer, buffers
    pool._release(0)
    assert pool.bytes_held == 0 and allocated() == before


def test_the_pinned_pool_holds_what_torchs_host_allocator_says_and_frees_what_it_releases_cpu_twin():
    """The GPU test's pool on CPU with pageable buffers: what it holds covers the requests,
    and a full release frees every buffer given back."""
    pool = HostBufferPool(available_bytes=lambda: PLENTY)
    buffers = [pool.take(numel, torch.bfloat16, pin=False) for numel in (3000, 70_001, 1 << 20)]
    assert pool.bytes_held >= 2 * (3000 + 70_001 + (1 << 20))
    for buffer in buffers:
        pool.give_back(buffer)
    del buffer, buffers
    pool._release(0)
    assert pool.bytes_held == 0
