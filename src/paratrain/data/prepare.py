"""`paratrain prepare`: tokenise a corpus once into packed token shards plus ``meta.json``.

The output is the layout nanoGPT's ``train.bin`` and Megatron's ``.bin`` made common: one flat
stream of token ids per split, each document followed by the EOS id, in ``uint16`` when the
vocabulary fits (half the bytes) else ``uint32``. Design decisions:

- Streaming with bounded memory: documents are read lazily and tokenised in chunks of about
  1 MB; at most ``2 x workers`` chunks are in flight (``Pool.imap`` would read the whole corpus
  ahead, so results are collected in submission order from a bounded window). One document is
  held whole, so a single multi-GB text file is the one thing that is not bounded.
- Deterministic bytes: chunks are written in input order whatever the number of workers; the
  Hugging Face tokenizers' own thread pool is turned off (TOKENIZERS_PARALLELISM=false) so that
  ``--workers`` is the only parallelism and measurements are honest.
- Train/validation split by a hash of the document's text (BLAKE2b), not by position: adding
  files never moves an old document across the split, and duplicates land in the same split.
- ``meta.json`` is the completeness marker (like a checkpoint's manifest): it is removed first,
  written last, atomically (tmp + ``os.replace``), and lists size and SHA-256 of every file.

Format 2 (``paratrain-tokens/2``) adds, per split, the length of every document
(``{split}-docs-*.bin``, uint32), so that training can pack whole documents
(``data.args.packing``), and for conversations (``--format chat|prompt``, data/chat.py) a loss
mask beside the tokens (``{split}-mask-*.bin``, one uint8 per token: 1 where the token is a
target). A chat or prompt document is exactly its chat-template rendering, with no EOS appended.
Format 1 corpora still load (as pretraining streams).
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import gzip
import hashlib
import io
import itertools
import json
import multiprocessing
import os
import shutil
import signal
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from paratrain.config import ConfigError
from paratrain.data.chat import (
    FORMATS,
    HF_TOKENIZER_DIR,
    LOSS_ON,
    detect_format,
    encode_conversations,
    encode_plain,
    load_chat_tokenizer,
    row_key,
    row_messages,
    split_pair,
    split_unpaired,
)
from paratrain.data.images import (
    HF_PROCESSOR_DIR,
    encode_image_rows,
    image_token_id,
    init_image_worker,
    is_image_row,
    load_processor,
)

META = "meta.json"
FORMAT = "paratrain-tokens/2"
FORMATS_READ = ("paratrain-tokens/1", FORMAT)
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
# Files taken from a directory (any file named explicitly is taken whatever its name).
TEXT_SUFFIXES = (
    ".txt", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".js", ".ts", ".java", ".go", ".rs",
    ".rb", ".sh", ".tex", ".html", ".css", ".toml", ".yaml", ".yml", ".jsonl", ".jsonl.gz", ".txt.gz", ".parquet",
)  # fmt: skip
SKIP_DIRS = ("__pycache__", ".git", ".hg", ".svn", "node_modules")
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>", "[SEP]")
CHUNK_BYTES = 1 << 20
IMAGE_SCAN_ROWS = 1024  # a chat corpus with an image row among its first rows is prepared as image-text
SHARD_BYTES = 1 << 30  # one shard file per GiB of tokens: each stays a plain, copyable file


# --- input: files, directories, globs -> documents ------------------------------------------------


def expand_inputs(inputs: list[str], exclude: list[str] = ()) -> list[str]:
    """Every input file, in a deterministic order (arguments as given, each expanded sorted)."""
    files = _expand(inputs)
    return [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in exclude)]


def _expand(inputs: list[str]) -> list[str]:
    files: list[str] = []
    for arg in inputs:
        if any(ch in arg for ch in "*?["):
            matches = sorted(glob.glob(arg, recursive=True))
            if not matches:
                raise ConfigError(f"input {arg!r} matches no file; check the pattern")
            files.extend(m for m in matches if os.path.isfile(m))
        elif os.path.isdir(arg):
            for dirpath, dirnames, filenames in os.walk(arg):
                dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
                files.extend(os.path.join(dirpath, n) for n in sorted(filenames) if n.endswith(TEXT_SUFFIXES))
        elif os.path.isfile(arg):
            files.append(arg)
        else:
            raise ConfigError(f"input {arg!r}: no such file or directory; check the path")
    return files


def _open_text(path: str) -> io.TextIOBase:
    # errors="replace": one bad byte must not stop a 100 GB job; the result stays deterministic.
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace", newline="")
    return open(path, encoding="utf-8", errors="replace", newline="")


def iter_rows(files: list[str]) -> Iterator[tuple[str, dict]]:
    """(where, row) of every jsonl line or parquet row: the records of a chat or prompt corpus."""
    for path in files:
        name = path[:-3] if path.endswith(".gz") else path
        if name.endswith(".parquet"):
            pf = _parquet_file(path)
            n = 0
            for batch in pf.iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    n += 1
                    yield f"{path} row {n}", row
        elif name.endswith(".jsonl"):
            for lineno, row in _jsonl_records(path):
                if not isinstance(row, dict):
                    raise ConfigError(f"{path}:{lineno}: a row must be a JSON object; fix the line")
                yield f"{path}:{lineno}", row
        else:
            raise ConfigError(f"{path}: --format chat/prompt reads .jsonl or .parquet rows; convert the file")


def first_row(files: list[str]) -> tuple[str, dict] | None:
    """The first record of the inputs (for ``--format auto``), or None for plain text files."""
    for path in files:
        name = path[:-3] if path.endswith(".gz") else path
        if name.endswith((".jsonl", ".parquet")):
            return next(iter_rows([path]), None)
        return None
    return None


def _parquet_file(path: str):
    try:
        import pyarrow.parquet as pq  # optional extra `parquet`: imported only for .parquet inputs
    except ImportError:
        raise ConfigError(f"{path}: reading .parquet needs pyarrow; pip install 'paratrain[parquet]'")
    return pq.ParquetFile(path)


def iter_documents(files: list[str], text_field: str = "text") -> Iterator[str]:
    """Documents as strings, streamed: one per plain file, one per jsonl line or parquet row."""
    for path in files:
        name = path[:-3] if path.endswith(".gz") else path
        if name.endswith(".jsonl"):
            yield from _iter_jsonl(path, text_field)
        elif name.endswith(".parquet"):
            yield from _iter_parquet(path, text_field)
        else:
            with _open_text(path) as f:
                yield f.read()


def _jsonl_records(path: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) of every non-empty line; a bad line is one error naming it."""
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove the line")


