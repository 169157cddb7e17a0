"""MPipeMoE: pipelined, memory-frugal Mixture-of-Experts layers (PyTorch only).

    from moe_engine import MoEConfig, MPipeMoE, FastMoE, FasterMoE
    layer = MPipeMoE(MoEConfig(d_model=1024, d_hidden=4096, num_experts=8))
    y, aux_loss = layer(x)

Shape legend, the one for the whole project (moe_engine, moe_sim, lm, workers, app): a
tensor's name ends in the letters of its dimensions, in order (`x_TD`, `counts_CE`,
`q_BMSd`), and the same letters name those sizes in docstrings and formulas.

    T tokens on this rank             E experts (global)
    K top-k                           L local experts (E / W)
    P (token, choice) pairs, K·T      W ranks of the expert-parallel group
    D d_model                         G GPUs per node
    H d_hidden (an expert's width)    J peer offsets (rank r sends to r + j mod W)
    A pre-activation width (H, or     C count chunks
      2H for SwiGLU)                  X a row of the exchanged count table (C·L counts,
    I, O a projection's input and       then the pass statistics)
      output width (D or H)           n partitions (a count, never a suffix)
    R rows this rank sends            B batch (sequences)
    N rows this rank receives,        S sequence length (a sampled window holds S+1
      grouped by local expert           tokens: inputs, and targets shifted by one)
    V vocabulary                      M attention heads; d head width (D / M)
"""
from .config import MemoryBudget, MemoryBudgetError, MoEConfig
from .factory import EngineSpec, build_layer
from .layers import FastMoE, FasterMoE, MPipeMoE
from .memory import HostBufferPool, predict_memory
from .perf_model import HardwareProfile, ProfileCache, ProfileStore

__all__ = ["MoEConfig", "MemoryBudget", "MemoryBudgetError", "MPipeMoE", "FastMoE", "FasterMoE", "EngineSpec", "build_layer", "HostBufferPool", "predict_memory",
           "HardwareProfile", "ProfileCache", "ProfileStore"]
