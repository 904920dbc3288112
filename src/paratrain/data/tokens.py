"""``[data] name = "tokens"``: windows over corpora made by `paratrain prepare`, read by memmap.

Sample ``i`` of a source is the window of ``block_size + 1`` tokens starting at ``i * block_size``
of the split's packed stream (its shards end to end): input ``w[:-1]``, target ``w[1:]``, as in
nanoGPT, but at fixed, non-overlapping offsets so that the dataset is map-style and a step's
samples stay a pure function of ``(seed, consumed_samples)``. The shards are opened with
``numpy.memmap`` lazily in each process (a pickled dataset carries paths, not data), so ranks
and loader workers share the page cache and no rank copies the corpus.

Mixing: with ``sources = [{path, weight}, ...]`` position ``i`` of the mixture is assigned to a
source by a proportional interleave: source ``k``'s ``j``-th sample is placed at time
``(j + 0.5) / w_k`` and all sources are merged by time (ties: source order). Every prefix of the
mixture then holds each source within one sample of its share, and the map from position to
``(source, local index)`` is a fixed table computed from the weights and lengths alone. A
source asked for more samples than it has wraps around (is up-sampled).

Checks against ``meta.json`` (``verify``): the size of every shard at every start (a stat, free);
SHA-256 of every shard ``"once"`` per set of files (default: the result is remembered in
``verified.json`` beside ``meta.json``, keyed by size and mtime, so a 1 GB corpus is not read
again at each start; where the directory is read-only it is hashed at each start), ``"always"``,
or never (``"size"``).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from paratrain.config import ConfigError
from paratrain.data.image_rows import ImageConversations, ImagePreferencePairs
from paratrain.data.packing import PACKINGS, PackedRows
from paratrain.data.preference import PreferencePairs
from paratrain.data.prepare import FORMATS_READ, META, file_sha256, write_json_atomic

VERIFIED = "verified.json"
VERIFY_MODES = ("once", "always", "size")


def read_meta(path: str, key: str = "data.args.path") -> dict:
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        where = (
            ""
            if os.path.isabs(path)
            else f" under the current directory {os.getcwd()!r} (relative paths are taken from where paratrain runs, not from the config file's folder)"
        )
        raise ConfigError(
            f"{key} = {path!r} holds no prepared corpus{where} (no meta.json); run `paratrain prepare INPUT... --out"
            f" {path}`, or give the corpus's absolute path"
        )
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{meta_path} is unreadable ({e}); prepare the corpus again")
    if meta.get("format") not in FORMATS_READ:
        raise ConfigError(
            f"{meta_path}: format {meta.get('format')!r} is not one of {list(FORMATS_READ)}; prepare the corpus again"
        )
    return meta


def verify_corpus(path: str, meta: dict, mode: str = "once") -> None:
    """Sizes always; SHA-256 per ``mode`` (see the module docstring)."""
    if mode not in VERIFY_MODES:
        raise ConfigError(f"data.args.verify = {mode!r} is unknown; use one of {list(VERIFY_MODES)}")
    stamps = {}
    for split in meta["splits"].values():
        extra = [split.get(k) or [] for k in ("doc_files", "mask_files", "pixel_files", "image_files", "grid_files")]
        for entry in split["files"] + [e for files in extra for e in files]:
            file = os.path.join(path, entry["name"])
            try:
                st = os.stat(file)
            except OSError:
                raise ConfigError(f"{file} is missing (listed in meta.json); prepare the corpus again")
            if st.st_size != entry["bytes"]:
                raise ConfigError(
                    f"{file} has {st.st_size} bytes, meta.json says {entry['bytes']}; prepare the corpus again"
                )
            stamps[entry["name"]] = [st.st_size, st.st_mtime_ns, entry["sha256"]]
    if mode == "size":
        return
    stamp_path = os.path.join(path, VERIFIED)
    if mode == "once" and os.path.isfile(stamp_path):
        try:
            with open(stamp_path) as f:
                if json.load(f) == stamps:
                    return
        except (OSError, ValueError):
            pass
    for name, (_, _, sha) in stamps.items():
        if file_sha256(os.path.join(path, name)) != sha:
            raise ConfigError(
                f"{os.path.join(path, name)}: SHA-256 disagrees with meta.json (corrupt or changed); prepare the corpus again"
            )
    if mode == "once":
        try:
            write_json_atomic(stamp_path, stamps)
        except OSError:
            pass  # a read-only corpus: verified again at the next start


class ShardedArray:
    """Shard files read end to end as one array, by memmap opened lazily in each process."""

    def __init__(self, path: str, files: list[dict], dtype: str):
        self._files = [os.path.join(path, f["name"]) for f in files]
        self._starts = np.cumsum([0] + [f["tokens"] for f in files])  # shard k holds [starts[k], starts[k+1])
        self.dtype = dtype
        self._maps: list[np.memmap] | None = None

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getstate__(self) -> dict:  # loader workers reopen the files instead of receiving copies
        return {**self.__dict__, "_maps": None}

    def _memmaps(self) -> list[np.memmap]:
        if self._maps is None:
            self._maps = [np.memmap(f, dtype=self.dtype, mode="r") for f in self._files]
        return self._maps

    def read(self, start: int, stop: int) -> np.ndarray:
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        parts, maps = [], self._memmaps()
        while start < stop:  # a range may span two shards
            end = min(stop, int(self._starts[k + 1]))
            parts.append(maps[k][start - self._starts[k] : end - self._starts[k]])
            start, k = end, k + 1
        return np.concatenate(parts) if parts else np.empty(0, self.dtype)


class TokenWindows(Dataset):
    """The windows of one split of one prepared corpus."""

    draws_random = False  # paratrain/randomness.py: no sample_rng around __getitem__

    def __init__(self, path: str, *, block_size: int, split: str = "train", verify: str = "once"):
        self.path, self.block_size, self.split = path, block_size, split
        self.items_per_sample = block_size  # every next token is a target (data/datasets.py static_items_per_sample)
        self.meta = read_meta(path)
        verify_corpus(path, self.meta, verify)
        self._tokens = ShardedArray(path, self.meta["splits"][split]["files"], self.meta["dtype"])
        self.tokens = len(self._tokens)

    def __len__(self) -> int:
        return max(0, (self.tokens - 1) // self.block_size)

    def window(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range [0, {len(self)})")
        start = i * self.block_size
        return self._tokens.read(start, start + self.block_size + 1).astype(np.int64)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.from_numpy(self.window(int(i)))
        return w[:-1], w[1:]


class Documents:
    """The documents of one split of a format-2 corpus: token ids and, for conversations, the loss
    mask (1 where a token is a target), by document (data/packing.py packs them into rows)."""

    def __init__(self, path: str, meta: dict, split: str):
        entry = meta["splits"][split]
        self.tokens = ShardedArray(path, entry["files"], meta["dtype"])
        self.masks = ShardedArray(path, entry["mask_files"], "uint8") if entry.get("mask_files") else None
        docs = ShardedArray(path, entry["doc_files"], "uint32")
        self.doc_lengths = docs.read(0, len(docs)).astype(np.int64)
        self.doc_starts = np.concatenate([[0], np.cumsum(self.doc_lengths)[:-1]]).astype(np.int64)

    def document(self, d: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask) of the first ``n`` tokens of document ``d``."""
        start = int(self.doc_starts[d])
        ids = self.tokens.read(start, start + n).astype(np.int64)
        mask = self.masks.read(start, start + n) if self.masks is not None else np.ones(n, np.uint8)
        return ids, mask


