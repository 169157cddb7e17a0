"""MPipeMoE: pipelined, memory-frugal Mixture-of-Experts layers (PyTorch only).

    from moe_engine import MoEConfig, MPipeMoE, FastMoE, FasterMoE
    layer = MPipeMoE(MoEConfig(d_model=1024, d_hidden=4096, num_experts=8))
    y, aux_loss = layer(x)
"""
from .config import MoEConfig
from .layers import FastMoE, FasterMoE, MPipeMoE
from .memory import HostBufferPool, predict_memory
from .perf_model import HardwareProfile, ProfileCache, ProfileStore

__all__ = ["MoEConfig", "MPipeMoE", "FastMoE", "FasterMoE", "HostBufferPool", "predict_memory",
           "HardwareProfile", "ProfileCache", "ProfileStore"]
