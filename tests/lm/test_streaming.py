"""Streaming input: training and preparation read a corpus larger than the process may
allocate (tier 1, a subprocess under RLIMIT_DATA, no Ray).

RLIMIT_DATA caps a process's private data (heap, anonymous mmaps: everything numpy, torch
and pyarrow allocate), not read-only file mappings, so a worker that memory-maps its shard
works under a limit far below the corpus while one that loads the shard fails. Each script
first checks that loading the whole corpus *does* fail under its limit, so the test cannot
pass with a limit too loose to matter.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


def _run_limited(script: str, limit_mib: int, *args) -> dict:
    """Run ``script`` in a fresh Python; it calls ``apply_limit()`` once set up, which caps
    RLIMIT_DATA at its data size then + ``limit_mib``; it prints one JSON line last.
    One thread each for torch and Arrow, one malloc arena with a fixed mmap threshold and
    Arrow's system allocator keep the data size honest (thread stacks, per-thread arenas and
    allocator reservations count against RLIMIT_DATA; none of this changes mpipemoe)."""
    prologue = textwrap.dedent(f"""
        import json, resource, sys
        import numpy as np, torch, pyarrow, pyarrow.parquet
        torch.set_num_threads(1); pyarrow.set_cpu_count(1); pyarrow.set_io_thread_count(1)
        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        def apply_limit():
            limit = status("VmData") + {limit_mib} * 2**20
            resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
            return limit
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1",
           "MALLOC_MMAP_THRESHOLD_": "65536",
           "ARROW_DEFAULT_MEMORY_POOL": "system"}
    done = subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(script), *map(str, args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _write_corpus(data_dir: Path, num_rows: int, row_len: int) -> None:
    """A prepared directory of ``num_rows * row_len`` byte-level tokens, written in pieces:
    a token file too big for the limited process, made quickly without holding it whole."""
    data_dir.mkdir()
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, size=row_len * 512, dtype=np.uint16)
    with (data_dir / "tokens.bin").open("wb") as out:
        for start in range(0, num_rows, 512):
            out.write(block[: (min(num_rows, start + 512) - start) * row_len].tobytes())
    (data_dir / "manifest.json").write_text(json.dumps({
        "tokenizer": "bytes-v1", "vocab_size": 259, "row_len": row_len, "num_rows": num_rows,
        "num_tokens": num_rows * row_len, "shards": [], "source": "test", "token_file": "tokens.bin",
        "token_dtype": "uint16"}))


TRAIN = """
from lm.data import BatchSampler, open_rank_stream
from lm.model import MoETransformer, get_preset, lm_batch, lm_loss
data_dir, steps = sys.argv[1], int(sys.argv[2])
corpus_bytes = (__import__("pathlib").Path(data_dir) / "tokens.bin").stat().st_size
torch.manual_seed(0)
preset = get_preset("tiny-gpt").replace(seq_len=64, num_layers=1)
model = MoETransformer(preset, engine="fastmoe")
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
warm_BS = torch.randint(0, 259, (8, 65))             # one step on random ids: allocations settle
logits_BSV, aux = model(warm_BS[:, :-1]); (lm_loss(logits_BSV, warm_BS[:, 1:]) + aux).backward()
optimizer.zero_grad()
LIMIT = apply_limit()
try:                                   # the old way, loading the shard whole, cannot work here
    np.fromfile(f"{data_dir}/tokens.bin", dtype=np.uint16).sum()
    loads_whole = True
except MemoryError:
    loads_whole = False
anon_before = status("RssAnon")
stream = open_rank_stream(data_dir, 1, 2)          # rank 1 of 2: every other row
sampler = BatchSampler(stream, batch_size=8, window=65, seed=0, rank=1)
losses = []
for step in range(steps):
    window_BS = torch.from_numpy(sampler.batch(step))
    inputs_BS, targets_BS = lm_batch("gpt", window_BS, 257, 259)
    logits_BSV, aux = model(inputs_BS)
    loss = lm_loss(logits_BSV, targets_BS) + 0.01 * aux
    optimizer.zero_grad(); loss.backward(); optimizer.step()
    losses.append(loss.item())
swept = 0                              # read the whole rank stream once, 4 MiB at a time
for start in range(0, len(stream), 2 * 2**20):
    swept += int(stream[start:start + 2 * 2**20][-1])
resumed = BatchSampler(open_rank_stream(data_dir, 1, 2), batch_size=8, window=65, seed=0, rank=1)
print(json.dumps({"limit": LIMIT, "corpus_bytes": corpus_bytes, "loads_whole": loads_whole,
                  "losses": losses, "anon_growth": status("RssAnon") - anon_before,
                  "stream_tokens": len(stream),
                  "resume_exact": bool(np.array_equal(resumed.batch(steps - 1), sampler.batch(steps - 1)))}))
"""