def mixture_table(lengths: list[int], weights: list[float], total: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, local index) of each of ``total`` positions: the proportional interleave."""
    w = np.asarray(weights, dtype=np.float64) / float(sum(weights))
    times, source, local = [], [], []
    for k, wk in enumerate(w):
        n = int(np.ceil(wk * total)) + 1  # enough candidates: only the first ``total`` survive the merge
        j = np.arange(n, dtype=np.int64)
        times.append((j + 0.5) / wk)
        source.append(np.full(n, k, dtype=np.int32))
        local.append(j % lengths[k])
    order = np.argsort(np.concatenate(times), kind="stable")[:total]  # stable: ties go to the earlier source
    return np.concatenate(source)[order], np.concatenate(local)[order]


class TokenMixture(Dataset):
    """A weighted mixture of corpora; position i -> (source, window) by a fixed table."""

    draws_random = False  # paratrain/randomness.py: no sample_rng around __getitem__

    def __init__(self, parts: list[TokenWindows], weights: list[float], samples: int = 0):
        self.parts, self.weights = parts, weights
        if len({p.items_per_sample for p in parts}) == 1:  # the static count of its windows
            self.items_per_sample = parts[0].items_per_sample
        lengths = [len(p) for p in parts]
        self.samples = samples or sum(lengths)
        self._source, self._local = mixture_table(lengths, weights, self.samples)

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.parts[int(self._source[i])][int(self._local[i])]


def _sources(path: str, sources: list | None) -> list[tuple[str, float]]:
    if bool(path) == bool(sources):
        raise ConfigError(
            "data.args: give either path = 'DIR' or sources = [{path = 'DIR', weight = W}, ...] for data.name = 'tokens'"
        )
    if path:
        return [(path, 1.0)]
    out = []
    for n, s in enumerate(sources):
        if not isinstance(s, dict) or not isinstance(s.get("path"), str) or set(s) - {"path", "weight"}:
            raise ConfigError(f"data.args.sources[{n}] = {s!r}; write {{ path = 'DIR', weight = W }}")
        weight = s.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or weight <= 0:
            raise ConfigError(f"data.args.sources[{n}].weight = {weight!r} must be a number > 0")
        out.append((s["path"], float(weight)))
    return out


def corpus_meta(path: str = "", sources: list | None = None) -> dict:
    """meta.json of the corpus (the first source of a mixture) without opening any shard.

    For checks before launch: the sources must share one tokenizer, so one meta speaks for all.
    """
    metas = [read_meta(p) for p, _ in _sources(path, sources)]
    for (p, _), m in zip(_sources(path, sources), metas):
        if (m["vocab_size"], m["eos_id"], m["tokenizer"]["sha256"]) != (
            metas[0]["vocab_size"],
            metas[0]["eos_id"],
            metas[0]["tokenizer"]["sha256"],
        ):
            raise ConfigError(
                f"data.args.sources: {p!r} was prepared with another tokenizer than {_sources(path, sources)[0][0]!r};"
                " prepare all sources with the same --tokenizer"
            )
    return {**metas[0], "path": _sources(path, sources)[0][0]}


def build_tokens(
    path: str = "",
    sources: list | None = None,
    block_size: int = 256,
    split: str = "train",
    samples: int = 0,
    verify: str = "once",
    packing: str = "",
    pad_to: int | None = None,
) -> Dataset:
    """The ``tokens`` dataset: one corpus (``path``) or a weighted mixture (``sources``).

    ``packing`` (data/packing.py): ``documents`` (whole documents packed into rows, the default
    for a corpus with loss masks), ``padded`` (one document per row), ``stream`` (fixed windows
    across documents, the default for a text corpus). ``pad_to``: a preference corpus's rows end
    at their micro-batch's longest pair rounded up to a multiple of it (data/preference.py; the
    trainer's default is 8, 0 under train.compile).
    """
    if split not in ("train", "val"):
        raise ConfigError(f"data.args.split = {split!r}; use 'train' or 'val'")
    meta = corpus_meta(path, sources)
    packing = resolve_packing(packing, meta)
    if pad_to is not None and meta.get("document_format") not in ("preference", "unpaired"):
        raise ConfigError(
            "data.args.pad_to cuts the padding of preference pairs; this corpus has none: drop data.args.pad_to"
        )
    if packing != "stream":
        return _build_packed(
            path, sources, block_size=block_size, split=split, verify=verify, packing=packing, pad_to=pad_to
        )
    if not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"data.args.block_size = {block_size!r} must be an integer >= 1")
    if not isinstance(samples, int) or samples < 0:
        raise ConfigError(f"data.args.samples = {samples!r} must be an integer >= 0 (0 = all)")
    srcs = _sources(path, sources)
    parts = [TokenWindows(p, block_size=block_size, split=split, verify=verify) for p, _ in srcs]
    for (p, _), part in zip(srcs, parts):
        if len(part) == 0:
            raise ConfigError(
                f"data.args: the {split} split of {p!r} has {part.tokens} tokens, fewer than block_size + 1 ="
                f" {block_size + 1}; lower data.args.block_size or prepare more text"
            )
    if len(parts) == 1 and not samples:
        ds = parts[0]
    else:
        ds = TokenMixture(parts, [w for _, w in srcs], samples)
    ds.vocab_size = meta["vocab_size"]
    ds.eos_id = meta["eos_id"]
    ds.meta = meta
    ds.description = {
        "name": "tokens",
        "split": split,
        "sources": [
            {"path": p, "weight": w, "tokens": part.tokens, "windows": len(part)} for (p, w), part in zip(srcs, parts)
        ],
        "tokenizer": meta["tokenizer"]["spec"],
        "tokenizer_sha256": meta["tokenizer"]["sha256"],
        "vocab_size": meta["vocab_size"],
        "eos_id": meta["eos_id"],
        "block_size": block_size,
        "samples": len(ds),
    }
    return ds


def resolve_packing(packing: str, meta: dict) -> str:
    """data.args.packing, or its default for the corpus: documents for one with loss masks."""
    if packing and packing not in PACKINGS:
        raise ConfigError(f"data.args.packing = {packing!r} is unknown; use one of {', '.join(PACKINGS)}")
    # An image corpus has one conversation per row by default (padded); 'documents' packs them
    # with their images (data/image_rows.py).
    # (a preference corpus packs each pair into one row, images or not: data/preference.py)
    pairs = meta.get("document_format") in ("preference", "unpaired")
    packing = packing or (
        "padded" if meta.get("images") and not pairs else "documents" if meta.get("loss_mask") else "stream"
    )
    if meta.get("loss_mask") and packing == "stream":
        raise ConfigError(
            "data.args.packing = 'stream' would cross document boundaries of a corpus with loss masks;"
            " use 'documents' or 'padded'"
        )
    if packing != "stream" and "doc_files" not in next(iter(meta["splits"].values())):
        raise ConfigError(
            f"data.args.packing = {packing!r} needs document boundaries, which a format-1 corpus lacks;"
            " prepare it again (format 2) or use packing = 'stream'"
        )
    return packing


def _build_packed(
    path: str, sources: list | None, *, block_size: int, split: str, verify: str, packing: str, pad_to: int | None
):
    if sources:
        raise ConfigError(
            f"data.args.packing = {packing!r} takes one corpus (data.args.path), not a mixture of sources;"
            " prepare the conversations into one corpus"
        )
    meta = read_meta(path)
    verify_corpus(path, meta, verify)
    if meta.get("document_format") in ("preference", "unpaired"):
        return _build_pairs(path, meta, block_size=block_size, split=split, packing=packing, pad_to=pad_to)
    if meta.get("images"):
        return _build_images(path, meta, block_size=block_size, split=split, packing=packing)
    ds = PackedRows(Documents(path, meta, split), block_size=block_size, packing=packing)
    if len(ds) == 0:
        raise ConfigError(
            f"data.args: the {split} split of {path!r} has no document with a target; prepare more conversations"
            + (" (or --val-fraction > 0)" if split == "val" else "")
        )
    return _describe(
        ds,
        meta,
        split=split,
        block_size=block_size,
        packing=packing,
        path=path,
        documents=int(len(ds.lengths)),
        rows=len(ds),
        truncated_documents=ds.truncated,
        documents_without_target=ds.dropped,
    )


def _build_pairs(path: str, meta: dict, *, block_size: int, split: str, packing: str, pad_to: int | None):
    """A ``preference`` corpus: one pair per sample (data/preference.py)."""
    if packing != "documents":
        raise ConfigError(
            f"data.args.packing = {packing!r}: a preference corpus packs each pair into one row; drop data.args.packing"
        )
    unpaired = meta["document_format"] == "unpaired"
    pad_to = 8 if pad_to is None else pad_to
    if meta.get("images"):  # image-text pairs (data/image_rows.py): the pair's images with its row
        ds = ImagePreferencePairs(
            Documents(path, meta, split),
            **_image_arrays(path, meta, split),
            block_size=block_size,
            pad_to=pad_to,
            labels=unpaired,  # KTO's rows (data/images.py): the example and its KL row, the prompt's images on both
        )
    else:
        ds = PreferencePairs(Documents(path, meta, split), block_size=block_size, labels=unpaired, pad_to=pad_to)
    if len(ds) == 0:
        raise ConfigError(
            f"data.args: the {split} split of {path!r} has no pair with a target on both sides; prepare more pairs"
            + (" (or --val-fraction > 0)" if split == "val" else " or raise data.args.block_size")
        )
    ds.pairs_of_rows = True  # objectives/preference.py: a row is a pair, [chosen | rejected]
    return _describe(
        ds,
        meta,
        split=split,
        block_size=block_size,
        format=meta["document_format"],
        path=path,
        pairs=len(ds),
        truncated_pairs=ds.truncated,
        pairs_without_target=ds.dropped,
        pad_to=ds.pad_to,
    )


def _build_images(path: str, meta: dict, *, block_size: int, split: str, packing: str):
    """An image-text corpus: one conversation per row, padded, or conversations packed with their
    images (data/image_rows.py)."""
    ds = ImageConversations(
        Documents(path, meta, split),
        **_image_arrays(path, meta, split),
        split=split,
        block_size=block_size,
        packing=packing,
    )
    if len(ds) == 0:
        raise ConfigError(f"data.args: the {split} split of {path!r} has no conversation; prepare more rows")
    return _describe(ds, meta, split=split, block_size=block_size, packing=packing, path=path, rows=len(ds))


def _image_arrays(path: str, meta: dict, split: str) -> dict:
    """An image-text split's pixels, images per document, image shape and grids (Qwen2-VL's
    image_grid_thw, else None): the arguments ImageConversations and ImagePreferencePairs share."""
    entry = meta["splits"][split]
    counts = ShardedArray(path, entry["image_files"], "uint32")
    grids = _read_all(ShardedArray(path, entry["grid_files"], "uint32")) if meta["images"].get("grids") else None
    pixels = ShardedArray(path, entry["pixel_files"], "float32")
    return {
        "pixels": pixels,
        "image_counts": counts.read(0, len(counts)),
        "shape": meta["images"]["shape"],
        "grids": grids,
    }


def _read_all(array) -> np.ndarray:
    return array.read(0, len(array))


def _describe(ds, meta: dict, *, split: str, block_size: int, **fields):
    """``ds`` with the corpus's vocabulary, EOS and meta, and its description (``fields``, its path among them,
    after the split)."""
    ds.vocab_size, ds.eos_id, ds.meta = meta["vocab_size"], meta["eos_id"], {**meta, "path": fields["path"]}
    ds.description = {
        "name": "tokens",
        "split": split,
        **fields,
        "tokenizer": meta["tokenizer"]["spec"],
        "vocab_size": meta["vocab_size"],
        "block_size": block_size,
        "samples": len(ds),
    }
    return ds


# --- the model's vocabulary (for the launcher's preflight and the GPT builder) --------------------------


def model_vocab_size(model_args: dict, data_meta: dict) -> int:
    """model.args.vocab_size when set, else the tokenizer's (meta.json)."""
    return int(model_args.get("vocab_size") or data_meta["vocab_size"])


