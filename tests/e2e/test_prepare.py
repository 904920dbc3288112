"""`paratrain prepare`: exact streams, deterministic bytes, stable split, workers, bad input exit 2."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from paratrain.cli import main as cli_main
from paratrain.config import ConfigError
from paratrain.data import prepare as prep
from paratrain.data.prepare import load_tokenizer, prepare, split_of
from paratrain.testing.corpus import read_split, stdlib_texts, write_corpus
from paratrain.testing.dist_utils import REPO, paratrain_cli


def docs_of(stream: np.ndarray, eos: int = 0) -> list[bytes]:
    ends = np.flatnonzero(stream == eos)
    assert len(ends) and ends[-1] == len(stream) - 1  # every document ends with EOS
    return [stream[a + 1 if j else 0 : b].astype(np.uint8).tobytes() for j, (a, b) in enumerate(zip([0, *ends], ends))]


def digest(out_dir: str) -> dict:
    return {
        n: hashlib.sha256(open(os.path.join(out_dir, n), "rb").read()).hexdigest()
        for n in sorted(os.listdir(out_dir))
        if n != "verified.json"
    }


def test_bytes_streams_are_the_documents_in_order(tmp_path):
    texts = stdlib_texts(24)
    src = write_corpus(tmp_path / "src", texts)
    meta = prepare([src], out_dir=str(tmp_path / "out"), tokenizer="bytes", val_fraction=0.3, progress=False)
    # The order prepare reads: files sorted; the .txt files, b.md, then c.jsonl and d.jsonl.gz.
    k = len(texts) // 4
    ordered = texts[:k] + [texts[k]] + texts[k + 1 : 2 * k] + texts[2 * k :]
    want = {s: [t.encode() for t in ordered if split_of(t, 0.3) == s] for s in ("train", "val")}
    assert want["val"] and want["train"]
    for s in ("train", "val"):
        assert docs_of(read_split(str(tmp_path / "out"), s)) == want[s]
        assert meta["splits"][s]["documents"] == len(want[s])
        assert meta["splits"][s]["tokens"] == sum(len(d) + 1 for d in want[s])
    assert (meta["dtype"], meta["vocab_size"], meta["eos_id"]) == ("uint16", 256, 0)
    for f in meta["splits"]["train"]["files"]:  # size and sha256 of every file
        path = tmp_path / "out" / f["name"]
        assert f["bytes"] == os.path.getsize(path) and f["sha256"] == prep.file_sha256(str(path))


def test_bpe_rerun_and_workers_give_the_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "CHUNK_BYTES", 5000)  # many chunks in flight across the workers
    src = write_corpus(tmp_path / "src", stdlib_texts(40))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    kw = dict(tokenizer="bpe:300", val_fraction=0.2, progress=False)
    meta = prepare([src], out_dir=a, workers=1, **kw)
    first = digest(a)
    prepare([src], out_dir=a, workers=1, **kw)  # rerun in place: same bytes
    assert digest(a) == first
    prepare([src], out_dir=b, workers=2, **kw)  # two tokenising processes: same bytes
    assert digest(b) == first
    assert meta["vocab_size"] == 300 and meta["tokenizer"]["kind"] == "huggingface"
    # The tokenizer saved with the corpus decodes the stream back to the documents.
    tok = load_tokenizer(a)
    stream = read_split(a, "train")
    ends = np.flatnonzero(stream == tok.eos_id)
    first_doc = tok.decode(stream[: ends[0]].tolist())
    assert first_doc in stdlib_texts(40) and tok.encode(first_doc) == stream[: ends[0]].tolist()


def test_local_tokenizer_json_and_uint32(tmp_path):
    src = write_corpus(tmp_path / "src", stdlib_texts(12))
    prepare([src], out_dir=str(tmp_path / "bpe"), tokenizer="bpe:280", progress=False)
    meta = prepare(
        [src], out_dir=str(tmp_path / "hf"), tokenizer=str(tmp_path / "bpe"), val_fraction=0.0, progress=False
    )
    assert meta["tokenizer"]["sha256"] == prep.file_sha256(str(tmp_path / "bpe" / "tokenizer.json"))
    assert np.array_equal(read_split(str(tmp_path / "hf"), "train"), read_split(str(tmp_path / "bpe"), "train"))
    # An EOS id past 65535 needs uint32.
    meta = prepare([src], out_dir=str(tmp_path / "wide"), tokenizer="bytes", eos=70000, progress=False)
    assert (meta["dtype"], meta["vocab_size"]) == ("uint32", 70001)


def test_split_is_stable_when_files_are_added(tmp_path):
    texts = stdlib_texts(60)
    small = write_corpus(tmp_path / "small", texts[:30])
    big = write_corpus(tmp_path / "big", texts[:30])
    for i, t in enumerate(texts[30:]):
        open(os.path.join(big, f"z{i:03d}.txt"), "w").write(t)
    kw = dict(tokenizer="bytes", val_fraction=0.25, progress=False)
    prepare([small], out_dir=str(tmp_path / "o1"), **kw)
    prepare([big], out_dir=str(tmp_path / "o2"), **kw)
    val1, val2 = (set(docs_of(read_split(str(tmp_path / o), "val"))) for o in ("o1", "o2"))
    train1, train2 = (set(docs_of(read_split(str(tmp_path / o), "train"))) for o in ("o1", "o2"))
    assert val1 and val1 <= val2 and train1 <= train2 and not (val2 & train1)


def test_half_written_corpus_is_not_complete(tmp_path, monkeypatch):
    src = write_corpus(tmp_path / "src", stdlib_texts(8))
    out = str(tmp_path / "out")
    prepare([src], out_dir=out, tokenizer="bytes", progress=False)

    def boom(*a, **k):
        raise RuntimeError("killed")

    monkeypatch.setattr(prep, "write_json_atomic", boom)  # dies just before the marker
    with pytest.raises(RuntimeError):
        prepare([src], out_dir=out, tokenizer="bytes", progress=False)
    assert not os.path.exists(os.path.join(out, "meta.json"))
    from paratrain.data.tokens import build_tokens

    with pytest.raises(ConfigError, match="holds no prepared corpus"):
        build_tokens(path=out, block_size=8)


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = stdlib_texts(10)
    pq.write_table(pa.table({"body": texts}), str(tmp_path / "c.parquet"))
    meta = prepare(
        [str(tmp_path / "c.parquet")],
        out_dir=str(tmp_path / "out"),
        tokenizer="bytes",
        text_field="body",
        val_fraction=0.0,
        progress=False,
    )
    assert docs_of(read_split(str(tmp_path / "out"), "train")) == [t.encode() for t in texts]
    assert meta["splits"]["train"]["documents"] == 10


def _bad_inputs(tmp_path) -> list[tuple[list[str], str]]:
    src = write_corpus(tmp_path / "src", stdlib_texts(8))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    (tmp_path / "tok.json").write_text("{not a tokenizer")
    other = tmp_path / "other"
    prepare([src], out_dir=str(other), tokenizer="bytes", progress=False)
    out = ["--out", str(tmp_path / "o"), "--tokenizer", "bytes"]
    return [
        (["prepare", str(tmp_path / "missing.txt"), *out], "no such file or directory"),
        (["prepare", str(tmp_path / "empty"), *out], "empty corpus"),
        (["prepare", str(tmp_path / "bad.jsonl"), *out], "bad.jsonl:2: no string field 'text'"),
        (["prepare", src, "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "tok.json")], "is unreadable"),
        (
            ["prepare", src, "--out", str(other), "--tokenizer", "bpe:300"],
            "holds a different corpus (prepared with --tokenizer bytes there, bpe:300 in this command)",
        ),
        (
            ["prepare", src, "--out", str(other), "--tokenizer", "bytes", "--val-fraction", "0.2"],
            "holds a different corpus (prepared with --val-fraction 0.005 there, 0.2 in this command); choose another",
        ),
        (["prepare", src, *out, "--tokenizer", "bpe:100"], "VOCAB >= 257"),
        (["prepare", src, "--out", src, "--tokenizer", "bytes"], "is not empty and holds no prepared corpus"),
    ]


def test_bad_input_exit_2_one_line(tmp_path, capsys):
    for argv, needle in _bad_inputs(tmp_path):
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert os.path.isfile(tmp_path / "other" / "meta.json")  # the refused corpus is untouched


def test_prepare_of_text_never_imports_torch(tmp_path):
    """`paratrain prepare` of text needs neither torch nor the trainer (about 4 s of CPU to import):
    the CLI imports each subcommand's modules when it runs (cli.py's docstring)."""
    src = write_corpus(tmp_path / "src", stdlib_texts(8))
    code = (
        "import sys; from paratrain.cli import main;"
        f" rc = main(['prepare', {src!r}, '--out', {str(tmp_path / 'o')!r}, '--tokenizer', 'bytes']);"
        " sys.exit(3 if 'torch' in sys.modules else rc)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_cli_prepare_subprocess(tmp_path):
    src = write_corpus(tmp_path / "src", stdlib_texts(8))
    res = paratrain_cli("prepare", src, "--out", str(tmp_path / "o"), "--tokenizer", "bytes")
    assert res.returncode == 0 and "prepared 8 documents" in res.stdout, res.stderr
    res = paratrain_cli("prepare", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--tokenizer", "bytes")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "no such file" in res.stderr


def test_prepare_of_chat_never_imports_torch(tmp_path):
    """A tokenizer-only directory naming transformers' generic backend loads without
    ``AutoTokenizer``, whose module imports torch (1-2 s of CPU before the first row, issue 21):
    `paratrain prepare --format chat` then imports no more than text does. With one worker the
    worker's tokenizer (prepare's saved copy, hf_tokenizer/) loads in this process too."""
    from paratrain.testing.sft_data import save_chat_tokenizer, stdlib_conversations, write_jsonl

    tok = save_chat_tokenizer(str(tmp_path / "tok"))
    rows = write_jsonl(str(tmp_path / "chat.jsonl"), stdlib_conversations(8))
    out = str(tmp_path / "o")
    code = (
        "import sys; from paratrain.cli import main;"
        f" rc = main(['prepare', {rows!r}, '--out', {out!r}, '--tokenizer', {tok!r}, '--format', 'chat',"
        " '--workers', '1']);"
        " sys.exit(3 if 'torch' in sys.modules else rc)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
    assert os.path.exists(os.path.join(out, "meta.json"))


def test_chat_tokenizer_is_the_class_autotokenizer_picks(tmp_path):
    """Without AutoTokenizer only where it cannot choose otherwise: the same class, and the same
    bytes as through AutoTokenizer (a model directory: its config.json sends the load there)."""
    from transformers import AutoTokenizer

    from paratrain.data.chat import _tokenizer_class, load_chat_tokenizer
    from paratrain.testing.sft_data import save_chat_tokenizer, stdlib_conversations, write_jsonl

    tok = save_chat_tokenizer(str(tmp_path / "tok"))
    model_dir = save_chat_tokenizer(str(tmp_path / "model"))
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "vocab_size": 259}, f)
    legacy = save_chat_tokenizer(str(tmp_path / "legacy"))  # the name transformers 4 wrote
    with open(os.path.join(legacy, "tokenizer_config.json")) as f:
        declared = json.load(f)
    with open(os.path.join(legacy, "tokenizer_config.json"), "w") as f:
        json.dump({**declared, "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    assert _tokenizer_class(model_dir) is AutoTokenizer
    for path in (tok, legacy):
        assert _tokenizer_class(path).__name__ == "TokenizersBackend"
        assert type(load_chat_tokenizer(path)) is type(AutoTokenizer.from_pretrained(path))
    rows = write_jsonl(str(tmp_path / "chat.jsonl"), stdlib_conversations(8))
    for name, path in (("a", tok), ("b", model_dir)):
        prepare([rows], out_dir=str(tmp_path / name), tokenizer=path, fmt="chat", val_fraction=0, progress=False)
    for shard in ("train-00000.bin", "train-mask-00000.bin", "train-docs-00000.bin"):
        with open(tmp_path / "a" / shard, "rb") as a, open(tmp_path / "b" / shard, "rb") as b:
            assert a.read() == b.read(), shard


def _sigterm_disposition(_chunk):
    import signal

    return signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_workers_end_when_the_parent_holds_a_flag_only_sigterm_handler(tmp_path):
    """A process that trained before it prepares (a test session, a notebook) holds paratrain's
    preemption handler, which only sets a flag. Forked workers inherited it; when the pool's exit
    finds them blocked on its queue's lock it stops them with SIGTERM, which they then survived,
    and its join hung (seen once in `make test`). Each worker starts with SIGTERM's default."""
    import signal

    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        got = list(
            prep.encoded_chunks(
                iter([1, 2, 3, 4]), workers=2, init=lambda: None, init_args=(), fn=_sigterm_disposition, args=()
            )
        )
        src = write_corpus(tmp_path / "src", stdlib_texts(8))
        prepare([src], out_dir=str(tmp_path / "out"), workers=2, tokenizer="bpe:300", progress=False)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert got == [True] * 4
