"""Plain-text corpora of standard-library sources in every format `paratrain prepare` reads, and
a prepared split read back (the prepare and token-stream tests)."""

from __future__ import annotations

import gzip
import json
import os
import sysconfig

import numpy as np


def stdlib_texts(n: int, size: int = 3000) -> list[str]:
    """n real documents: slices of standard-library sources (on every machine, no download)."""
    root = sysconfig.get_paths()["stdlib"]
    text = "".join(open(os.path.join(root, name), encoding="utf-8").read() for name in ("json/decoder.py", "glob.py"))
    return [text[(i * 997) % (len(text) - size) :][: size - i] + f"\n# doc {i}\n" for i in range(n)]


def write_corpus(root, texts: list[str]) -> str:
    """Plain files, a .md, a .jsonl and a .jsonl.gz: all the kinds a directory may hold."""
    os.makedirs(root, exist_ok=True)
    k = len(texts) // 4
    for i, t in enumerate(texts[:k]):
        open(os.path.join(root, f"a{i:03d}.txt"), "w").write(t)
    open(os.path.join(root, "b.md"), "w").write(texts[k])
    with open(os.path.join(root, "c.jsonl"), "w") as f:
        for t in texts[k + 1 : 2 * k]:
            f.write(json.dumps({"text": t, "id": 1}) + "\n")
    with gzip.open(os.path.join(root, "d.jsonl.gz"), "wt") as f:
        for t in texts[2 * k :]:
            f.write(json.dumps({"text": t}) + "\n")
    return str(root)


def read_split(out_dir: str, split: str) -> np.ndarray:
    meta = json.load(open(os.path.join(out_dir, "meta.json")))
    files = meta["splits"][split]["files"]
    return np.concatenate([np.fromfile(os.path.join(out_dir, f["name"]), dtype=meta["dtype"]) for f in files])
