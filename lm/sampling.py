"""Text generation from a trained decoder (``mpipemoe generate``): greedy or top-k sampling.

    ids = generate(model, prompt_ids, max_new_tokens=100, top_k=40, temperature=0.8,
                   generator=torch.Generator().manual_seed(0))

Each new token reads the last ``seq_len`` tokens (the positions the model has); the whole
window is run again per token (no KV cache: the models this serves are small, and the MoE
engines take whole batches). ``top_k`` 1 or ``temperature`` 0 is greedy (argmax; no
randomness). Otherwise the logits are divided by ``temperature``, all but the ``top_k``
largest (0: all) are dropped, and the next token is drawn from the softmax with
``generator`` (the same seed gives the same text).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch


# One command's tokens: the whole window runs again per token, so this many take minutes on a
# GPU and hours on CPU; more text is another command with the output as its prompt.
MAX_NEW_TOKENS = 65536


def check_sampling(max_new_tokens: int, top_k: int, temperature: float) -> None:
    """Raise ValueError naming the option and the fix for settings ``generate`` cannot use."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"--max-new-tokens {max_new_tokens} is invalid: give an integer in 1-{MAX_NEW_TOKENS} "
                         f"(for more, generate again with the output as the prompt)")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"--top-k {top_k} is invalid: give an integer >= 1 (1: greedy), or 0 for the whole vocabulary")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"--temperature {temperature} is invalid: give a number >= 0 (0: greedy)")


def is_greedy(top_k: int, temperature: float) -> bool:
    return top_k == 1 or temperature == 0


@torch.no_grad()
def next_token(logits_V: torch.Tensor, top_k: int, temperature: float, generator: torch.Generator | None) -> int:
    """The next token id from the last position's logits (see the module docstring)."""
    logits_V = logits_V.float()
    if is_greedy(top_k, temperature):
        return int(logits_V.argmax())
    logits_V = logits_V / temperature
    if 0 < top_k < logits_V.numel():
        kth = torch.topk(logits_V, top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    probs_V = torch.softmax(logits_V, dim=-1).cpu()
    return int(torch.multinomial(probs_V, 1, generator=generator))


@torch.no_grad()
def generate(model, prompt_ids: list[int], *, max_new_tokens: int, top_k: int = 1, temperature: float = 1.0,
             generator: torch.Generator | None = None, stop_id: int | None = None,
             on_token: Callable[[int], None] | None = None) -> list[int]:
    """The ids ``model`` (a ``lm.model.MoETransformer`` of a gpt preset, in eval mode) adds
    after ``prompt_ids``: up to ``max_new_tokens``, ending early after ``stop_id``.
    ``on_token(id)`` is called with each id as it is drawn (``mpipemoe generate`` prints it)."""
    check_sampling(max_new_tokens, top_k, temperature)
    if model.preset.kind != "gpt":
        raise ValueError(f"generation needs a decoder (a gpt preset); this model is a {model.preset.kind} "
                         f"(a masked language model)")
    if not prompt_ids:
        raise ValueError("the prompt has no tokens: give some text (or start from the end-of-text token)")
    device = next(model.parameters()).device
    ids = list(prompt_ids)
    new = []
    for _ in range(max_new_tokens):
        window_1S = torch.tensor([ids[-model.preset.seq_len:]], dtype=torch.long, device=device)
        logits_1SV, _ = model(window_1S)
        token = next_token(logits_1SV[0, -1], top_k, temperature, generator)
        ids.append(token)
        new.append(token)
        if on_token is not None:
            on_token(token)
        if token == stop_id:
            break
    return new
