"""``mpipemoe generate``: text from a trained run's newest checkpoint, with the run's tokenizer.

    mpipemoe generate --run NAME --prompt "def main(" --max-new-tokens 80     # greedy
    mpipemoe generate --run NAME --prompt "import " --top-k 40 --temperature 0.8 --seed 1

Greedy by default (``--top-k 1``; ``--temperature 0`` is greedy too); otherwise top-k
sampling, seeded by ``--seed`` (lm/sampling.py). The model is loaded in this process with
every expert, whatever number of workers trained it (workers/weights.py). The prompt and
its continuation go to stdout; where they came from goes to stderr.
The run is loaded by ``app.jobs.trained.trained_run`` (shared with ``mpipemoe export``).
"""
from __future__ import annotations

import argparse
import sys

from app.jobs.trained import trained_run

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="NAME", help="a training run (mpipemoe train --name)")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="tokens to add (default 100)")
    parser.add_argument("--top-k", type=int, default=1,
                        help="sample from the K most likely tokens; 1 (default): greedy; 0: all")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="divides the logits before sampling (default 1.0); 0: greedy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--storage-path", default=None, help="where the run is (default ./ray_results)")


def run(args: argparse.Namespace) -> int:
    import torch

    from lm.sampling import check_sampling, generate, is_greedy

    check_sampling(args.max_new_tokens, args.top_k, args.temperature)  # before the model loads
    trained = trained_run(args.run, args.storage_path)
    tokenizer = trained.tokenizer
    prompt_ids = [int(i) for i in tokenizer.encode(args.prompt)] or [tokenizer.eos_id]
    how = "greedy" if is_greedy(args.top_k, args.temperature) else \
        f"top-k {args.top_k or 'all'}, temperature {args.temperature:g}, seed {args.seed}"
    print(f"[mpipemoe] {args.run} at step {trained.meta.get('step')} ({trained.checkpoint.name}), "
          f"{len(prompt_ids)} prompt tokens, {how}", file=sys.stderr)
    stream = TextStream(tokenizer.decode)
    print(args.prompt, end="", flush=True)
    try:
        with torch.no_grad():  # (not torch.set_grad_enabled(False): the CLI may run inside a longer process)
            generate(trained.model, prompt_ids, max_new_tokens=args.max_new_tokens, top_k=args.top_k,
                     temperature=args.temperature, generator=torch.Generator().manual_seed(args.seed),
                     stop_id=tokenizer.eos_id, on_token=stream.add)
    finally:  # Ctrl-C keeps what was printed, and ends the line
        stream.flush()
        print(flush=True)
    return 0


class TextStream:
    """Prints generated ids as text while they come: ids are held back only while their text
    ends in the middle of a character (a byte-level tokenizer's partial UTF-8, decoded as U+FFFD)."""

    HELD_BACK = 16  # ids a partial character may span at most (4 bytes of UTF-8, and room for merges)

    def __init__(self, decode, out=None):
        self.decode, self.out, self.pending = decode, out or sys.stdout, []

    def add(self, token: int) -> None:
        self.pending.append(token)
        text = self.decode(self.pending)
        if not text.endswith("\ufffd") or len(self.pending) >= self.HELD_BACK:
            self._emit(text)

    def flush(self) -> None:
        if self.pending:
            self._emit(self.decode(self.pending))

    def _emit(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
        self.pending = []
