"""The MoE layer shapes and dtypes the layer commands (bench, calibrate) and tools/ measure.

Layer shapes of the paper's models (docs/design.md §6) and a tiny one for CPUs, as
(d_model, d_hidden); dtypes by their command-line names.
"""
from __future__ import annotations

import torch

LAYER_SHAPES = {"gpt-s": (1024, 4096), "gpt-xl": (2048, 8192), "bert-l": (1024, 4096), "tiny": (64, 128)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
