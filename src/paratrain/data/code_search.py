"""Code search on the Python standard library: each function's docstring is a query, its body the
document to find. Every machine with Python has it, so the example needs no download.

The functions with a docstring of at least ``min_doc`` characters are read from the standard
library's own source files (test suites excluded, sorted order, ``ast``). The query is the
docstring's first paragraph; the document is the function without its docstring, as ``ast``
prints it (``def name(args):`` and the body, comments dropped). A function whose qualified
name's CRC-32 is 0 mod 10 is held out (``split = "val"``): about a tenth, the same on every
machine with the same Python. Queries that repeat (``Return self.``) are kept once, the first.

A sample is ``([2, seq_len] byte ids, 0)``: the query's UTF-8 bytes then the document's, each cut
to ``seq_len`` and filled up with ``PAD`` (256; the vocabulary is 257). The target is unused: the
right document of query ``i`` is sample ``i``'s (in-batch negatives, objectives/batch_loss.py).
"""

from __future__ import annotations

import ast
import hashlib
import os
import zlib
from functools import lru_cache

import torch
from torch.utils.data import Dataset

from paratrain.config import ConfigError
from paratrain.data.stdlib_bytes import stdlib_files

PAD = 256
VOCAB = 257


@lru_cache(maxsize=2)  # the train and val splits parse the same files (about 5 s)
def stdlib_functions(min_doc: int = 20, max_files: int = 0) -> tuple[tuple[str, str, str], ...]:
    """``(qualified name, query, document)`` of the standard library's documented functions."""
    out, seen, files = [], set(), 0
    for root, path in stdlib_files():
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        files += 1
        module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < min_doc or len(node.body) < 2:
                continue
            query = doc.split("\n\n")[0].replace("\n", " ").strip()
            if query in seen:
                continue
            seen.add(query)
            node.body = node.body[1:]  # the docstring is the query, not part of the document
            node.decorator_list = []
            out.append((f"{module}.{node.name}:{node.lineno}", query, ast.unparse(node)))
        if max_files and files >= max_files:
            break
    return tuple(out)


def encode(text: str, length: int) -> torch.Tensor:
    ids = list(text.encode("utf-8")[:length])
    return torch.tensor(ids + [PAD] * (length - len(ids)), dtype=torch.long)


class CodeSearch(Dataset):
    """The ``split`` of the documented functions (module docstring)."""

    draws_random = False  # paratrain/randomness.py: no sample_rng around __getitem__

    def __init__(self, seq_len: int = 128, split: str = "train", min_doc: int = 20, max_files: int = 0):
        if split not in ("train", "val"):
            raise ConfigError(f"data.args.split = {split!r} is not a split of code_search; use 'train' or 'val'")
        held_out = split == "val"
        self.items = [
            (q, d)
            for name, q, d in stdlib_functions(min_doc, max_files)
            if (zlib.crc32(name.encode()) % 10 == 0) == held_out
        ]
        self.seq_len = seq_len
        digest = hashlib.sha256("\0".join(q + "\0" + d for q, d in self.items).encode()).hexdigest()
        self.description = {"name": "code_search", "split": split, "functions": len(self.items), "sha256": digest}

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        query, document = self.items[i]
        return torch.stack([encode(query, self.seq_len), encode(document, self.seq_len)]), torch.tensor(0)


def code_search(seq_len: int = 128, split: str = "train", min_doc: int = 20, max_files: int = 0) -> CodeSearch:
    return CodeSearch(seq_len, split, min_doc, max_files)
