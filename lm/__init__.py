"""The language model and its data: the MoE transformer (``lm.model``), tokenized shards and
the per-rank streams workers read (``lm.data``), the tokenizers (``lm.tokenizer``).

Layer: below ``app`` and ``workers``, above ``moe_engine`` (tests/test_layers.py): it imports
``moe_engine``, never ``workers`` or ``app``.
"""
