"""Training data: real text tokenized once into Parquet shards, read back split by rank.
The command that prepares it, ``mpipemoe data prepare``, is app/commands/data.py.

The default text is the standard library of the Python running this command
(``sysconfig.get_paths()["stdlib"]``, ``*.py`` files, sorted by path, test suites and
site-packages left out, first ``--max-bytes`` bytes): real text nobody on this project
wrote, present on every machine, prepared in about a second.

Sources (``--source``, any mix): text files and directories of them, Parquet files or
JSONL files with a ``text`` column (Parquet may instead hold pre-tokenized ``tokens``), and
local Hugging Face ``datasets`` directories (``save_to_disk``; needs ``datasets``).

Tokenizer (``--tokenizer``, see lm/tokenizer.py): ``bytes`` (default: ids 0-255 plus EOS
256 between documents, MASK 257, PAD 258; vocabulary 259, nothing to train), ``bpe[:VOCAB]``
(a byte-level BPE trained on the corpus) or a ``tokenizer.json``. Its vocabulary size goes
into the manifest and sets the model's.

Preparation streams: sources are read in chunks (text files 1 MiB at a time, Parquet by
record batch, JSONL by line) and written out a shard at a time, so memory stays bounded
by a shard (``rows_per_shard * row_len`` tokens), whatever the corpus size. A BPE is
trained in a first pass over the same stream (the trainer keeps word counts, not text).

Layout of a prepared directory: ``manifest.json``; ``tokens.bin``, the whole token stream
as one flat little-endian array (uint16, uint32 above 65,536 tokens) that workers
memory-map; ``shard-00000.parquet`` ... holding the same tokens as Parquet rows (one column
``tokens``, each row ``row_len`` tokens: the portable copy, readable by any Parquet tool
and usable again as a ``--source``); ``tokenizer.json`` for a BPE. Rank r of W reads rows
r, r+W, r+2W, ... (only the first ``W * (rows // W)`` rows, so every rank has the same
amount): disjoint and deterministic. ``open_rank_stream`` maps those rows without reading
them; ``BatchSampler`` cuts the rank stream into windows and picks batch ``i`` as a pure
function of (seed, rank, i), reading only that batch's windows, so a worker's memory does
not grow with the corpus and the data position in a checkpoint is just ``i``.

Why memory-mapped arrays rather than Ray Data streaming: batches are addressed by
position (exact resume is "read batch i", with a fresh permutation per epoch), which a
random-access array gives for free; the OS page cache shares and evicts the pages; and the
workers need no extra Ray processes or object-store traffic on the training path.

pyarrow is imported inside the functions that read or write Parquet: workers read
``tokens.bin`` only, and importing pyarrow would add about 34 MiB to each worker's memory.
Hugging Face ``datasets`` is optional and imported only for a ``datasets`` source.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sysconfig
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lm.errors import invocation, os_error
from lm.tokenizer import TOKENIZER_FILE, ByteTokenizer, HFTokenizer, TokenizerSpec, token_dtype

BYTE_VOCAB = 256
EOS_ID = 256
MASK_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259
TOKENIZER = "bytes-v1"
MANIFEST = "manifest.json"
TOKEN_FILE = "tokens.bin"
VAL_TOKEN_FILE = "val.bin"      # the held-out rows, like tokens.bin
VAL_SHARD = "val.parquet"       # ... and as Parquet rows
DEFAULT_VAL_FRACTION = 0.01     # `data prepare`: 1 row in 100 held out (80k tokens of the default data)
READ_CHUNK = 2**20              # bytes of a text file read (and tokenized) at a time
DEFAULT_MAX_BYTES = 8 * 2**20   # 8 MiB of stdlib sources: ~8M tokens, prepared in ~1 s
DEFAULT_ROW_LEN = 8192          # tokens per Parquet row
DEFAULT_ROWS_PER_SHARD = 256    # rows per Parquet file (~2M tokens)
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def default_data_dir() -> Path:
    """``./data/stdlib-bytes`` under the working directory, absolute."""
    return (Path.cwd() / "data" / "stdlib-bytes").resolve()


def encode(text: str | bytes) -> np.ndarray:
    """Byte-level token ids (uint16) of ``text``."""
    return ByteTokenizer().encode(text)


def decode(ids) -> str:
    """Text of byte ids; specials become ``<eos>``, ``<mask>``, ``<pad>``."""
    return ByteTokenizer().decode(ids)


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


def _is_hf_dataset(path: Path) -> bool:
    """A directory written by Hugging Face ``datasets`` (``Dataset(Dict).save_to_disk``)."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file()
                              or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()))


