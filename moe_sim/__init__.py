"""The schedule simulator of MoE layers on a cluster (docs/simulate.md), beside the engine.

    simulator.py  one layer's forward+backward, and a training step, priced op by op from
                  the engine's own schedule (moe_engine/schedule.py)
    parts.py      the single-GPU parts it prices with (measured, or from a profile)
    network.py    the cluster's links and the All-to-All's cost
    emulation.py  an emulated cluster: the engine's real kernels on one GPU, modelled links

moe_sim imports moe_engine; moe_engine never imports moe_sim.
"""
