"""The tokens dataset (windows, checks, mixing, vocab) and the prefetching loader (0 vs N workers)."""

from __future__ import annotations

import os
import tomllib

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from paratrain.config import ConfigError, DataConfig, ModelConfig, load_config
from paratrain.data import prepare as prep
from paratrain.data.datasets import build_dataset, build_val_dataset
from paratrain.data.loader import StepLoader, StepSampler, build_loader
from paratrain.data.sampler import GlobalBatchSampler
from paratrain.data.tokens import (
    TokenMixture,
    build_tokens,
    check_vocab,
    mixture_table,
    model_vocab_size,
    resolve_model_vocab,
)
from paratrain.preflight import check_run
from paratrain.testing.corpus import read_split, stdlib_texts, write_corpus
from paratrain.testing.toy import ToyLM


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two byte-level corpora; the first in shards of 4 KiB so that windows span shard ends."""
    root = tmp_path_factory.mktemp("corpora")
    texts = stdlib_texts(40)
    a, b = str(root / "a"), str(root / "b")
    mp = pytest.MonkeyPatch()
    mp.setattr(prep, "SHARD_BYTES", 4096)
    prep.prepare(
        [write_corpus(root / "src_a", texts[:20])], out_dir=a, tokenizer="bytes", val_fraction=0.2, progress=False
    )
    mp.undo()
    prep.prepare([write_corpus(root / "src_b", texts[20:])], out_dir=b, tokenizer="bytes", progress=False)
    return a, b


def test_windows_are_shifted_slices_of_the_stream(corpora):
    a, _ = corpora
    stream = torch.from_numpy(read_split(a, "train").astype(np.int64))
    ds = build_dataset(DataConfig(name="tokens", args={"path": a, "block_size": 37}))
    assert len(ds.meta["splits"]["train"]["files"]) > 3  # several shards: windows cross their ends
    assert len(ds) == (len(stream) - 1) // 37 and ds.vocab_size == 256
    for i in range(len(ds)):
        x, y = ds[i]
        torch.testing.assert_close(x, stream[i * 37 : i * 37 + 37])
        torch.testing.assert_close(y, stream[i * 37 + 1 : i * 37 + 38])
    val = build_val_dataset(DataConfig(name="tokens", args={"path": a, "block_size": 8}), samples=5)
    assert len(val) == 5
    torch.testing.assert_close(val[0][0], torch.from_numpy(read_split(a, "val")[:8].astype(np.int64)))
    assert ds.description["tokenizer"] == "bytes" and ds.description["samples"] == len(ds)


def test_corpus_checks(tmp_path, corpora):
    src = write_corpus(tmp_path / "src", stdlib_texts(8))
    out = str(tmp_path / "c")
    prep.prepare([src], out_dir=out, tokenizer="bytes", val_fraction=0.0, progress=False)
    build_tokens(path=out, block_size=8)  # verifies once and remembers it
    assert os.path.isfile(os.path.join(out, "verified.json"))
    shard = os.path.join(out, "train-00000.bin")
    data = bytearray(open(shard, "rb").read())
    data[100] ^= 1  # same size, other bytes: only the checksum sees it
    open(shard, "wb").write(bytes(data))
    build_tokens(path=out, block_size=8, verify="size")
    with pytest.raises(ConfigError, match="SHA-256 disagrees"):
        build_tokens(path=out, block_size=8)  # the file changed since it was verified
    open(shard, "ab").write(b"xx")
    with pytest.raises(ConfigError, match="meta.json says"):
        build_tokens(path=out, block_size=8, verify="size")
    with pytest.raises(ConfigError, match="holds no prepared corpus"):
        build_tokens(path=str(tmp_path), block_size=8)
    with pytest.raises(ConfigError, match="fewer than block_size"):
        build_tokens(path=corpora[0], block_size=10**9)
    with pytest.raises(ConfigError, match="no validation set"):
        build_val_dataset(DataConfig(factory="paratrain.testing.toy:toy_lm"), samples=4)
    with pytest.raises(ConfigError, match="weight"):
        build_tokens(sources=[{"path": corpora[0], "weight": 0}], block_size=8)


def test_mixture_is_proportional_and_a_pure_function():
    src, local = mixture_table([5, 1000], [0.7, 0.3], 1000)
    counts = np.cumsum(np.stack([src == 0, src == 1]), axis=1)  # prefix counts of each source
    n = np.arange(1, 1001)
    assert np.all(np.abs(counts[0] - 0.7 * n) <= 1) and np.all(np.abs(counts[1] - 0.3 * n) <= 1)
    assert set(local[src == 0].tolist()) == set(range(5))  # the small source is up-sampled (wraps)
    assert local[src == 1].tolist() == list(range(300))  # each source in its own order
    src2, local2 = mixture_table([5, 1000], [0.7, 0.3], 1000)
    assert np.array_equal(src, src2) and np.array_equal(local, local2)
    three, _ = mixture_table([10, 10, 10], [1, 2, 1], 400)
    assert np.bincount(three).tolist() == [100, 200, 100]


def test_mixed_dataset_takes_windows_from_its_sources(corpora):
    a, b = corpora
    ds = build_tokens(sources=[{"path": a, "weight": 0.7}, {"path": b, "weight": 0.3}], block_size=16)
    assert isinstance(ds, TokenMixture) and len(ds) == len(ds.parts[0]) + len(ds.parts[1])
    for i in range(0, len(ds), 7):
        k, j = int(ds._source[i]), int(ds._local[i])
        torch.testing.assert_close(ds[i], ds.parts[k][j])
    share = np.mean(ds._source == 0)
    assert abs(share - 0.7) < 0.01


def test_vocab_checks(corpora):
    meta = {"vocab_size": 4096, "path": "data/x"}
    assert model_vocab_size({}, meta) == 4096 and model_vocab_size({"vocab_size": 5000}, meta) == 5000
    check_vocab({"vocab_size": 4096}, meta)
    with pytest.raises(ConfigError) as e:
        check_vocab({"vocab_size": 256}, meta)
    assert "model.args.vocab_size = 256" in str(e.value) and "vocab_size = 4096" in str(e.value)
    model = ModelConfig(name="gpt", args={"n_layer": 1})
    resolve_model_vocab(model, DataConfig(name="tokens", args={"path": corpora[0], "block_size": 8}))
    assert model.args["vocab_size"] == 256
    # model.hf keeps its own embedding: a tokenizer smaller than it (Qwen2.5's 151665 tokens for
    # 151936 rows) must not shrink the model, whose weights would then not load.
    hf = ModelConfig(hf="some/dir")
    resolve_model_vocab(hf, DataConfig(name="tokens", args={"path": corpora[0], "block_size": 8}))
    assert "vocab_size" not in hf.args
    # Wired into the preflight that every command runs (preflight.check_run).
    data = ["data.name='tokens'", f"data.args={{path='{corpora[0]}', block_size=8}}"]
    cfg = load_config(None, [*data, "model.args={n_layer=1, block_size=8}"])
    check_run(cfg, 1)
    assert cfg.model.args["vocab_size"] == 256
    with pytest.raises(ConfigError, match="model.args.vocab_size = 100 is smaller"):
        check_run(load_config(None, [*data, "model.args={n_layer=1, block_size=8, vocab_size=100}"]), 1)


def _inline(ds, sampler: StepSampler) -> list:
    return [[default_collate([ds[i] for _, i in mb]) for mb in step] for step in sampler]  # (epoch, index)


@pytest.mark.parametrize("kind", ["tokens", "toy"])
def test_loader_workers_give_the_inline_batches(corpora, kind):
    torch.set_num_threads(1)
    ds = build_tokens(path=corpora[0], block_size=16) if kind == "tokens" else ToyLM(n=50)

    def steps(start_step: int, n: int, dp_rank: int) -> StepSampler:
        return StepSampler(
            GlobalBatchSampler(len(ds), seed=3),
            start=start_step * 12,
            steps=n,
            global_batch_size=12,
            micro_batch_size=3,
            dp_rank=dp_rank,
            dp=2,
        )

    want = _inline(ds, steps(0, 9, dp_rank=1))  # crosses an epoch of the toy set
    rng = torch.get_rng_state()
    got0 = list(build_loader(ds, steps(0, 9, dp_rank=1), workers=0))
    got2 = list(build_loader(ds, steps(0, 9, dp_rank=1), workers=2, prefetch=2))
    resumed = list(build_loader(ds, steps(4, 5, dp_rank=1), workers=2))  # resume = start at another step
    assert torch.equal(torch.get_rng_state(), rng)  # the loader never draws from the global RNG
    for got, ref in ((got0, want), (got2, want), (resumed, want[4:])):
        assert len(got) == len(ref)
        for g, w in zip(got, ref):
            assert len(g) == len(w) == 2  # two micro-batches of 3 per rank and step
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_train_then_generate_decodes_with_the_corpus_tokenizer(tmp_path, corpora):
    from paratrain.generate import generate_text
    from paratrain.testing.dist_utils import run_ranks, train_rank

    src = write_corpus(tmp_path / "src", stdlib_texts(12))
    corpus = str(tmp_path / "bpe")
    prep.prepare([src], out_dir=corpus, tokenizer="bpe:300", val_fraction=0.0, progress=False)
    out = str(tmp_path / "run")
    overrides = [
        f"run.out_dir='{out}'",
        "run.steps=2",
        "model.args={n_layer=1, n_head=2, d_model=16, block_size=16}",  # vocab_size: meta.json's
        "data.name='tokens'",
        f"data.args={{path='{corpus}', block_size=16}}",
        "batch.global_batch_size=4",
    ]
    summary = run_ranks(train_rank, 1, overrides)[0]
    assert summary["data"]["tokenizer"] == "bpe:300"  # the run records the tokenizer
    with open(os.path.join(out, "config.toml"), "rb") as f:
        assert tomllib.load(f)["model"]["args"]["vocab_size"] == 300  # and the vocabulary it took
    text = generate_text(out, "def ", max_new_tokens=8)
    assert text.startswith("def ")


def test_step_loader_follows_position_and_batch_size_changes():
    ds = ToyLM(n=40)
    sampler = GlobalBatchSampler(len(ds), seed=1)
    calls = [(0, 8, 2), (8, 8, 2), (16, 8, 4), (24, 12, 3), (36, 12, 3), (48, 12, 3), (12, 8, 2)]  # resize, rewind
    inline = StepLoader(ds, sampler, dp_rank=1, dp=2, workers=0)
    pooled = StepLoader(ds, GlobalBatchSampler(len(ds), seed=1), dp_rank=1, dp=2, workers=2)
    for pos, gbs, mbs in calls:
        want = inline.batches(pos, gbs, mbs)
        assert len(want) == gbs // 2 // mbs
        torch.testing.assert_close(pooled.batches(pos, gbs, mbs), want, rtol=0, atol=0)
    pooled.close()