def _iter_jsonl(path: str, text_field: str) -> Iterator[str]:
    for lineno, record in _jsonl_records(path):
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ConfigError(
                f"{path}:{lineno}: no string field {text_field!r}; pass --text-field with the field holding the text"
            )
        yield text


def _iter_parquet(path: str, text_field: str) -> Iterator[str]:
    pf = _parquet_file(path)
    if text_field not in pf.schema_arrow.names:
        raise ConfigError(f"{path}: no column {text_field!r}; pass --text-field with the column holding the text")
    for batch in pf.iter_batches(batch_size=1024, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            yield text or ""


# --- tokenizers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to rebuild the tokenizer: 'bytes', or a tokenizer.json file."""

    kind: str  # "bytes" | "huggingface"
    path: str
    eos_id: int
    vocab_size: int


class Encoder:
    """encode/decode for the shards' ids; ``load_tokenizer(corpus_dir)`` returns one."""

    def __init__(self, spec: TokenizerSpec):
        self.spec = spec
        self.eos_id = spec.eos_id
        self.vocab_size = spec.vocab_size
        self._hf = _load_hf(spec.path) if spec.kind == "huggingface" else None

    def encode_batch(self, texts: list[str]) -> list[list[int]] | list[np.ndarray]:
        if self._hf is None:
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.encode_batch([text])[0]]

    def decode(self, ids: list[int]) -> str:
        if self._hf is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._hf.decode(ids, skip_special_tokens=False)


def _tokenizers():
    try:
        import tokenizers  # optional extra `tokenizers`: only for tokenizer.json and bpe:VOCAB
    except ImportError:
        raise ConfigError("this --tokenizer needs Hugging Face tokenizers; pip install 'paratrain[tokenizers]'")
    return tokenizers


def _load_hf(path: str):
    Tokenizer = _tokenizers().Tokenizer
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the library raises bare Exception subclasses for any unreadable file
        raise ConfigError(f"tokenizer {path!r} is unreadable ({str(e).splitlines()[0][:120]}); give a tokenizer.json")