def _expand_source(source: Path) -> list[Path]:
    """The input files of one ``--source``: a Hugging Face dataset directory stays whole."""
    return [source] if _is_hf_dataset(source) else _text_files(source)


def _hf_texts(path: Path, batch_size: int = 256):
    """The ``text`` column of a local Hugging Face dataset (every split, sorted), batch by batch."""
    try:
        import datasets
    except ImportError as error:
        raise ValueError(f"--source {path} is a Hugging Face datasets directory, and reading it needs "
                         f"`datasets`: pip install datasets, or export it to Parquet/JSONL first "
                         f"(dataset.to_parquet('data.parquet'))") from error
    loaded = datasets.load_from_disk(str(path))
    parts = [loaded[name] for name in sorted(loaded)] if isinstance(loaded, datasets.DatasetDict) else [loaded]
    for part in parts:
        if "text" not in part.column_names:
            raise ValueError(f"--source {path}: a Hugging Face dataset needs a 'text' column; it has "
                             f"{part.column_names}")
        for batch in part.iter(batch_size=batch_size):
            yield from batch["text"]


def _jsonl_texts(path: Path):
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                yield record["text"]
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: each JSONL line needs a JSON object with a 'text' "
                                 f"field ({type(error).__name__}: {error}); fix or remove that line") from error


def _text_chunks(path: Path):
    """A text file READ_CHUNK bytes at a time, cut after a newline where there is one (so a
    BPE sees whole words and whole UTF-8 characters)."""
    carry = b""
    with path.open("rb") as handle:
        while True:
            block = handle.read(READ_CHUNK)
            if not block:
                break
            block = carry + block
            cut = block.rfind(b"\n") + 1 or len(block)
            carry = block[cut:]
            yield block[:cut]
    if carry:
        yield carry


def _pieces(sources: list[Path], vocab_size: int, skipped: list[Path] | None = None,
            empty: dict[str, int] | None = None):
    """Yield ``(piece, end_of_document)`` in corpus order. A piece is text (str or bytes) or,
    from a Parquet ``tokens`` column, an array of token ids. Memory: one piece at a time.
    Binary files are not text: they are left out and appended to ``skipped``. Null or empty
    texts (a Parquet/JSONL/dataset row, a 0-byte file) make no document: they are left out
    and counted in ``empty`` (path -> count), so that the caller can say so."""
    import pyarrow.parquet as pq

    def texts(path, values):
        for text in values:
            if text:
                yield text, True
            elif empty is not None:
                empty[str(path)] = empty.get(str(path), 0) + 1

    for path in sources:
        if path.is_dir():  # a Hugging Face dataset (see _expand_source)
            yield from texts(path, _hf_texts(path))
        elif path.suffix == ".parquet":
            parquet = pq.ParquetFile(path)
            names = parquet.schema_arrow.names
            column = "tokens" if "tokens" in names else "text" if "text" in names else None
            if column is None:
                raise ValueError(f"{path}: a Parquet source needs a 'text' or a 'tokens' column; "
                                 f"it has {names}")
            for batch in parquet.iter_batches(batch_size=256, columns=[column]):
                if column == "text":
                    yield from texts(path, batch.column(0).to_pylist())
                    continue
                for row in batch.column(0).to_pylist():
                    ids = np.asarray(row, dtype=np.int64)
                    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                        raise ValueError(f"{path}: token ids must lie in [0, {vocab_size}); "
                                         f"found {ids.min()}..{ids.max()}")
                    yield ids, True
        elif path.suffix == ".jsonl":
            yield from texts(path, _jsonl_texts(path))
        else:
            chunks = _text_chunks(path)
            previous = next(chunks, b"")
            if is_binary(previous):
                if skipped is not None:
                    skipped.append(path)
                continue
            if not previous:  # a 0-byte file
                yield from texts(path, [previous])
                continue
            for chunk in chunks:
                yield previous, False
                previous = chunk
            yield previous, True


