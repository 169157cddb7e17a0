"""Tokenizers for ``mpipemoe data prepare``: byte-level (default) or byte-level BPE.

    --tokenizer bytes               # ids 0-255 are bytes, 256 EOS, 257 MASK, 258 PAD; vocab 259
    --tokenizer bpe                 # train a byte-level BPE of 8192 tokens on the corpus
    --tokenizer bpe:32000           # ... of 32000 tokens
    --tokenizer PATH/tokenizer.json # load a Hugging Face ``tokenizers`` file (GPT-2's, your own)

BPE uses Hugging Face ``tokenizers`` (a Rust library; trains offline, nothing downloaded).
Byte-level pre-tokenization means every input byte is representable, so no text is ever
out of vocabulary. The tokenizer of a prepared directory is saved there as
``tokenizer.json``; ``mpipemoe train`` sizes the model's vocabulary from the manifest.

Special ids: a trained BPE puts ``<eos>``, ``<mask>``, ``<pad>`` at 0, 1, 2. A loaded file keeps
its own ids for a known end-of-text, mask and padding token (``<|endoftext|>``, ``</s>``,
``[MASK]``, ``[PAD]``, ...) and gets ``<eos>``/``<mask>``/``<pad>`` added for the ones it lacks.

``tokenizers`` is imported only where a BPE is trained or loaded (``_import_tokenizers``):
byte-level data, and the workers, never need it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

BYTE_VOCAB = 256
DEFAULT_BPE_VOCAB = 8192
TOKENIZER_FILE = "tokenizer.json"
SPECIALS = ("<eos>", "<mask>", "<pad>")
# Names other tokenizers use for the same three roles, most common first.
KNOWN_SPECIALS = {
    "eos": ("<eos>", "<|endoftext|>", "</s>", "<|end_of_text|>", "[SEP]"),
    "mask": ("<mask>", "[MASK]", "<|mask|>"),
    "pad": ("<pad>", "[PAD]", "<|pad|>", "<|padding|>"),
}
_MIN_BPE_VOCAB = BYTE_VOCAB + len(SPECIALS) + 1
_MAX_VOCAB = 2**31 - 1


def _fail(value: str, fix: str):
    raise ValueError(f"--tokenizer {value} is invalid: {fix}")


@dataclass(frozen=True)
class TokenizerSpec:
    """What ``--tokenizer`` asks for: kind "bytes", "bpe" (with ``vocab_size``) or "file" (``path``)."""

    kind: str
    vocab_size: int | None = None
    path: str | None = None

    @classmethod
    def parse(cls, value: str) -> "TokenizerSpec":
        if value in ("bytes", "byte", ""):
            return cls("bytes")
        if value == "bpe" or value.startswith("bpe:"):
            size = value[4:] or str(DEFAULT_BPE_VOCAB)
            if not size.isdigit() or not _MIN_BPE_VOCAB <= int(size) <= _MAX_VOCAB:
                _fail(value, f"give bpe or bpe:VOCAB with VOCAB an integer >= {_MIN_BPE_VOCAB} "
                             f"(256 bytes + 3 specials + merges), e.g. bpe:8192")
            return cls("bpe", vocab_size=int(size))
        path = Path(value).expanduser()
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if path.suffix != ".json" or not path.is_file():
            _fail(value, "give bytes, bpe[:VOCAB] or the path of an existing Hugging Face "
                         "tokenizer.json (a prepared data directory also works)")
        return cls("file", path=str(path.resolve()))


class ByteTokenizer:
    """UTF-8 bytes (0-255) plus EOS 256, MASK 257, PAD 258."""

    name = "bytes-v1"
    vocab_size = BYTE_VOCAB + 3
    eos_id, mask_id, pad_id = 256, 257, 258

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, texts: list) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        names = {self.eos_id: "<eos>", self.mask_id: "<mask>", self.pad_id: "<pad>"}
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

    def save(self, directory: Path) -> str | None:
        return None  # nothing to store: the byte tokenizer is fixed


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with the three special ids this project needs."""

    def __init__(self, tokenizer, name: str):
        self.tokenizer = tokenizer
        self.name = name
        ids = {}
        for role, names in KNOWN_SPECIALS.items():
            ids[role] = next((tokenizer.token_to_id(n) for n in names if tokenizer.token_to_id(n) is not None), None)
        missing = [SPECIALS[i] for i, role in enumerate(("eos", "mask", "pad")) if ids[role] is None]
        if missing:
            tokenizer.add_special_tokens(missing)
            for role, token in zip(("eos", "mask", "pad"), SPECIALS):
                if ids[role] is None:
                    ids[role] = tokenizer.token_to_id(token)
        self.eos_id, self.mask_id, self.pad_id = ids["eos"], ids["mask"], ids["pad"]
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        highest = max(tokenizer.get_vocab(with_added_tokens=True).values())
        self.vocab_size = max(self.vocab_size, highest + 1)

    @classmethod
    def load(cls, path: str | Path, name: str | None = None) -> "HFTokenizer":
        tokenizers = _import_tokenizers()
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:  # the Rust side raises a plain Exception on a bad file
            raise ValueError(f"cannot load tokenizer {path} ({error}): give a Hugging Face tokenizer.json, "
                             f"or --tokenizer bpe to train one") from error
        return cls(tokenizer, name or f"file:{Path(path).name}")

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int) -> "HFTokenizer":
        """A byte-level BPE of ``vocab_size`` tokens trained on ``texts`` (streamed)."""
        tokenizers = _import_tokenizers()
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tokenizer = tokenizers.Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        # The merges run in Rust without the GIL and without checking for signals: on this
        # thread a Ctrl-C would wait for them to finish (minutes on a large corpus). The
        # training runs on a thread of its own while this one waits, answering Ctrl-C at once.
        failure: list[BaseException] = []

        def train() -> None:
            try:
                tokenizer.train_from_iterator(texts, trainer)
            except BaseException as error:  # handed to the waiting thread
                failure.append(error)

        worker = threading.Thread(target=train, name="bpe-training", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
        if failure:
            raise failure[0]
        trained = cls(tokenizer, "bpe-byte-level")
        trained.name = f"bpe-byte-level-{trained.vocab_size}"  # fewer than asked when the text has few pairs
        return trained

    def encode(self, text: str | bytes) -> np.ndarray:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list) -> list[np.ndarray]:
        strings = [t.decode("utf-8", "replace") if isinstance(t, (bytes, bytearray)) else t for t in texts]
        dtype = token_dtype(self.vocab_size)
        return [np.asarray(e.ids, dtype=dtype) for e in
                self.tokenizer.encode_batch(strings, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in np.asarray(ids)], skip_special_tokens=False)

    def save(self, directory: Path) -> str:
        self.tokenizer.save(str(Path(directory) / TOKENIZER_FILE))
        return TOKENIZER_FILE