def _hf_spec(path: str, eos: int | None) -> TokenizerSpec:
    tok = _load_hf(path)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if eos is None:
        eos = next((tok.token_to_id(t) for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        if eos is None:
            raise ConfigError(f"tokenizer {path!r} has none of the EOS tokens {list(EOS_CANDIDATES)}; pass --eos ID")
    return TokenizerSpec("huggingface", path, eos, max(vocab, eos + 1))


def train_bpe(files: list[str], *, vocab_size: int, text_field: str, out_path: str) -> None:
    """A byte-level BPE (GPT-2 style) trained on the input with Hugging Face tokenizers' trainer."""
    tk = _tokenizers()
    Tokenizer, decoders, models, pre_tokenizers, trainers = (
        tk.Tokenizer,
        tk.decoders,
        tk.models,
        tk.pre_tokenizers,
        tk.trainers,
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],  # id 0: the EOS of every document
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_documents(files, text_field), trainer=trainer)
    tok.save(out_path)


def resolve_tokenizer(spec: str, *, eos: int | None, files: list[str], text_field: str, out_dir: str) -> TokenizerSpec:
    """Resolve --tokenizer; the tokenizer.json always ends up in the corpus dir (self-contained)."""
    dest = os.path.join(out_dir, TOKENIZER_FILE)
    if spec == "bytes":
        eos = 0 if eos is None else eos  # NUL: a byte that text does not contain
        return TokenizerSpec("bytes", "", eos, max(256, eos + 1))
    if spec.startswith("bpe:"):
        try:
            vocab = int(spec[4:])
        except ValueError:
            vocab = 0
        if vocab < 257:
            raise ConfigError(f"--tokenizer {spec!r}: write bpe:VOCAB with VOCAB >= 257 (256 bytes + EOS)")
        train_bpe(files, vocab_size=vocab, text_field=text_field, out_path=dest + ".tmp")
        os.replace(dest + ".tmp", dest)
        return _hf_spec(dest, eos)
    path = os.path.join(spec, TOKENIZER_FILE) if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ConfigError(
            f"--tokenizer {spec!r}: no such tokenizer.json; give 'bytes', 'bpe:VOCAB', a tokenizer.json or its directory"
        )
    checked = _hf_spec(path, eos)
    if os.path.abspath(path) != os.path.abspath(dest):
        shutil.copyfile(path, dest)
    return TokenizerSpec(checked.kind, dest, checked.eos_id, checked.vocab_size)


# --- tokenising workers -----------------------------------------------------------------------------

_ENCODER: Encoder | None = None


def _init_worker(spec: TokenizerSpec) -> None:
    global _ENCODER
    _ENCODER = Encoder(spec)


def split_of(text: str, val_fraction: float) -> str:
    """'val' for a fixed fraction of documents, chosen by a hash of the text alone."""
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8).digest(), "little")
    return "val" if h < val_fraction * 2.0**64 else "train"


def encode_chunk(texts: list[str], val_fraction: float, dtype: str) -> dict:
    """Token arrays of one chunk per split (documents in order, each followed by EOS)."""
    enc = _ENCODER
    out = {s: [] for s in SPLITS}
    lengths = {s: [] for s in SPLITS}
    eos = np.array([enc.eos_id], dtype=dtype)
    for text, ids in zip(texts, enc.encode_batch(texts)):
        split = split_of(text, val_fraction)
        out[split] += [np.asarray(ids, dtype=dtype), eos]
        lengths[split].append(len(ids) + 1)
    return {
        "tokens": {s: np.concatenate(v) if v else np.empty(0, dtype) for s, v in out.items()},
        "lengths": lengths,
        "text_bytes": sum(len(t.encode("utf-8", errors="replace")) for t in texts),
    }


_CHAT: tuple | None = None  # (transformers tokenizer, format, loss_on) of a chat worker


def _init_chat_worker(tokenizer_dir: str, fmt: str, loss_on: str) -> None:
    global _CHAT
    _CHAT = (load_chat_tokenizer(tokenizer_dir), fmt, loss_on)


def encode_rows(rows: list[tuple[str, dict]], val_fraction: float, dtype: str, max_length: int) -> dict:
    """Token and loss-mask arrays of one chunk of chat or prompt rows per split (data/chat.py);
    a row with no trainable token is skipped and counted, a longer one cut to ``max_length``."""
    tok, fmt, loss_on = _CHAT
    conversations, bad_row = [], None
    for where, row in rows:
        try:
            conversations.append((*row_messages(row, fmt, where), where))
        except ConfigError as e:
            bad_row = e  # raised after the rows before it are encoded: the first failing row is named
            break
    encoded = encode_conversations(tok, conversations, loss_on=loss_on)  # one tokenizer batch
    if bad_row is not None:
        raise bad_row
    return _row_arrays(
        rows,
        [[doc] for doc in encoded],
        val_fraction,
        dtype,
        max_length,
        reason=lambda i, cut: skip_reason(conversations[i][0], cut=cut),
    )


def encode_images(
    rows: list[tuple[str, dict]],
    val_fraction: float,
    dtype: str,
    max_length: int,
    *,
    pairs: bool = False,
    unpaired: bool = False,
    prompts: bool = False,
) -> dict:
    """:func:`encode_rows` for image-text rows (data/images.py); ``pairs``: TRL's vision preference
    rows; ``unpaired``: its vision KTO rows; ``prompts``: its prompt-completion rows."""
    return encode_image_rows(
        rows,
        dtype=dtype,
        max_length=max_length,
        splits=SPLITS,
        split_of=lambda key: split_of(key, val_fraction),
        skip_reason=skip_reason,
        pairs=pairs,
        unpaired=unpaired,
        prompts=prompts,
    )


