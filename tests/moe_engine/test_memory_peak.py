"""Tier 1: the memory model's peak against the live tensor bytes of a step on CPU
(tests/moe_engine/live_memory.py counts them op by op), gpt-xl's proportions
(H = 4D, 64 experts, one per emulated rank) at small size, on one rank and as rank 0 of an
emulated 8x8 cluster (moe_sim.emulation; on CPU its transfers are copies, no waits).
The GPU records (tools/memory_accuracy.py) are the ground truth; this pins which tensors
the model counts. No timing."""
import pytest
import torch

from moe_engine import MoEConfig, MPipeMoE
from moe_engine.memory import predict_memory
from moe_sim.emulation import EmulatedCluster
from tests.moe_engine.live_memory import step_peak


@pytest.mark.parametrize("emulated", [False, True], ids=["one-rank", "emulated-8x8"])
@pytest.mark.parametrize("strategy", ["none", "S3", "S4"])
@pytest.mark.parametrize("partitions", [1, 2, 4])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_the_live_peak_lies_within_the_model(activation, partitions, strategy, emulated):
    config = MoEConfig(d_model=256, d_hidden=1024, num_experts=64 if emulated else 8, top_k=2, activation=activation,
                       bias=activation != "swiglu")
    torch.manual_seed(0)
    group = EmulatedCluster.parse("8x8", "dgx-h200").build() if emulated else None
    layer = MPipeMoE(config, group, partitions=partitions, strategy=strategy)
    tokens = 2048
    x, grad_y = torch.randn(tokens, 256), torch.randn(tokens, 256)
    step_peak(layer, x, grad_y)  # warm-up: the host pool
    measured = step_peak(layer, x, grad_y).peak
    sent, received, fullest = layer.last_rows
    predicted = predict_memory(config, tokens, 64 if emulated else 1, partitions, strategy, dtype=torch.float32,
                               rows_sent=sent, rows_received=received, largest_partition_received=fullest)
    # Emulated n = 4 with S3/S4: these random routes fill the four partitions unevenly, and
    # the model prices the fullest one's neighbours at up to Nn rows each (1.125 here; the
    # GPU records at gpt-xl's size: 0.99-1.03). Over, never under.
    high = 1.15 if emulated and partitions == 4 and strategy != "none" else 1.1
    assert 0.9 <= predicted.peak_bytes / measured <= high, (predicted.peak_bytes, measured)