def token_dtype(vocab_size: int):
    """The smallest unsigned dtype that holds every id of a ``vocab_size`` vocabulary."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as error:
        raise ValueError("--tokenizer bpe and tokenizer.json files need Hugging Face `tokenizers`: "
                         "pip install tokenizers==0.23.3 (a dependency of mpipemoe; reinstall the "
                         "project), or use --tokenizer bytes") from error
    return tokenizers


def load_prepared(data_dir: str | Path, tokenizer_file: str | None):
    """The tokenizer a prepared directory was made with (bytes when it stores none)."""
    if not tokenizer_file:
        return ByteTokenizer()
    return HFTokenizer.load(Path(data_dir) / tokenizer_file)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable character for each byte, which byte-level ``tokenizers`` files use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {b: chr(b) for b in printable}, 0
    for byte in range(BYTE_VOCAB):
        if byte not in chars:
            chars[byte] = chr(BYTE_VOCAB + extra)
            extra += 1
    return chars


def byte_tokenizer_as_hf() -> HFTokenizer:
    """``ByteTokenizer`` as a Hugging Face ``tokenizers`` file (``mpipemoe export``): byte-level,
    no merges, so byte b is id b, and ``<eos>``, ``<mask>``, ``<pad>`` are 256, 257, 258."""
    _import_tokenizers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIALS))
    return HFTokenizer(tokenizer, ByteTokenizer.name)