def encode_pair_rows(rows: list[tuple[str, dict]], val_fraction: float, dtype: str, max_length: int) -> dict:
    """:func:`encode_rows` for preference rows (data/preference.py): each row two documents,
    chosen then rejected, in the split the row hashes to."""
    tok = _CHAT[0]
    pairs, conversations = [], []
    for where, row in rows:
        prompt, chosen, rejected = split_pair(row, where)
        if isinstance(prompt, str):
            pairs.append([encode_plain(tok, prompt, chosen), encode_plain(tok, prompt, rejected)])
        else:
            pairs.append(None)  # filled from the one tokenizer batch below
            conversations += [(prompt + chosen, len(prompt), where), (prompt + rejected, len(prompt), where)]
    encoded = iter(encode_conversations(tok, conversations, loss_on="assistant"))
    pairs = [p if p is not None else [next(encoded), next(encoded)] for p in pairs]
    return _row_arrays(rows, pairs, val_fraction, dtype, max_length)


def _row_arrays(
    rows: list[tuple[str, dict]], docs: list, val_fraction: float, dtype: str, max_length: int, reason=None
) -> dict:
    """The token and mask arrays of each row's documents (one: encode_rows, two: the preference
    rows); a row with a document left without a target (an empty reply, or cut by ``max_length``
    before it) is skipped and counted, under ``reason(row index, cut)`` (pairs: one reason)."""
    out = {s: [] for s in SPLITS}
    masks = {s: [] for s in SPLITS}
    lengths = {s: [] for s in SPLITS}
    skipped = truncated = text_bytes = 0
    reasons: dict[str, int] = {}
    for i, ((where, row), sides) in enumerate(zip(rows, docs)):
        text_bytes += len(row_key(row).encode("utf-8", errors="replace"))
        cut = bool(max_length) and any(len(ids) > max_length for ids, _ in sides)
        if cut:
            sides, truncated = [(ids[:max_length], mask[:max_length]) for ids, mask in sides], truncated + 1
        # The first token is never a target: nothing precedes it.
        if not all(mask[1:].any() for _, mask in sides):
            skipped += 1
            why = reason(i, cut) if reason else "a reply without a target token (empty, or cut by --max-length)"
            reasons[why] = reasons.get(why, 0) + 1
            continue
        split = split_of(row_key(row), val_fraction)
        for ids, mask in sides:
            out[split].append(ids.astype(dtype))
            masks[split].append(mask)
            lengths[split].append(len(ids))
    return _chunk_result(
        out, masks, lengths, dtype, skipped=skipped, reasons=reasons, truncated=truncated, text_bytes=text_bytes
    )


def encode_unpaired_rows(rows: list[tuple[str, dict]], val_fraction: float, dtype: str, max_length: int) -> dict:
    """:func:`encode_rows` for unpaired rows (KTO, data/preference.py): each row two documents,
    its prompt with its completion (mask 1: desirable, 2: undesirable) and with the next row's
    completion (mask 3: the mismatched pair from which KTO estimates the KL term; the chunk's
    last row takes its first row's), in the split the row hashes to."""
    tok = _CHAT[0]
    parsed = [split_unpaired(row, where) for where, row in rows]
    others = [parsed[(i + 1) % len(parsed)][1] for i in range(len(parsed))]
    plain, conversations = [], []
    for (where, _), (prompt, completion, _), other in zip(rows, parsed, others):
        if isinstance(prompt, str) and isinstance(other, str):
            plain.append([encode_plain(tok, prompt, completion), encode_plain(tok, prompt, other)])
        else:
            plain.append(None)
            other = [{"role": "assistant", "content": other}] if isinstance(other, str) else other
            prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
            conversations += [(prompt + completion, len(prompt), where), (prompt + other, len(prompt), where)]
    encoded = iter(encode_conversations(tok, conversations, loss_on="assistant"))
    sides = [p if p is not None else [next(encoded), next(encoded)] for p in plain]
    marked = []
    for (_, _, label), (real, kl) in zip(parsed, sides):
        marked.append([(real[0], real[1] * (1 if label else 2)), (kl[0], kl[1] * 3)])
    return _row_arrays(rows, marked, val_fraction, dtype, max_length)


def _chunk_result(out: dict, masks: dict, lengths: dict, dtype: str, **counts) -> dict:
    """One chunk's arrays per split and its counts (``skipped``, ``reasons``, ``truncated``,
    ``text_bytes``), as ``prepare`` reads them (_row_arrays, for encode_rows and the preference rows)."""
    return {
        "tokens": {s: np.concatenate(v) if v else np.empty(0, dtype) for s, v in out.items()},
        "masks": {s: np.concatenate(v) if v else np.empty(0, np.uint8) for s, v in masks.items()},
        "lengths": lengths,
        "skipped": counts["skipped"],
        "skipped_by_reason": counts["reasons"],
        "truncated": counts["truncated"],
        "text_bytes": counts["text_bytes"],
    }