def check_vocab(model_args: dict, data_meta: dict) -> None:
    """A model vocabulary smaller than the tokenizer's would index out of the embedding: exit 2."""
    vocab = model_args.get("vocab_size")
    if vocab and vocab < data_meta["vocab_size"]:
        raise ConfigError(
            f"model.args.vocab_size = {vocab} is smaller than the tokenizer's vocabulary (data.args: meta.json"
            f" vocab_size = {data_meta['vocab_size']} in {data_meta.get('path', '?')}); raise model.args.vocab_size"
            " or remove it to take the tokenizer's"
        )


def tokens_meta(data_cfg) -> dict | None:
    """meta.json of the run's corpus when ``data.name = 'tokens'`` (built-in), else None."""
    if data_cfg.factory or data_cfg.name != "tokens":
        return None
    return corpus_meta(data_cfg.args.get("path", ""), data_cfg.args.get("sources"))


def resolve_model_vocab(model_cfg, data_cfg) -> None:
    """Preflight: check the vocabulary and give the built-in GPT the tokenizer's size if unset.

    Mutates ``model_cfg.args`` so the resolved config.toml records the size the model was built with.
    """
    meta = tokens_meta(data_cfg)
    if meta is None:
        return
    check_vocab(model_cfg.args, meta)
    if model_cfg.name == "gpt" and not model_cfg.hf and not model_cfg.factory and "vocab_size" not in model_cfg.args:
        model_cfg.args["vocab_size"] = model_vocab_size(model_cfg.args, meta)