def test_training_reads_a_corpus_larger_than_the_worker_may_allocate(tmp_path):
    data_dir = tmp_path / "big"
    _write_corpus(data_dir, num_rows=24_000, row_len=8192)  # 196.6M tokens, 375 MiB
    result = _run_limited(TRAIN, 96, data_dir, 12)
    corpus = result["corpus_bytes"]
    assert corpus == 24_000 * 8192 * 2 and corpus > 3 * 96 * MiB
    assert result["loads_whole"] is False                     # the limit bites
    assert len(result["losses"]) == 12 and all(np.isfinite(result["losses"]))
    assert result["losses"][-1] < result["losses"][0]         # it trained
    assert result["stream_tokens"] == 12_000 * 8192           # rank 1's half, all read once
    assert result["anon_growth"] < 64 * MiB                   # pages read are file-backed, not ours
    assert result["resume_exact"] is True


PREPARE = """
from lm.data import Manifest, prepare_dataset
source, out = sys.argv[1], sys.argv[2]
LIMIT = apply_limit()
try:
    open(source, "rb").read()
    reads_whole = True
except MemoryError:
    reads_whole = False
manifest = prepare_dataset(out, [source], max_bytes=None, row_len=4096, rows_per_shard=256)
print(json.dumps({"reads_whole": reads_whole, "num_tokens": manifest.num_tokens,
                  "data_growth": status("VmData") - LIMIT, "limit": LIMIT}))
"""


def test_preparation_streams_a_text_file_larger_than_it_may_allocate(tmp_path):
    source = tmp_path / "big.txt"
    line = ("streaming preparation holds one shard at a time " * 4 + "\n").encode()
    with source.open("wb") as out:
        for _ in range(192 * MiB // (len(line) * 1000)):
            out.write(line * 1000)
    size = source.stat().st_size
    result = _run_limited(PREPARE, 80, source, tmp_path / "out")
    assert size > 2 * 80 * MiB and result["reads_whole"] is False  # cannot be held under the limit
    assert result["num_tokens"] == (size + 1) // 4096 * 4096  # every byte, plus the EOS
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (tmp_path / "out" / "tokens.bin").stat().st_size == manifest["num_tokens"] * 2


def test_data_prepared_before_tokens_bin_is_still_read_and_the_default_is_redone(tmp_path):
    from lm.data import MANIFEST, ensure_default_data, load_rank_tokens, open_rank_stream, prepare_dataset

    prepare_dataset(tmp_path / "old", max_bytes=20_000, row_len=1000)
    expected = load_rank_tokens(tmp_path / "old", 1, 2)
    manifest = json.loads((tmp_path / "old" / MANIFEST).read_text())
    for key in ("token_file", "token_dtype", "tokenizer_file", "eos_id", "mask_id", "pad_id"):
        manifest.pop(key)  # the manifest of an earlier mpipemoe
    (tmp_path / "old" / MANIFEST).write_text(json.dumps(manifest))
    (tmp_path / "old" / "tokens.bin").unlink()
    old = open_rank_stream(tmp_path / "old", 1, 2)  # read whole from the Parquet shards
    assert isinstance(old, np.ndarray) and np.array_equal(old, expected)
    lines = []
    ensure_default_data(tmp_path / "old", echo=lines.append)  # as the default directory: prepared again
    assert (tmp_path / "old" / "tokens.bin").is_file() and "preparing it" in lines[0]