def skip_reason(messages: list[dict], *, cut: bool) -> str:
    """Why a row has no token to train on, as the summary names it."""
    if not any(m["role"] == "assistant" for m in messages):
        roles = sorted({m["role"] for m in messages})
        return f"no assistant turn (roles {', '.join(roles)})"
    if cut:
        return "cut by --max-length before its first target"
    return "no assistant token (empty turns, or --loss-on)"


def _row_chunks(rows: Iterator[tuple[str, dict]]) -> Iterator[list[tuple[str, dict]]]:
    chunk: list = []
    for item in rows:
        chunk.append(item)
        if len(chunk) >= 256:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _chunks(docs: Iterator[str]) -> Iterator[list[str]]:
    chunk, size = [], 0
    for text in docs:
        if not text:
            continue  # an empty document would be a lone EOS
        chunk.append(text)
        size += len(text)
        if size >= CHUNK_BYTES or len(chunk) >= 4096:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _worker_init(init, *init_args) -> None:
    """A forked worker's start: SIGTERM back to its default, then unblocked. A fork inherits the
    parent's Python handlers, and the pool's exit terminates idle workers with SIGTERM: a handler
    that only sets a flag (paratrain's preemption handler, in a process that trained before it
    prepared, as a test session does) left them alive and the pool's join waiting forever. The
    parent forks with SIGTERM blocked, so one that arrives before this line waits, pending, and
    kills the worker on the unblock instead of reaching the inherited handler (a hang seen in CI)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    init(*init_args)


def encoded_chunks(chunks: Iterator[list], *, workers: int, init, init_args: tuple, fn, args: tuple):
    """``fn(chunk, *args)`` over the chunks, in order, with at most 2 x workers chunks in flight;
    ``init(*init_args)`` builds each worker's tokenizer."""
    if workers <= 1:
        init(*init_args)
        for chunk in chunks:
            yield fn(chunk, *args)
        return
    # fork: workers start at once and share the parent's pages (a spawned worker would import
    # torch again through the package, about 300 MB each). Safe for tokenizers because
    # TOKENIZERS_PARALLELISM=false is set before any use: its thread pool, which does not survive
    # a fork (huggingface/tokenizers#187), never starts.
    ctx = multiprocessing.get_context("fork")
    # Workers (and the pool's own threads, which re-fork a worker that dies) inherit this mask;
    # the parent's SIGTERM, blocked only for the forks, is delivered to its handler right after.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        pool = ctx.Pool(workers, initializer=_worker_init, initargs=(init, *init_args))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    with pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(fn, (chunk, *args)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        # All results are in: let the workers end on the pool's sentinels rather than SIGTERM.
        pool.close()
        pool.join()


# --- output ---------------------------------------------------------------------------------------