def _left_out(skipped: list[Path], empty: dict[str, int]) -> str:
    """What ``_pieces`` left out, as a phrase: binary files, null or empty texts."""
    parts = []
    if skipped:
        parts.append(f"{len(skipped)} binary file(s) (e.g. {skipped[0].name})")
    if empty:
        examples = ", ".join(f"{Path(path).name}: {count}" for path, count in list(empty.items())[:3])
        parts.append(f"{sum(empty.values())} null or empty text(s) (0-byte files, null 'text' values; {examples})")
    return " and ".join(parts)


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
    token_file: str | None = None      # tokens.bin (None: prepared before it existed; Parquet is read)
    token_dtype: str = "uint16"
    tokenizer_file: str | None = None  # tokenizer.json of a BPE/loaded tokenizer; None: bytes
    eos_id: int = EOS_ID
    mask_id: int = MASK_ID
    pad_id: int = PAD_ID
    val_fraction: float = 0.0          # asked for; 0: no validation split (or prepared before it existed)
    val_rows: int = 0                  # held-out rows of row_len tokens in val_token_file
    val_token_file: str | None = None  # val.bin (None: no validation split)
    tokens_crc32: str | None = None    # CRC-32 of tokens.bin (None: prepared before it was recorded)

    @property
    def has_validation(self) -> bool:
        return bool(self.val_token_file) and self.val_rows > 0

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
            return cls(**{k: fields[k] for k in cls.__dataclass_fields__
                          if k in fields or cls.__dataclass_fields__[k].default is dataclasses.MISSING})
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
        if self.token_file:
            path = Path(data_dir) / self.token_file
            expected = self.num_tokens * np.dtype(self.token_dtype).itemsize
            size = path.stat().st_size if path.is_file() else None
            if size != expected:
                raise ValueError(f"data file {path} is {'missing' if size is None else f'{size} bytes'}, its "
                                 f"manifest says {expected} bytes: prepare the data again with "
                                 f"`{invocation()} data prepare --out {data_dir}`")
        if self.has_validation:
            path = Path(data_dir) / self.val_token_file
            expected = self.val_rows * self.row_len * np.dtype(self.token_dtype).itemsize
            size = path.stat().st_size if path.is_file() else None
            if size != expected:
                raise ValueError(f"validation file {path} is {'missing' if size is None else f'{size} bytes'}, "
                                 f"its manifest says {expected} bytes: prepare the data again with "
                                 f"`{invocation()} data prepare --out {data_dir}`")
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


class _Progress:
    """Progress lines for ``prepare_dataset``, at most one per ``every_s`` seconds."""

    def __init__(self, echo, total_bytes: int, every_s: float = 2.0):
        self.echo, self.total_bytes, self.every_s = echo, total_bytes, every_s
        self.started = self.last = time.perf_counter()
        self.read_bytes = 0

    def update(self, what: str, read: int, tokens: int | None = None, force: bool = False) -> None:
        self.read_bytes += read
        now = time.perf_counter()
        if self.echo is None or not (force or now - self.last >= self.every_s):
            return
        self.last = now
        of = f" of {self.total_bytes / 2**20:,.1f}" if self.total_bytes else ""
        done = f", {tokens:,} tokens" if tokens is not None else ""
        self.echo(f"[data] {what}: {self.read_bytes / 2**20:,.1f}{of} MiB read{done}, "
                  f"{now - self.started:.0f} s")


