"""Training data: real text tokenized once into Parquet shards, read back split by rank.

    mpipemoe data prepare                       # default: this Python's stdlib sources
    mpipemoe data prepare --source ~/books --out data/books
    mpipemoe data info [--data-dir DIR]

The default text is the standard library of the Python running this command
(``sysconfig.get_paths()["stdlib"]``, ``*.py`` files, sorted by path, test suites and
site-packages left out, first ``--max-bytes`` bytes): real text nobody on this project
wrote, present on every machine, prepared in about a second.

Tokenizer: bytes (ids 0-255) plus EOS (256, between documents), MASK (257, masked LM)
and PAD (258); vocabulary 259. Nothing to train or download.

Layout of a prepared directory: ``manifest.json`` and ``shard-00000.parquet`` ... with
one column ``tokens`` (list<uint16>), each row ``row_len`` tokens of the concatenated
token stream. Rank r of W reads rows r, r+W, r+2W, ... (only the first
``W * (rows // W)`` rows, so every rank has the same amount): disjoint and deterministic.
``BatchSampler`` cuts that rank stream into windows and picks batch ``i`` as a pure
function of (seed, rank, i), so the data position in a checkpoint is just ``i``.
"""
from __future__ import annotations

import argparse
import json
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.errors import os_error
from app.records import invocation

BYTE_VOCAB = 256
EOS_ID = 256
MASK_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259
TOKENIZER = "bytes-v1"
MANIFEST = "manifest.json"
DEFAULT_MAX_BYTES = 8 * 2**20   # 8 MiB of stdlib sources: ~8M tokens, prepared in ~1 s
DEFAULT_ROW_LEN = 8192          # tokens per Parquet row
DEFAULT_ROWS_PER_SHARD = 256    # rows per Parquet file (~2M tokens)
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def default_data_dir() -> Path:
    """``./data/stdlib-bytes`` under the working directory, absolute."""
    return (Path.cwd() / "data" / "stdlib-bytes").resolve()


def encode(text: str | bytes) -> np.ndarray:
    """Byte-level token ids (uint16) of ``text``."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def decode(ids) -> str:
    """Text of byte ids; specials become ``<eos>``, ``<mask>``, ``<pad>``."""
    names = {EOS_ID: "<eos>", MASK_ID: "<mask>", PAD_ID: "<pad>"}
    out, run = [], bytearray()
    for i in np.asarray(ids).tolist():
        if i < BYTE_VOCAB:
            run.append(i)
        else:
            out.append(run.decode("utf-8", "replace"))
            run = bytearray()
            out.append(names.get(i, f"<{i}>"))
    out.append(run.decode("utf-8", "replace"))
    return "".join(out)


def stdlib_source_files() -> list[Path]:
    """This Python's stdlib ``*.py`` files, sorted, without test suites or site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(files)


def _text_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise FileNotFoundError(f"--source {source} does not exist: give a text/Parquet file or a directory")
    return sorted(p for p in source.rglob("*") if p.is_file() and not p.name.startswith("."))


BINARY_PROBE_BYTES = 8000  # like git and grep: a NUL byte in the first 8000 bytes means binary


def is_binary(data: bytes) -> bool:
    """Whether a file's bytes are binary (images, archives, compiled code), not text."""
    return b"\0" in data[:BINARY_PROBE_BYTES]