class ShardWriter:
    """Appends tokens to ``{split}-00000.bin``, ... , hashing as it writes (no second read);
    ``kind`` "mask" and "docs" write ``{split}-mask-00000.bin`` and ``{split}-docs-00000.bin``."""

    def __init__(self, out_dir: str, split: str, dtype: str, kind: str = ""):
        self.out_dir, self.split, self.itemsize = out_dir, split, np.dtype(dtype).itemsize
        self.prefix = f"{split}-{kind}-" if kind else f"{split}-"
        self.files: list[dict] = []
        self._f = None

    def _open(self) -> None:
        name = f"{self.prefix}{len(self.files):05d}.bin"
        self._f = open(os.path.join(self.out_dir, name), "wb")
        self._sha = hashlib.sha256()
        self.files.append({"name": name, "tokens": 0, "bytes": 0, "sha256": ""})

    def write(self, tokens: np.ndarray) -> None:
        max_tokens = SHARD_BYTES // self.itemsize
        while len(tokens):
            if self._f is None or self.files[-1]["tokens"] >= max_tokens:
                self._close_current()
                self._open()
            room = max_tokens - self.files[-1]["tokens"]
            part, tokens = tokens[:room], tokens[room:]
            data = part.tobytes()
            self._f.write(data)
            self._sha.update(data)
            self.files[-1]["tokens"] += len(part)
            self.files[-1]["bytes"] += len(data)

    def _close_current(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self.files[-1]["sha256"] = self._sha.hexdigest()
            self._f = None

    def close(self) -> list[dict]:
        self._close_current()
        return self.files


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _check_out_dir(out_dir: str, fingerprint: dict) -> None:
    """Refuse a directory that holds another corpus or other files; then clear our old files."""
    meta_path = os.path.join(out_dir, META)
    if os.path.isfile(meta_path):
        try:
            with open(meta_path) as f:
                old = json.load(f).get("fingerprint")
        except (OSError, ValueError, AttributeError):
            old = None
        if old != fingerprint:
            raise ConfigError(
                f"--out {out_dir} holds a different corpus ({fingerprint_difference(old, fingerprint)});"
                " choose another --out, or delete that directory to prepare this one there"
            )
    elif os.path.isdir(out_dir):
        foreign = [n for n in os.listdir(out_dir) if not _ours(n)]
        if foreign:
            raise ConfigError(
                f"--out {out_dir} is not empty and holds no prepared corpus ({foreign[0]!r}, ...);"
                " choose an empty or new directory"
            )
    os.makedirs(out_dir, exist_ok=True)
    # A half-written corpus must never be taken for complete: the marker goes first.
    for name in os.listdir(out_dir):
        if _ours(name) and name != TOKENIZER_FILE:
            path = os.path.join(out_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


# The option of `paratrain prepare` each fingerprint key records, to name what differs.
FINGERPRINT_OPTIONS = {
    "inputs": "INPUT",
    "tokenizer": "--tokenizer",
    "text_field": "--text-field",
    "val_fraction": "--val-fraction",
    "eos": "--eos",
    "exclude": "--exclude",
    "format": "--format",
    "chat_template": "--chat-template",
    "loss_on": "--loss-on",
    "max_length": "--max-length",
}


def fingerprint_difference(old, new: dict) -> str:
    """What differs between the corpus in a folder and the one asked for, by the option that sets
    it: "prepared with --val-fraction 0.1, this command's is 0.2" (it said "another input or
    tokenizer" whatever differed, issue 60)."""
    if not isinstance(old, dict):
        return f"its {META} records no fingerprint: written by another version, or damaged"
    keys = [*FINGERPRINT_OPTIONS, *sorted((set(old) | set(new)) - set(FINGERPRINT_OPTIONS))]
    diffs = [
        f"{FINGERPRINT_OPTIONS.get(k, k)} {_shown(old.get(k))} there, {_shown(new.get(k))} in this command"
        for k in keys
        if old.get(k) != new.get(k)
    ]
    return "prepared with " + "; ".join(diffs)


def _shown(value) -> str:
    """A fingerprint value for a one-line message (an empty --chat-template is the tokenizer's own)."""
    if value is None or value == "":
        return "(none)"
    if isinstance(value, list):
        return " ".join(map(str, value)) if value else "(none)"
    return str(value)


def _ours(name: str) -> bool:
    return name in (
        META,
        META + ".tmp",
        TOKENIZER_FILE,
        TOKENIZER_FILE + ".tmp",
        HF_TOKENIZER_DIR,
        HF_PROCESSOR_DIR,
    ) or (name.endswith(".bin") and name.split("-")[0] in SPLITS)


def _total_bytes(files: list[str]) -> int:
    return sum(os.path.getsize(p) for p in files)


def prepare(
    inputs: list[str],
    *,
    out_dir: str,
    tokenizer: str,
    text_field: str = "text",
    val_fraction: float = 0.005,
    workers: int = 1,
    eos: int | None = None,
    exclude: list[str] = (),
    progress: bool = True,
    fmt: str = "text",
    chat_template: str = "",
    loss_on: str = "assistant",
    max_length: int = 0,
) -> dict:
    """Tokenise ``inputs`` into ``out_dir``; returns the meta.json dict.

    ``fmt``: ``text`` (documents, each followed by EOS), ``chat`` or ``prompt`` (rows rendered by
    the tokenizer's chat template, with a loss mask: data/chat.py), ``auto`` (by the first row's fields).
    """
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # --workers is the only parallelism (see module doc)
    if not 0 <= val_fraction <= 1:
        raise ConfigError(f"--val-fraction {val_fraction} must be within [0, 1] (1: every document into val)")
    if workers < 1:
        raise ConfigError(f"--workers {workers} must be >= 1")
    if eos is not None and eos < 0:
        raise ConfigError(f"--eos {eos} must be >= 0")
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    if loss_on not in LOSS_ON:
        raise ConfigError(f"--loss-on {loss_on!r} is unknown; use one of {', '.join(LOSS_ON)}")
    if max_length < 0:
        raise ConfigError(f"--max-length {max_length} must be >= 0 (0: documents are kept whole)")
    if not inputs:
        raise ConfigError("prepare needs at least one INPUT (file, directory or glob)")
    files = expand_inputs(inputs, list(exclude))
    if not files:
        raise ConfigError(f"inputs {inputs} hold no text files; give files, directories of text or globs")
    if fmt == "auto":
        first = first_row(files)
        fmt = "text" if first is None else detect_format(first[1], first[0])
    chat = fmt in ("chat", "prompt", "preference", "unpaired")
    # TRL's vision conversations (data/images.py), told by the first rows: the model's processor renders them.
    images = fmt in ("chat", "prompt", "preference", "unpaired") and any(
        is_image_row(row) for _, row in itertools.islice(iter_rows(files), IMAGE_SCAN_ROWS)
    )
    fingerprint = {
        "inputs": [os.path.abspath(p) for p in inputs],
        "tokenizer": tokenizer if tokenizer == "bytes" or tokenizer.startswith("bpe:") else os.path.abspath(tokenizer),
        "text_field": text_field,
        "val_fraction": val_fraction,
        "eos": eos,
        "exclude": list(exclude),
        "format": fmt,
        # No --chat-template: the tokenizer's own ("", not the current directory abspath("") would give).
        **({"chat_template": chat_template and os.path.abspath(chat_template), "loss_on": loss_on} if chat else {}),
        "max_length": max_length,
        **({"images": True} if images else {}),
    }
    _check_out_dir(out_dir, fingerprint)
    if images:
        processor = load_processor(tokenizer, chat_template)
        processor.save_pretrained(os.path.join(out_dir, HF_PROCESSOR_DIR))
        tok = processor.tokenizer
        tok.save_pretrained(os.path.join(out_dir, HF_TOKENIZER_DIR))
        tok.backend_tokenizer.save(os.path.join(out_dir, TOKENIZER_FILE))
        eos_id = tok.eos_token_id if eos is None else eos
        spec = TokenizerSpec(
            "huggingface", os.path.join(out_dir, TOKENIZER_FILE), -1 if eos_id is None else eos_id, len(tok)
        )
        chunks = _row_chunks(iter_rows(files))
        init, init_args = init_image_worker, (os.path.join(out_dir, HF_PROCESSOR_DIR), loss_on)
    elif chat:
        tok = load_chat_tokenizer(tokenizer, chat_template)
        tok.save_pretrained(os.path.join(out_dir, HF_TOKENIZER_DIR))  # with the template it was rendered by
        tok.backend_tokenizer.save(os.path.join(out_dir, TOKENIZER_FILE))
        eos_id = tok.eos_token_id if eos is None else eos
        spec = TokenizerSpec(
            "huggingface", os.path.join(out_dir, TOKENIZER_FILE), -1 if eos_id is None else eos_id, len(tok)
        )
        chunks = _row_chunks(iter_rows(files))
        init, init_args = _init_chat_worker, (os.path.join(out_dir, HF_TOKENIZER_DIR), fmt, loss_on)
    else:
        spec = resolve_tokenizer(tokenizer, eos=eos, files=files, text_field=text_field, out_dir=out_dir)
        chunks = _chunks(iter_documents(files, text_field))
        init, init_args = _init_worker, (spec,)
    dtype = "uint16" if spec.vocab_size <= 1 << 16 else "uint32"
    encode = {"preference": encode_pair_rows, "unpaired": encode_unpaired_rows}.get(fmt, encode_rows)
    if images:
        encode = functools.partial(
            encode_images, pairs=fmt == "preference", unpaired=fmt == "unpaired", prompts=fmt == "prompt"
        )
    fn, args = (encode, (val_fraction, dtype, max_length)) if chat else (encode_chunk, (val_fraction, dtype))
    writers = {s: ShardWriter(out_dir, s, dtype) for s in SPLITS}
    doc_writers = {s: ShardWriter(out_dir, s, "uint32", kind="docs") for s in SPLITS}
    mask_writers = {s: ShardWriter(out_dir, s, "uint8", kind="mask") for s in SPLITS} if chat else {}
    pixel_writers = {s: ShardWriter(out_dir, s, "float32", kind="pixels") for s in SPLITS} if images else {}
    image_writers = {s: ShardWriter(out_dir, s, "uint32", kind="images") for s in SPLITS} if images else {}
    # each image's image_grid_thw where the family has variable patches (Qwen2-VL), else none
    grid_writers = {s: ShardWriter(out_dir, s, "uint32", kind="grids") for s in SPLITS} if images else {}
    grids = False
    image_shape = None
    docs, trainable, text_bytes = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0), 0
    skipped = truncated = 0
    skipped_by_reason: dict[str, int] = {}
    bar = tqdm(
        total=_total_bytes(files),
        unit="B",
        unit_scale=True,
        desc="prepare",
        disable=not progress,
        mininterval=1.0,
        delay=1.0,
    )  # progress: the rate in MB/s and the ETA from the input files' total size (approximate for jsonl/gz)
    for result in encoded_chunks(chunks, workers=workers, init=init, init_args=init_args, fn=fn, args=args):
        for s in SPLITS:
            writers[s].write(result["tokens"][s])
            doc_writers[s].write(np.asarray(result["lengths"][s], dtype=np.uint32))
            docs[s] += len(result["lengths"][s])
            if chat:
                mask_writers[s].write(result["masks"][s])
                # A document's first token is never a target (nothing precedes it in its row).
                # (an unpaired corpus marks with 1, 2 or 3: data/preference.py)
                trainable[s] += int((result["masks"][s] > 0).sum()) - _first_token_marks(result, s)
                if images:
                    pixel_writers[s].write(result["pixels"][s])
                    image_writers[s].write(np.asarray(result["image_counts"][s], dtype=np.uint32))
                    grid_writers[s].write(result["grids"][s])
                    grids = grids or len(result["grids"][s]) > 0
            else:
                trainable[s] += len(result["tokens"][s]) - len(result["lengths"][s])
        if images and result["image_shape"] is not None:
            if image_shape not in (None, result["image_shape"]):
                raise ConfigError(
                    f"inputs {inputs}: images of {result['image_shape']} and {image_shape} pixel values; one size per corpus"
                )
            image_shape = result["image_shape"]
        skipped += result.get("skipped", 0)
        for reason, n in result.get("skipped_by_reason", {}).items():
            skipped_by_reason[reason] = skipped_by_reason.get(reason, 0) + n
        truncated += result.get("truncated", 0)
        text_bytes += result["text_bytes"]
        bar.update(result["text_bytes"])
        bar.set_postfix(docs=sum(docs.values()), refresh=False)
    bar.close()
    if not sum(docs.values()):
        what = "no row with an assistant token to train on" if chat else "no text (empty corpus)"
        raise ConfigError(f"inputs {inputs} hold {what}; check the files, --format and --text-field/--loss-on")
    if not sum(trainable.values()):
        raise ConfigError(f"inputs {inputs} hold no trainable token; check --loss-on and the rows' assistant turns")
    splits = {}
    for s in SPLITS:
        shard_files = writers[s].close()
        splits[s] = {
            "documents": docs[s],
            "tokens": sum(f["tokens"] for f in shard_files),
            "trainable_tokens": trainable[s],
            "files": shard_files,
            "doc_files": doc_writers[s].close(),
            "mask_files": mask_writers[s].close() if chat else None,
            **({"pixel_files": pixel_writers[s].close(), "image_files": image_writers[s].close()} if images else {}),
            **({"grid_files": grid_writers[s].close()} if grids else {}),
        }
    meta = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "tokenizer": {
            "spec": tokenizer,
            "kind": spec.kind,
            "file": TOKENIZER_FILE if spec.kind == "huggingface" else None,
            "sha256": file_sha256(spec.path) if spec.kind == "huggingface" else None,
            "transformers_dir": HF_TOKENIZER_DIR if chat else None,
        },
        "document_format": fmt,
        "loss_mask": chat,
        "loss_on": ("completion" if fmt in ("prompt", "preference", "unpaired") else loss_on) if chat else "all",
        "skipped_documents": skipped,
        "skipped_by_reason": skipped_by_reason,
        "truncated_documents": truncated,
        "vocab_size": spec.vocab_size,
        "eos_id": spec.eos_id,
        "dtype": dtype,
        "text_bytes": text_bytes,
        "input_files": len(files),
        "splits": splits,
        # the pixel values of one image (data/images.py), the image token and the processor's folder
        **(
            {
                "images": {
                    "shape": image_shape,
                    "token_id": image_token_id(processor),
                    "processor": HF_PROCESSOR_DIR,
                    **({"grids": True} if grids else {}),
                }
            }
            if images
            else {}
        ),
    }
    write_json_atomic(os.path.join(out_dir, META), meta)  # last: the corpus is complete from here on
    return meta


def _first_token_marks(result: dict, split: str) -> int:
    """How many documents of a chunk have their first token marked (it is never a target)."""
    lengths = result["lengths"][split]
    if not lengths:
        return 0
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return int((result["masks"][split][starts] > 0).sum())


def load_tokenizer(corpus_dir: str) -> Encoder:
    """The tokenizer a corpus was prepared with (encode/decode, vocab_size, eos_id)."""
    meta_path = os.path.join(corpus_dir, META)
    if not os.path.isfile(meta_path):
        raise ConfigError(f"{corpus_dir}: no meta.json; prepare the corpus with `paratrain prepare INPUT --out DIR`")
    with open(meta_path) as f:
        meta = json.load(f)
    tok = meta["tokenizer"]
    path = os.path.join(corpus_dir, tok["file"]) if tok["kind"] == "huggingface" else ""
    return Encoder(TokenizerSpec(tok["kind"], path, meta["eos_id"], meta["vocab_size"]))