def _source_bytes(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def _training_texts(paths: list[Path], vocab_size: int, max_bytes: int | None, meter: _Progress):
    """The corpus's text (no pre-tokenized rows), up to ``max_bytes`` bytes, for BPE training."""
    seen = 0
    for piece, _ in _pieces(paths, vocab_size):
        if isinstance(piece, np.ndarray):
            continue
        meter.update("training the BPE", len(piece))
        seen += len(piece)
        yield piece.decode("utf-8", "replace") if isinstance(piece, bytes) else piece
        if max_bytes is not None and seen >= max_bytes:
            return


def _encoded(pieces, tokenizer, meter: _Progress, batch_bytes: int = READ_CHUNK):
    """``(ids, end_of_document)`` for each piece, text encoded in batches (the BPE encodes a
    batch on all cores)."""
    batch, size = [], 0

    def encode_batch():
        texts = [piece for piece, _ in batch]
        for ids, (_, end) in zip(tokenizer.encode_batch(texts), batch):
            yield ids, end

    for piece, end in pieces:
        if isinstance(piece, np.ndarray):
            yield from encode_batch()
            batch, size = [], 0
            yield piece, end
            continue
        batch.append((piece, end))
        size += len(piece)
        meter.read_bytes += len(piece)
        if size >= batch_bytes or len(batch) >= 1024:
            yield from encode_batch()
            batch, size = [], 0
    yield from encode_batch()


def make_tokenizer(spec: TokenizerSpec, paths: list[Path], max_bytes: int | None, meter: _Progress):
    """The tokenizer ``spec`` asks for: fixed bytes, a loaded file, or a BPE trained on ``paths``."""
    if spec.kind == "bytes":
        return ByteTokenizer()
    if spec.kind == "file":
        return HFTokenizer.load(spec.path)
    # ids of pre-tokenized rows are not checked here: training skips them
    tokenizer = HFTokenizer.train_bpe(_training_texts(paths, 2**32, max_bytes, meter), spec.vocab_size)
    meter.read_bytes = 0
    return tokenizer


def prepare_dataset(out_dir: str | Path, sources: list[str | Path] | None = None,
                    max_bytes: int | None = DEFAULT_MAX_BYTES, row_len: int = DEFAULT_ROW_LEN,
                    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD, tokenizer: str = "bytes",
                    progress=None, val_fraction: float = 0.0) -> Manifest:
    """Tokenize ``sources`` (default: stdlib sources) into ``tokens.bin`` and Parquet shards.

    ``tokenizer``: "bytes", "bpe[:VOCAB]" or a tokenizer.json path (see lm/tokenizer.py).
    Documents are joined with EOS; the stream stops after ``max_bytes`` tokens (None: all).
    ``val_fraction`` in [0, 0.5]: rows 0, k, 2k, ... (k = round(1 / val_fraction)) go to the
    validation split (``val.bin``, ``val.parquet``) instead; 0: none.
    Streams: holds at most one shard of tokens (plus one read chunk) in memory.
    ``progress``: called with a line of text every few seconds (None: silent).
    Writes into a new hidden sibling folder of ``out_dir`` (data first, the manifest last) and
    swaps it in only when it is whole: a failure (no text, a full disk, Ctrl-C) leaves the data
    already at ``out_dir`` as it was, and creates no ``out_dir`` that did not exist.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) \
            or not 0 <= val_fraction <= 0.5:
        raise ValueError(f"--val-fraction {val_fraction!r} is invalid: give a number in [0, 0.5], e.g. "
                         f"{DEFAULT_VAL_FRACTION} (0: no validation split)")
    val_every = round(1 / val_fraction) if val_fraction else 0  # row i is held out when i % val_every == 0
    out_dir = Path(out_dir).resolve()
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file, not a folder: give a folder (new, or prepared before)")
    spec = TokenizerSpec.parse(tokenizer)
    if sources:
        paths = [p for s in sources for p in _expand_source(Path(s).expanduser().resolve())]
        source_desc = ", ".join(str(s) for s in sources)
    else:
        paths = stdlib_source_files()
        source_desc = f"python stdlib sources at {sysconfig.get_paths()['stdlib']}"
    if not paths:
        raise ValueError(f"no input files found in {source_desc}")
    meter = _Progress(progress, _source_bytes(paths))

    # 1. the tokenizer (a BPE reads the corpus once to train)
    tok = make_tokenizer(spec, paths, max_bytes, meter)
    dtype = token_dtype(tok.vocab_size)
    arrow_type = pa.uint16() if dtype == np.uint16 else pa.uint32()

    # 2. a new sibling folder: the data already at ``out_dir`` stays as it is until this one is whole
    created = _missing_parents(out_dir)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        stage = _new_sibling(out_dir, "preparing")
    except OSError as error:
        _remove_empty(created)
        raise os_error(error, f"cannot create {out_dir}", "choose another --out (a folder you can write)") from error

    # 3. tokenize and write a shard at a time: Parquet rows + the flat memory-mappable array
    shard_tokens = rows_per_shard * row_len
    limit = max_bytes if max_bytes else None
    eos = np.array([tok.eos_id], dtype=dtype)
    pending, buffered, written, documents, skipped, empty = [], 0, 0, 0, [], {}
    shards: list[dict[str, Any]] = []
    val_rows, val_writer, crc = 0, None, 0
    path = stage / TOKEN_FILE  # the file being written, for the error message

    def table_of(rows_RL: np.ndarray):
        offsets = pa.array(np.arange(0, rows_RL.size + 1, row_len, dtype=np.int32))
        return pa.table({"tokens": pa.ListArray.from_arrays(offsets, pa.array(rows_RL.reshape(-1), type=arrow_type))})

    def write(count: int) -> None:
        """``count`` tokens (whole rows) out: training rows to a shard and tokens.bin,
        held-out rows to val.bin and val.parquet."""
        nonlocal pending, buffered, written, path, val_rows, val_writer, crc
        flat = np.concatenate(pending) if len(pending) > 1 else pending[0]
        chunk, rest = flat[:count], flat[count:]
        pending, buffered = ([rest] if rest.size else []), rest.size
        rows_RL = chunk.astype(dtype, copy=False).reshape(-1, row_len)
        first = written // row_len  # index of this chunk's first row in the whole stream
        held_R = (np.arange(first, first + len(rows_RL)) % val_every == 0) if val_every \
            else np.zeros(len(rows_RL), dtype=bool)
        train_RL, val_RL = rows_RL[~held_R], rows_RL[held_R]
        written += count
        if len(val_RL):
            path = stage / VAL_SHARD
            if val_writer is None:
                val_writer = pq.ParquetWriter(path, table_of(val_RL).schema)
            val_writer.write_table(table_of(val_RL))
            path = stage / VAL_TOKEN_FILE
            val_out.write(val_RL.tobytes())
            val_out.flush()
            val_rows += len(val_RL)
        if not len(train_RL):
            return
        name = f"shard-{len(shards):05d}.parquet"
        path = stage / name
        pq.write_table(table_of(train_RL), path)
        path = stage / TOKEN_FILE
        raw = train_RL.tobytes()
        token_out.write(raw)
        crc = zlib.crc32(raw, crc)
        token_out.flush()
        shards.append({"file": name, "rows": len(train_RL)})

    try:
        with (stage / TOKEN_FILE).open("wb") as token_out, \
                (stage / VAL_TOKEN_FILE).open("wb") as val_out:
            for ids, end in _encoded(_pieces(paths, tok.vocab_size, skipped, empty), tok, meter):
                pending.append(ids.astype(dtype, copy=False))
                buffered += ids.size
                if end:
                    documents += 1
                    pending.append(eos)
                    buffered += 1
                while buffered >= shard_tokens and (limit is None or written + shard_tokens <= limit):
                    write(shard_tokens)
                meter.update("tokenizing", 0, written + buffered)
                if limit is not None and written + buffered >= limit:
                    break
            if documents == 0 and skipped and not empty:
                raise ValueError(f"no text in {source_desc}: all {len(skipped)} file(s) are binary "
                                 f"(e.g. {skipped[0].name}); give text files, or Parquet with a 'text' column")
            if documents == 0:
                raise ValueError(f"no text in {source_desc}: it holds only {_left_out(skipped, empty)}; give "
                                 f"files with text, or Parquet/JSONL whose 'text' column has values")
            total = written + buffered
            left = buffered if limit is None else min(buffered, limit - written)
            if left >= row_len:
                write(left // row_len * row_len)
            if val_writer is not None:
                val_writer.close()
        num_rows = sum(int(shard["rows"]) for shard in shards)
        if num_rows == 0:
            raise ValueError(f"{source_desc} gives {total} tokens, "
                             + (f"fewer than one row of {row_len}; add text or lower --row-len" if not val_rows else
                                f"{val_rows} row(s) of {row_len}, all held out for validation: add text, or "
                                f"lower --row-len or --val-fraction"))
        if not val_rows:
            (stage / VAL_TOKEN_FILE).unlink(missing_ok=True)
        path = stage / TOKENIZER_FILE
        tokenizer_file = tok.save(stage)
        meter.update("done", 0, written, force=True)
        manifest = Manifest(tokenizer=tok.name, vocab_size=tok.vocab_size, row_len=row_len,
                            num_rows=num_rows, num_tokens=num_rows * row_len, shards=shards, source=source_desc,
                            token_file=TOKEN_FILE, token_dtype=np.dtype(dtype).name,
                            tokenizer_file=tokenizer_file, eos_id=tok.eos_id, mask_id=tok.mask_id,
                            pad_id=tok.pad_id, val_fraction=float(val_fraction), val_rows=val_rows,
                            val_token_file=VAL_TOKEN_FILE if val_rows else None, tokens_crc32=f"{crc:08x}")
        payload = dict(dataclasses.asdict(manifest), num_files=len(paths) - len(skipped),
                       skipped_binary_files=len(skipped), skipped_examples=[str(p) for p in skipped[:5]],
                       skipped_empty_texts=sum(empty.values()), skipped_empty_by_file=dict(list(empty.items())[:20]))
        path = stage / MANIFEST
        path.write_text(json.dumps(payload, indent=1) + "\n")
        path = out_dir
        _swap_in(stage, out_dir)
    except BaseException as error:  # a full disk, a quota, no text: the old data stays, nothing half-written
        shutil.rmtree(stage, ignore_errors=True)
        _remove_empty(created)
        if isinstance(error, OSError):
            where = out_dir / path.name if path.parent == stage else path
            raise os_error(error, f"cannot write {where}", "free space there or choose another --out; "
                                                           "the data already there was left as it was") from error
        raise
    return manifest


# The files a prepared directory is made of (``prepare_dataset`` writes them, and replaces them
# all when it prepares the directory again; anything else in it is left alone).
def _own_files(directory: Path) -> list[Path]:
    return [*directory.glob("shard-*.parquet"),
            *(directory / name for name in (TOKEN_FILE, VAL_TOKEN_FILE, VAL_SHARD, TOKENIZER_FILE, MANIFEST)
              if (directory / name).exists())]


def _new_sibling(out_dir: Path, what: str) -> Path:
    """A new hidden folder beside ``out_dir`` (same file system: renames into it are atomic),
    made with the user's umask as ``out_dir`` itself would be."""
    while True:
        folder = out_dir.parent / f".{out_dir.name}.{what}-{uuid.uuid4().hex[:8]}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue


def _missing_parents(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first; a folder something else wrote into stays
        try:
            folder.rmdir()
        except OSError:
            pass


def _swap_in(stage: Path, out_dir: Path) -> None:
    """Local. Make the complete prepared folder ``stage`` (a sibling of ``out_dir``) the data at
    ``out_dir``: a fresh ``out_dir`` is ``stage`` renamed; an existing one keeps its other files,
    its own files are replaced (the manifest, which marks the folder complete, goes first and
    comes back last) and the replaced ones removed. Renames within one folder: nothing is copied."""
    if not out_dir.exists():
        os.replace(stage, out_dir)
        return
    old = _new_sibling(out_dir, "replaced")
    try:
        if (out_dir / MANIFEST).exists():
            os.replace(out_dir / MANIFEST, old / MANIFEST)
        for path in _own_files(out_dir):
            os.replace(path, old / path.name)
        for path in sorted(_own_files(stage), key=lambda p: p.name == MANIFEST):
            os.replace(path, out_dir / path.name)
        stage.rmdir()
    finally:
        shutil.rmtree(old, ignore_errors=True)


def tokenizer_identity(data_dir: str | Path, manifest: Manifest) -> dict[str, Any]:
    """Local. What makes two prepared directories' token ids mean the same: the tokenizer's name,
    vocabulary and the SHA-256 of its tokenizer.json (None for the fixed byte tokenizer)."""
    digest = None
    if manifest.tokenizer_file:
        digest = hashlib.sha256((Path(data_dir) / manifest.tokenizer_file).read_bytes()).hexdigest()
    return {"tokenizer": manifest.tokenizer, "vocab_size": manifest.vocab_size, "tokenizer_sha256": digest}


def data_identity(data_dir: str | Path, manifest: Manifest) -> dict[str, Any]:
    """Local. The tokenizer's identity plus the tokens': their count, rows and CRC-32 (None for
    data prepared before it was recorded). Preparing the same text again gives the same identity."""
    return {**tokenizer_identity(data_dir, manifest), "num_tokens": manifest.num_tokens,
            "row_len": manifest.row_len, "val_rows": manifest.val_rows, "tokens_crc32": manifest.tokens_crc32}


def describe_tokenizer(identity: dict[str, Any]) -> str:
    """``bpe:300 (vocabulary 300)``: how a message names a tokenizer identity."""
    return f"{identity.get('tokenizer')} (vocabulary {identity.get('vocab_size')})"


def keep_copy(data_dir: str | Path, into: str | Path) -> None:
    """Local. Copy what identifies the prepared ``data_dir`` (its manifest, its tokenizer.json)
    into the folder ``into`` (a run's ``data/``), which then loads as a prepared directory
    without tokens (``Manifest.load``, ``lm.tokenizer.load_prepared``); ``"data_dir"`` in the
    copied manifest names where the tokens are. Each file is written whole or not at all."""
    data_dir, into = Path(data_dir), Path(into)
    into.mkdir(parents=True, exist_ok=True)
    payload = json.loads((data_dir / MANIFEST).read_text())
    files = {MANIFEST: (json.dumps({**payload, "data_dir": str(data_dir)}, indent=1) + "\n").encode()}
    if payload.get("tokenizer_file"):
        files[payload["tokenizer_file"]] = (data_dir / payload["tokenizer_file"]).read_bytes()
    for name in sorted(files, key=lambda n: n == MANIFEST):  # the manifest last: it names the tokenizer
        partial = into / f".{name}.partial"
        try:
            partial.write_bytes(files[name])
            os.replace(partial, into / name)
        finally:
            partial.unlink(missing_ok=True)


def skipped_binary_files(data_dir: str | Path) -> tuple[int, list[str]]:
    """(count, a few paths) of the binary files ``prepare_dataset`` left out of ``data_dir``."""
    payload = json.loads((Path(data_dir) / MANIFEST).read_text())
    return payload.get("skipped_binary_files", 0), payload.get("skipped_examples", [])


def skipped_empty_texts(data_dir: str | Path) -> tuple[int, dict[str, int]]:
    """(count, {path: count} for up to 20 files) of the null or empty texts ``prepare_dataset``
    left out of ``data_dir`` (null Parquet/JSONL 'text' values, 0-byte files)."""
    payload = json.loads((Path(data_dir) / MANIFEST).read_text())
    return payload.get("skipped_empty_texts", 0), payload.get("skipped_empty_by_file", {})


def ensure_default_data(data_dir: str | Path | None = None, echo=print) -> Path:
    """Prepare the default dataset at ``data_dir`` (default ``./data/stdlib-bytes``) if missing
    (or prepared before ``tokens.bin`` existed)."""
    data_dir = Path(data_dir).resolve() if data_dir else default_data_dir()
    manifest_path = data_dir / MANIFEST
    if not manifest_path.exists() or TOKEN_FILE not in manifest_path.read_text():
        echo(f"[mpipemoe] no training data at {data_dir}: preparing it from this Python's "
             f"standard library sources (runs once)...")
        start = time.perf_counter()
        manifest = prepare_dataset(data_dir, val_fraction=DEFAULT_VAL_FRACTION)
        echo(f"[mpipemoe] prepared {manifest.num_tokens:,} tokens in {len(manifest.shards)} "
             f"Parquet shard(s) in {time.perf_counter() - start:.1f} s")
    return data_dir


class RankStream:
    """One rank's token stream, memory-mapped: nothing is read until a slice is asked for.

    Rows rank, rank+W, ... of ``tokens.bin`` (a strided view of the mapped file), seen as one
    stream of ``len(self)`` tokens; ``stream[a:b]`` copies just those tokens. Pages come from
    the OS page cache (file-backed, evictable), so a worker's own memory does not grow with
    the data.
    """

    def __init__(self, rows_RL: np.ndarray):
        self.rows_RL = rows_RL
        self.row_len = rows_RL.shape[1]

    def __len__(self) -> int:
        return self.rows_RL.shape[0] * self.row_len

    def __getitem__(self, span: slice) -> np.ndarray:
        start, stop, _ = span.indices(len(self))
        parts = []
        while start < stop:
            row, col = divmod(start, self.row_len)
            take = min(self.row_len - col, stop - start)
            parts.append(self.rows_RL[row, col:col + take])
            start += take
        return np.concatenate(parts) if parts else self.rows_RL[0, :0].copy()


def _rows_per_rank(data_dir, manifest: Manifest, world_size: int) -> int:
    rows_per_rank = manifest.num_rows // world_size
    if rows_per_rank == 0:
        raise ValueError(f"{data_dir} holds {manifest.num_rows} rows of {manifest.row_len} tokens, "
                         f"fewer than the {world_size} workers: prepare more data or use fewer workers")
    return rows_per_rank


def open_rank_stream(data_dir: str | Path, rank: int, world_size: int):
    """This rank's token stream (rows rank, rank+W, ... of the first W*(rows//W) rows),
    memory-mapped from ``tokens.bin``; data prepared before that file existed is loaded whole."""
    manifest = Manifest.load(data_dir)
    if not manifest.token_file:
        return load_rank_tokens(data_dir, rank, world_size)
    rows_per_rank = _rows_per_rank(data_dir, manifest, world_size)
    mapped = np.memmap(Path(data_dir) / manifest.token_file, dtype=manifest.token_dtype, mode="r",
                       shape=(manifest.num_rows, manifest.row_len))
    return RankStream(mapped[rank: rows_per_rank * world_size: world_size])


def load_rank_tokens(data_dir: str | Path, rank: int, world_size: int) -> np.ndarray:
    """This rank's whole token stream in memory (small data, tests; workers use
    ``open_rank_stream``), its ids checked against the manifest's vocabulary."""
    manifest = Manifest.load(data_dir)
    rows_per_rank = _rows_per_rank(data_dir, manifest, world_size)
    if manifest.token_file:
        tokens = np.ascontiguousarray(open_rank_stream(data_dir, rank, world_size).rows_RL).reshape(-1)
    else:
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

    Windows are the non-overlapping ``window``-token slices of the stream (an array or a
    memory-mapped ``RankStream``); each epoch visits them in a permutation seeded by
    (seed, rank, epoch). ``batch(i)`` depends only on i, so resuming at data position i
    reproduces the exact sequence; it reads only that batch's windows.
    """

    def __init__(self, tokens, batch_size: int, window: int, seed: int, rank: int = 0):
        self.windows = len(tokens) // window
        if self.windows < batch_size:
            raise ValueError(
                f"rank {rank}'s data shard has {self.windows} windows of {window} tokens, fewer than "
                f"batch_size={batch_size}: prepare more data (--max-bytes) or lower --batch-size/--seq-len")
        self.tokens = tokens
        self.window = window
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
            rows.append(int(self._order[offset]))
        w = self.window
        return np.stack([self.tokens[r * w:(r + 1) * w] for r in rows]).astype(np.int64)


VAL_ORDER_SEED = 0  # the validation windows' order: fixed, so every run (any --seed) sees the same set


def open_val_stream(data_dir: str | Path) -> RankStream | None:
    """The held-out rows of ``data_dir`` as one memory-mapped stream (every rank reads the
    same one), or None when it has no validation split (prepared with ``val_fraction`` 0,
    or before the split existed)."""
    manifest = Manifest.load(data_dir)
    if not manifest.has_validation:
        return None
    mapped = np.memmap(Path(data_dir) / str(manifest.val_token_file), dtype=np.dtype(manifest.token_dtype), mode="r",
                       shape=(manifest.val_rows, manifest.row_len))
    return RankStream(mapped)


class ValidationBatches:
    """One rank's fixed validation batches: the same windows at every evaluation.

    The held-out stream is cut into windows of ``window`` tokens, put in one fixed order
    (``VAL_ORDER_SEED``, not the run's seed); the first ``world_size * per_rank`` of them
    are the validation set, with ``per_rank = min(batches * batch_size, windows // world_size)``,
    and rank r takes windows r, r+W, ... of it, in batches of up to ``batch_size``. So every
    rank has the same number of batches (the MoE layers' All-to-Alls need every rank in each
    forward), and the set depends only on the data, ``window``, ``batches * batch_size`` and W.
    """

    def __init__(self, stream, batch_size: int, window: int, batches: int, rank: int, world_size: int):
        self.stream, self.window = stream, window
        windows = len(stream) // window
        per_rank = min(batches * batch_size, windows // world_size)
        if per_rank < 1:
            raise ValueError(f"the validation split holds {windows} windows of {window} tokens, fewer than "
                             f"the {world_size} workers: prepare the data with a larger --val-fraction")
        chosen = np.random.default_rng(VAL_ORDER_SEED).permutation(windows)[: per_rank * world_size]
        mine = chosen[rank::world_size]
        self.batches = [mine[start:start + batch_size] for start in range(0, per_rank, batch_size)]
        self.sequences = per_rank

    def __len__(self) -> int:
        return len(self.batches)

    def batch(self, index: int) -> np.ndarray:
        """Validation batch ``index`` as an int64 array (sequences, window)."""
        w = self.window
        return np.stack([self.stream[int(r) * w:(int(r) + 1) * w] for r in self.batches[index]]).astype(np.int64)