def _documents(sources: list[Path], skipped: list[Path] | None = None):
    """Yield token arrays, one per document: a text file, or a Parquet row. Binary files
    are not text: they are left out and appended to ``skipped``."""
    import pyarrow.parquet as pq

    for path in sources:
        if path.suffix == ".parquet":
            table = pq.read_table(path)
            if "tokens" in table.column_names:
                for row in table.column("tokens").to_pylist():
                    ids = np.asarray(row, dtype=np.int64)
                    if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
                        raise ValueError(f"{path}: token ids must lie in [0, {VOCAB_SIZE}); "
                                         f"found {ids.min()}..{ids.max()}")
                    yield ids.astype(np.uint16)
            elif "text" in table.column_names:
                for text in table.column("text").to_pylist():
                    yield encode(text or "")
            else:
                raise ValueError(f"{path}: a Parquet source needs a 'text' or a 'tokens' column; "
                                 f"it has {table.column_names}")
        else:
            data = path.read_bytes()
            if is_binary(data):
                if skipped is not None:
                    skipped.append(path)
                continue
            yield encode(data)


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` records about a prepared directory."""

    tokenizer: str
    vocab_size: int
    row_len: int
    num_rows: int
    num_tokens: int
    shards: list
    source: str

    @classmethod
    def load(cls, data_dir: str | Path) -> "Manifest":
        """The manifest of ``data_dir``; a missing, unreadable or damaged one raises naming the fix."""
        path = Path(data_dir) / MANIFEST
        if not path.exists():
            raise FileNotFoundError(
                f"no prepared data at {data_dir} ({MANIFEST} missing): run "
                f"`{invocation()} data prepare --out {data_dir}` (on every node, or use shared storage)")
        try:
            fields = json.loads(path.read_text())
            return cls(**{k: fields[k] for k in cls.__dataclass_fields__})
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"cannot read the prepared data's {path} ({type(error).__name__}: {error}): "
                             f"check its permissions, or prepare it again with "
                             f"`{invocation()} data prepare --out {data_dir}`") from error

    def check_fits(self, data_dir: str | Path, world_size: int, batch_size: int, window: int) -> None:
        """Raise ValueError naming the fix unless every shard is readable and each of
        ``world_size`` ranks gets at least ``batch_size`` windows of ``window`` tokens."""
        import pyarrow.parquet as pq

        for shard in self.shards:
            path = Path(data_dir) / shard["file"]
            try:
                rows = pq.read_metadata(path).num_rows
            except (OSError, ValueError) as error:  # missing, unreadable, not Parquet
                raise ValueError(f"cannot read data shard {path} ({type(error).__name__}: {error}): "
                                 f"prepare the data again with `{invocation()} data prepare --out {data_dir}`") from error
            if rows != shard["rows"]:
                raise ValueError(f"data shard {path} holds {rows} rows, its manifest says {shard['rows']}: "
                                 f"prepare the data again with `{invocation()} data prepare --out {data_dir}`")
            read_shard(path, data_dir)  # every page: a damaged one fails here, not in a worker
        windows = self.num_rows // world_size * self.row_len // window
        if windows < batch_size:
            raise ValueError(
                f"{data_dir} holds {self.num_rows} rows of {self.row_len} tokens: {windows} windows of "
                f"{window} tokens per worker ({world_size} workers), fewer than batch_size={batch_size}: "
                f"prepare more data (--max-bytes), or lower --batch-size, --seq-len or --num-workers")


def read_shard(path: Path, data_dir: str | Path):
    """The ``tokens`` column of shard ``path``, every page decoded; a damaged shard raises
    ValueError naming it and the fix (pyarrow's own error names neither)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path, columns=["tokens"])
    except (OSError, ValueError, pa.ArrowException) as error:
        why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"data shard {path} is damaged ({why}): prepare the data again with "
                         f"`{invocation()} data prepare --out {data_dir}`") from None


def prepare_dataset(out_dir: str | Path, sources: list[str | Path] | None = None,
                    max_bytes: int | None = DEFAULT_MAX_BYTES, row_len: int = DEFAULT_ROW_LEN,
                    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD) -> Manifest:
    """Tokenize ``sources`` (default: stdlib sources) into Parquet shards under ``out_dir``.

    Documents are joined with EOS; the stream stops after ``max_bytes`` tokens (None: all).
    Writes the shards first and the manifest last, so a directory with a manifest is complete.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir).resolve()
    if sources:
        paths = [p for s in sources for p in _text_files(Path(s).expanduser().resolve())]
        source_desc = ", ".join(str(s) for s in sources)
    else:
        paths = stdlib_source_files()
        source_desc = f"python stdlib sources at {sysconfig.get_paths()['stdlib']}"
    if not paths:
        raise ValueError(f"no input files found in {source_desc}")

    pieces, total, skipped = [], 0, []
    for ids in _documents(paths, skipped):
        pieces.append(ids)
        pieces.append(np.array([EOS_ID], dtype=np.uint16))
        total += ids.size + 1
        if max_bytes is not None and total >= max_bytes:
            break
    if not pieces:
        raise ValueError(f"no text in {source_desc}: all {len(skipped)} file(s) are binary "
                         f"(e.g. {skipped[0].name}); give text files, or Parquet with a 'text' column")
    stream = np.concatenate(pieces)[:max_bytes] if max_bytes else np.concatenate(pieces)
    num_rows = stream.size // row_len
    if num_rows == 0:
        raise ValueError(f"{source_desc} gives {stream.size} tokens, fewer than one row of "
                         f"{row_len}; add text or lower --row-len")
    rows = stream[: num_rows * row_len].reshape(num_rows, row_len)

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)
    shards, path = [], out_dir / MANIFEST
    try:
        for index, start in enumerate(range(0, num_rows, rows_per_shard)):
            chunk = rows[start:start + rows_per_shard]
            name = f"shard-{index:05d}.parquet"
            path = out_dir / name
            offsets = pa.array(np.arange(0, chunk.size + 1, row_len, dtype=np.int32))
            column = pa.ListArray.from_arrays(offsets, pa.array(chunk.reshape(-1), type=pa.uint16()))
            pq.write_table(pa.table({"tokens": column}), path)
            shards.append({"file": name, "rows": int(chunk.shape[0])})
        manifest = Manifest(tokenizer=TOKENIZER, vocab_size=VOCAB_SIZE, row_len=row_len,
                            num_rows=num_rows, num_tokens=num_rows * row_len, shards=shards,
                            source=source_desc)
        payload = dict(manifest.__dict__, eos_id=EOS_ID, mask_id=MASK_ID, pad_id=PAD_ID,
                       num_files=len(paths) - len(skipped), skipped_binary_files=len(skipped),
                       skipped_examples=[str(p) for p in skipped[:5]])
        path = out_dir / MANIFEST
        path.write_text(json.dumps(payload, indent=1) + "\n")
    except OSError as error:  # a full disk, a quota: keep nothing half-written
        for name in [f"shard-{i:05d}.parquet" for i in range(len(shards) + 1)] + [MANIFEST]:
            (out_dir / name).unlink(missing_ok=True)
        raise os_error(error, f"cannot write {path}", "free space there or choose another --out; "
                                                      "no partial data was kept") from error
    return manifest


def skipped_binary_files(data_dir: str | Path) -> tuple[int, list[str]]:
    """(count, a few paths) of the binary files ``prepare_dataset`` left out of ``data_dir``."""
    payload = json.loads((Path(data_dir) / MANIFEST).read_text())
    return payload.get("skipped_binary_files", 0), payload.get("skipped_examples", [])


def ensure_default_data(data_dir: str | Path | None = None, echo=print) -> Path:
    """Prepare the default dataset at ``data_dir`` (default ``./data/stdlib-bytes``) if missing."""
    data_dir = Path(data_dir).resolve() if data_dir else default_data_dir()
    if not (data_dir / MANIFEST).exists():
        echo(f"[mpipemoe] no training data at {data_dir}: preparing it from this Python's "
             f"standard library sources (runs once)...")
        start = time.perf_counter()
        manifest = prepare_dataset(data_dir)
        echo(f"[mpipemoe] prepared {manifest.num_tokens:,} tokens in {len(manifest.shards)} "
             f"Parquet shard(s) in {time.perf_counter() - start:.1f} s")
    return data_dir


def load_rank_tokens(data_dir: str | Path, rank: int, world_size: int) -> np.ndarray:
    """This rank's token stream: rows rank, rank+W, ... of the first W*(rows//W) rows."""
    import pyarrow.parquet as pq

    manifest = Manifest.load(data_dir)
    rows_per_rank = manifest.num_rows // world_size
    if rows_per_rank == 0:
        raise ValueError(f"{data_dir} holds {manifest.num_rows} rows of {manifest.row_len} tokens, "
                         f"fewer than the {world_size} workers: prepare more data or use fewer workers")
    wanted = set(range(rank, rows_per_rank * world_size, world_size))
    parts, first_row = [], 0
    for shard in manifest.shards:
        local = [r - first_row for r in range(first_row, first_row + shard["rows"]) if r in wanted]
        first_row += shard["rows"]
        if not local:
            continue
        column = read_shard(Path(data_dir) / shard["file"], data_dir).column("tokens")
        values = column.combine_chunks().flatten().to_numpy()
        parts.append(values.reshape(-1, manifest.row_len)[local])
    tokens = np.concatenate(parts).reshape(-1)
    if tokens.size and tokens.max() >= manifest.vocab_size:
        raise ValueError(f"{data_dir}: rank {rank}'s rows hold token id {tokens.max()}, outside the "
                         f"vocabulary of {manifest.vocab_size} its manifest declares: prepare the data again "
                         f"with `{invocation()} data prepare --out {data_dir}`")
    return tokens


class BatchSampler:
    """Batches of token windows from one rank's stream, addressable by batch index.

    Windows are the non-overlapping ``window``-token slices of the stream; each epoch
    visits them in a permutation seeded by (seed, rank, epoch). ``batch(i)`` depends
    only on i, so resuming at data position i reproduces the exact sequence.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, window: int, seed: int, rank: int = 0):
        self.windows = len(tokens) // window
        if self.windows < batch_size:
            raise ValueError(
                f"rank {rank}'s data shard has {self.windows} windows of {window} tokens, fewer than "
                f"batch_size={batch_size}: prepare more data (--max-bytes) or lower --batch-size/--seq-len")
        self.tokens_NW = tokens[: self.windows * window].reshape(self.windows, window)
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self._epoch, self._order = -1, None

    def epoch_of(self, index: int) -> int:
        return index * self.batch_size // self.windows

    def batch(self, index: int) -> np.ndarray:
        """Batch ``index`` (0-based) as an int64 array (batch_size, window)."""
        rows = []
        for sample in range(index * self.batch_size, (index + 1) * self.batch_size):
            epoch, offset = divmod(sample, self.windows)
            if epoch != self._epoch:
                rng = np.random.default_rng([self.seed, self.rank, epoch])
                self._epoch, self._order = epoch, rng.permutation(self.windows)
            rows.append(self._order[offset])
        return self.tokens_NW[rows].astype(np.int64)


# ---- command line -------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    prep = sub.add_parser("prepare", help="tokenize text into Parquet shards")
    prep.add_argument("--source", nargs="+", default=None,
                      help="text files, directories or Parquet files ('text' or 'tokens' column); "
                           "default: this Python's stdlib sources")
    prep.add_argument("--out", default=None, help="output directory (default ./data/stdlib-bytes)")
    prep.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                      help=f"stop after this many tokens, 0 = all (default {DEFAULT_MAX_BYTES})")
    prep.add_argument("--row-len", type=int, default=DEFAULT_ROW_LEN, help="tokens per Parquet row")
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
    out = Path(args.out).resolve() if args.out else default_data_dir()
    start = time.perf_counter()
    manifest = prepare_dataset(out, args.source, max_bytes=args.max_bytes or None, row_len=args.row_len)
    print(f"prepared {manifest.num_tokens:,} tokens ({manifest.num_rows} rows x {manifest.row_len}) "
          f"in {len(manifest.shards)} shard(s) at {out} in {time.perf_counter() - start:.1f} s")
    print(f"source: {manifest.source}")
    skipped, examples = skipped_binary_files(out)
    if skipped:
        print(f"skipped {skipped} binary file(s), not text (e.g. {', '.join(Path(e).name for e in examples[:3])})")
    return 0
