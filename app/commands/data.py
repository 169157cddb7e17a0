"""``mpipemoe data``: prepare training data (lm/data.py does the work) and show what was prepared.

    mpipemoe data prepare                       # default: this Python's stdlib sources
    mpipemoe data prepare --source ~/books --out data/books
    mpipemoe data prepare --tokenizer checkpoints/mixtral --out data/mixtral   # a checkpoint's tokenizer.json
    mpipemoe data info [--data-dir DIR]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from lm.data import DEFAULT_MAX_BYTES, DEFAULT_ROW_LEN, DEFAULT_VAL_FRACTION, MANIFEST, default_data_dir, \
    prepare_dataset, skipped_binary_files, skipped_empty_texts
from lm.errors import invocation
from lm.tokenizer import TokenizerSpec


# ---- command line -------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    prep = sub.add_parser("prepare", help="tokenize text into Parquet shards")
    prep.add_argument("--source", nargs="+", default=None,
                      help="text files, directories, Parquet or JSONL files with a 'text' column (Parquet: "
                           "or pre-tokenized 'tokens'), local Hugging Face datasets directories; "
                           "default: this Python's stdlib sources")
    prep.add_argument("--tokenizer", default="bytes",
                      help="bytes (default, vocabulary 259), bpe[:VOCAB] (train a byte-level BPE on the "
                           "corpus, default 8192 tokens) or PATH/tokenizer.json")
    prep.add_argument("--out", default=None, help="output directory (default ./data/stdlib-bytes)")
    prep.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                      help=f"stop after this many tokens, 0 = all (default {DEFAULT_MAX_BYTES}); a BPE "
                           f"trains on this many bytes of text")
    prep.add_argument("--row-len", type=int, default=DEFAULT_ROW_LEN, help="tokens per Parquet row")
    prep.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                      help=f"rows held out for the validation loss: every round(1/F)-th row, the first "
                           f"included (default {DEFAULT_VAL_FRACTION}; 0: no validation split)")
    info = sub.add_parser("info", help="print the manifest of a prepared directory")
    info.add_argument("--data-dir", default=None, help="prepared directory (default ./data/stdlib-bytes)")


def run(args: argparse.Namespace) -> int:
    if args.action == "info":
        path = Path(args.data_dir or default_data_dir()) / MANIFEST
        if not path.exists():
            print(f"no prepared data at {path.parent}: run `{invocation()} data prepare`")
            return 1
        print(path.read_text(), end="")
        return 0
    if args.out is None and TokenizerSpec.parse(args.tokenizer).kind != "bytes":
        raise ValueError(f"--tokenizer {args.tokenizer} needs --out DIR: the default directory "
                         f"{default_data_dir()} holds the byte-level data `{invocation()} train` uses by default")
    out = Path(args.out).resolve() if args.out else default_data_dir()
    start = time.perf_counter()
    manifest = prepare_dataset(out, args.source, max_bytes=args.max_bytes or None, row_len=args.row_len,
                               tokenizer=args.tokenizer, progress=lambda line: print(line, file=sys.stderr),
                               val_fraction=args.val_fraction)
    print(f"prepared {manifest.num_tokens:,} tokens ({manifest.num_rows} rows x {manifest.row_len}) "
          f"in {len(manifest.shards)} shard(s) at {out} in {time.perf_counter() - start:.1f} s")
    print(f"validation: {manifest.val_rows * manifest.row_len:,} tokens ({manifest.val_rows} rows, "
          f"--val-fraction {args.val_fraction:g}) in {out / str(manifest.val_token_file)}" if manifest.has_validation
          else "validation: none (--val-fraction 0, or too few rows): training reports no validation loss")
    print(f"tokenizer: {manifest.tokenizer}, vocabulary {manifest.vocab_size:,}"
          + (f" ({out / manifest.tokenizer_file})" if manifest.tokenizer_file else ""))
    print(f"source: {manifest.source}")
    skipped, examples = skipped_binary_files(out)
    if skipped:
        print(f"skipped {skipped} binary file(s), not text (e.g. {', '.join(Path(e).name for e in examples[:3])})")
    empty, by_file = skipped_empty_texts(out)
    if empty:
        print(f"skipped {empty} null or empty text(s) (" + ", ".join(f"{Path(path).name}: {count}" for path, count
                                                                    in list(by_file.items())[:3]) + ")")
    spec = TokenizerSpec.parse(args.tokenizer)
    model = Path(spec.path).parent if spec.path else None
    start_from = f" --init-from {model}" if model is not None and (model / "config.json").is_file() else ""
    print(f"train on it with: {invocation()} train{start_from} --data-dir {out}")  # a checkpoint's tokenizer: from it
    return 0
