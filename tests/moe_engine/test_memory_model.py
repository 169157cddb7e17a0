"""Tier 1: the bytes each engine saves for backward (seen through saved-tensor hooks)
equal the memory model of docs/design.md §5 exactly, per engine, strategy, activation and top-k."""
import pytest
import torch

from moe_engine import FastMoE, FasterMoE, MoEConfig, MPipeMoE
from moe_engine.memory import predict_memory


def saved_bytes(layer, x, host: bool = False) -> int:
    """Bytes of distinct storages autograd keeps for backward, parameters excluded: the
    device's (`host=False`), or the host copies in the layer's pool (`host=True`)."""
    parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    pool = getattr(layer, "host_pool", None)
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters and host == bool(pool and pool.owns(t)):
            storages[storage.data_ptr()] = t.numel() * t.element_size() if host else storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, aux = layer(x)
    (y.sum() + aux).backward()  # the graph is usable
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("engine, partitions, strategy", [
    ("fastmoe", 1, "none"), ("fastermoe", 1, "none"),
    *[("mpipemoe", n, s) for n in (1, 3) for s in ("none", "S1", "S2", "S3", "S4")],
])
def test_saved_bytes_match_model(engine, partitions, strategy, activation, top_k, dtype):
    config = MoEConfig(d_model=16, d_hidden=24, num_experts=4, top_k=top_k, activation=activation)
    torch.manual_seed(0)
    layer = {"fastmoe": lambda: FastMoE(config, dtype=dtype),
             "fastermoe": lambda: FasterMoE(config, dtype=dtype),
             "mpipemoe": lambda: MPipeMoE(config, partitions=partitions, strategy=strategy, dtype=dtype)}[engine]()
    tokens = 40
    x = torch.randn(tokens, 16, dtype=dtype, requires_grad=True)
    predicted = predict_memory(config, tokens, world_size=1, partitions=partitions, strategy=strategy,
                               engine=engine, dtype=dtype)
    assert saved_bytes(layer, x) == predicted.saved_bytes
    assert saved_bytes(layer, x, host=True) == predicted.host_bytes


def test_sharing_saves_the_expert_activations():
    config = MoEConfig(d_model=2048, d_hidden=8192, num_experts=8, top_k=2)
    keep = predict_memory(config, 16384, partitions=4, strategy="none")
    for strategy in ("S1", "S2", "S3", "S4"):
        shared = predict_memory(config, 16384, partitions=4, strategy=strategy)
        assert shared.saved_bytes < keep.saved_bytes
        assert shared.peak_bytes < keep.peak_bytes
    # more partitions: smaller working buffers
    assert predict_memory(config, 16384, partitions=8, strategy="S4").peak_bytes < \
        predict_memory(config, 16384, partitions=2, strategy="S4").peak_bytes


def test_the_fullest_partition_sizes_the_shared_buffers():
    """Under skewed routing partitions receive unevenly: the model sized by the fullest one
    predicts more than by an even split, the same for an even one, and n = 1 is unchanged."""
    config = MoEConfig(d_model=64, d_hidden=256, num_experts=16, top_k=2)

    def predict(n, strategy, fullest=None):
        return predict_memory(config, 4096, 8, n, strategy, rows_sent=2 * 4096, rows_received=4 * 2 * 4096,
                              largest_partition_received=fullest)

    even = predict(4, "S4")
    assert predict(4, "S4", 2 * 4096) == even
    assert predict(4, "S4", 6 * 4096).peak_bytes > even.peak_bytes
    assert predict(1, "none", 8 * 4096) == predict(1, "none")


def test_a_layer_records_the_rows_of_its_last_pass():
    config = MoEConfig(d_model=16, d_hidden=32, num_experts=4, top_k=2)
    layer = MPipeMoE(config, None, 3, "none")
    layer(torch.randn(50, 16))
    sent, received, fullest = layer.last_rows
    assert sent == received == 100 and 100 / 3 <= fullest <= 100   # one rank computes every pair
