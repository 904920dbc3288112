"""Context parallelism (docs/context-parallel.md, issue 23).

The attention alone is anchored to code we did not write: for random q/k/v, and random packed
documents, the ring attention's output and the gradients of q, k and v at cp = 2 and 4 equal
``torch.nn.functional.scaled_dot_product_attention`` over the whole sequence, with the boolean
mask built here from document ids (not from paratrain's position rule). A missing log-sum-exp
rescale, a chunk pair skipped wrongly or query positions not offset per chunk each fail it.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from paratrain.distributed.context_parallel import global_indices, shard_sequence, unshard_sequence
from paratrain.testing.cp_auto import count_auto_rank
from paratrain.testing.dist_utils import plain_sgd, read_metrics, run_ranks
from paratrain.testing.sft import sft_gpt

B, H, T, D = 2, 4, 24, 8  # T divisible by 2 x 4, H by 4 (all-to-all)


def _case(seed: int, packed: bool):
    """Random q, k, v, d_out (B, H, T, D) and, when ``packed``, per-row documents: their
    position ids (restart at 0, padding -1 at the end) and the reference mask from document ids."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    if not packed:
        return q, k, v, dout, None, None
    positions = torch.full((B, T), -1, dtype=torch.long)
    doc = torch.empty(B, T, dtype=torch.long)
    for b in range(B):
        at, d = 0, 0
        real = T - int(torch.randint(0, 4, (1,), generator=g))  # some padding at the end
        while at < real:
            n = min(int(torch.randint(1, 9, (1,), generator=g)), real - at)
            positions[b, at : at + n] = torch.arange(n)
            doc[b, at : at + n] = d
            at, d = at + n, d + 1
        doc[b, real:] = torch.arange(d, d + T - real)  # each padding token a document of its own
    i = torch.arange(T)
    mask = (doc.unsqueeze(-1) == doc.unsqueeze(-2)) & (i.view(1, 1, T) <= i.view(1, T, 1))
    return q, k, v, dout, positions, mask.unsqueeze(1)


def _reference(q, k, v, dout, mask):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _ring_rank(cases):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from paratrain.distributed.context_parallel import ATTENTIONS, one_document_rows

    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    results = []
    for seed, packed, kind in cases:
        attention = ATTENTIONS[kind.removesuffix("_decided")](mesh)
        q, k, v, dout, positions, _ = _case(seed, packed)
        if kind == "auto_decided":  # as the step does: decided from the whole rows, plain ones with positions
            positions = torch.arange(T).expand(B, T) if positions is None else positions
            attention.rows_plain = bool(one_document_rows(positions).all())
        local = [shard_sequence(t, dim=2, cp=cp, rank=rank).requires_grad_() for t in (q, k, v)]
        pos = None if positions is None else shard_sequence(positions, dim=1, cp=cp, rank=rank)
        out = attention(*local, positions=pos)
        out.backward(shard_sequence(dout, dim=2, cp=cp, rank=rank))
        # numpy: a tensor would cross the queue as shared memory the exiting rank takes with it
        results.append([t.numpy() for t in (out.detach(), *(t.grad for t in local))])
    dist.destroy_process_group()
    return results


def test_split_is_head_tail_and_inverts():
    x = torch.arange(16)
    parts = [shard_sequence(x, dim=0, cp=4, rank=r) for r in range(4)]
    assert parts[0].tolist() == [0, 1, 14, 15] and parts[3].tolist() == [6, 7, 8, 9]
    assert torch.equal(unshard_sequence(parts, dim=0), x)
    assert torch.equal(global_indices(4, cp=4, rank=1), parts[1])


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_attention_equals_sdpa_on_the_whole_sequence(cp):
    """Ring, all-to-all and auto (all-to-all for the causal rows, the ring for packed documents),
    undecided (the cp ranks agree per call) and decided from the whole rows (as the step does),
    causal and two sets of packed documents: output and q/k/v gradients."""
    kinds = ("ring", "alltoall", "auto", "auto_decided")
    cases = [(s, packed, kind) for kind in kinds for s, packed in ((0, False), (1, True), (2, True))]
    per_rank = run_ranks(_ring_rank, cp, cases)
    for c, (seed, packed, kind) in enumerate(cases):
        q, k, v, dout, _, mask = _case(seed, packed)
        want = _reference(q, k, v, dout, mask)
        for name, w, parts in zip(("out", "dq", "dk", "dv"), want, zip(*(r[c] for r in per_rank)), strict=True):
            got = unshard_sequence([torch.from_numpy(p) for p in parts], dim=2)
            torch.testing.assert_close(
                got, w, rtol=1e-5, atol=1e-5, msg=lambda m, n=name, s=seed, a=kind: f"{a} {n} seed {s}: {m}"
            )


def test_empty_chunk_pairs_are_skipped_and_the_work_is_even():
    """Causal, cp = 2 (4 chunks): of the 16 (query chunk, key chunk) pairs the 10 with the key
    chunk at or before the query chunk are computed, 5 on each rank (the head-tail balance)."""
    from paratrain.distributed.context_parallel import _pairs

    cp, t = 2, 8
    per_rank = []
    for rank in range(cp):
        q_idx = global_indices(t, cp=cp, rank=rank)
        start = torch.zeros(1, t, dtype=torch.long)
        per_rank.append(sum(len(list(_pairs(q_idx, start, global_indices(t, cp=cp, rank=s)))) for s in range(cp)))
    assert per_rank == [5, 5]


# ----------------------------------------------------------------------------- the GPT at cp > 1

TOY = [
    "model.args={n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32}",
    "data.factory='paratrain.testing.toy:toy_lm'",
    "data.args={n = 64, seq_len = 16, vocab = 32}",
    "batch.global_batch_size=4",
    "run.steps=3",
    "run.progress=false",
    "metrics.plot=false",
    "checkpoint.interval=0",
    *plain_sgd(0.3),
]


def _norms_and_losses(out_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    rows = read_metrics(out_dir)
    return torch.tensor([r["loss"] for r in rows]), torch.tensor([r["grad_norm"] for r in rows])


def _train_many(runs: dict[str, list[str]]) -> None:
    import torch.distributed as dist

    import paratrain

    dist.init_process_group("gloo")
    try:
        for overrides in runs.values():
            paratrain.train(paratrain.load_config(None, overrides))
    finally:
        dist.destroy_process_group()


def _assert_same(got, want, name):
    for what, g, w in zip(("loss", "grad_norm"), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=0, msg=lambda m, n=name, x=what: f"{n} {x}: {m}")


def test_gpt_at_cp2_equals_one_process(tmp_path):
    """Causal GPT, cp = 2 at world 2 (FSDP2 over the cp ranks): losses and grad_norm of one process."""
    import paratrain

    ref = str(tmp_path / "ref")
    paratrain.train(paratrain.load_config(None, [*TOY, f"run.out_dir='{ref}'"]))
    run_ranks(_train_many, 2, {"cp2": [*TOY, "parallel.cp=2", f"run.out_dir='{tmp_path / 'cp2'}'"]})
    _assert_same(_norms_and_losses(str(tmp_path / "cp2")), _norms_and_losses(ref), "cp2")


def test_auto_attention_is_decided_once_per_micro_batch_without_a_collective(tmp_path):
    """parallel.cp_attention = 'auto' with position ids at cp = 2: the step decides from the whole
    rows, so no attention layer all-reduces (a 1-layer and a 2-layer model make the same number of
    all-reduces per run) and the choice is today's: all-to-all for one-document rows, the ring for
    packed rows that look like one document on one cp rank only. 2 steps x 2 micro-batches."""
    base = [
        "data.factory='paratrain.testing.cp_auto:position_rows'",
        "batch.global_batch_size=4",
        "batch.micro_batch_size=2",
        "run.steps=2",
        "run.progress=false",
        "metrics.plot=false",
        "checkpoint.interval=0",
        "parallel.cp=2",
        *plain_sgd(0.3),
    ]

    def run(name, layers, packed):
        model = f"model.args={{n_layer = {layers}, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32}}"
        data = f"data.args={{n = 16, packed = {str(packed).lower()}}}"
        return [*base, model, data, f"run.out_dir='{tmp_path / name}'"]

    runs = {"plain_1": run("plain_1", 1, False), "packed_2": run("packed_2", 2, True)}
    for rank, counts in enumerate(run_ranks(count_auto_rank, 2, runs, timeout=100)):
        plain, packed = counts["plain_1"], counts["packed_2"]
        calls = 2 * 2  # attention calls per layer: steps x micro-batches, forward
        assert (plain.get("alltoall_attention"), plain.get("ring_attention")) == (calls, None), (rank, plain)
        assert (packed.get("ring_attention"), packed.get("alltoall_attention")) == (2 * calls, None), (rank, packed)
        assert "all_reduce_in_attention" not in plain and "all_reduce_in_attention" not in packed, (rank, counts)
        assert plain["all_reduce"] == packed["all_reduce"], (rank, counts)  # none per layer


PP = ["parallel.pp_schedule='1f1b'", "batch.micro_batch_size=4", "parallel.pp_microbatches=2"]


@pytest.mark.slow
def test_gpt_at_cp4_and_composed_layouts_equal_one_process(tmp_path, sft, gpt_reference):
    """World 4: the causal GPT at cp = 4; packed documents (the SFT data path: a document mask
    per chunk pair, positions restarting per document) at cp = 4 and at cp = 2 x dp_shard = 2."""
    import paratrain

    ref = str(tmp_path / "ref")
    paratrain.train(paratrain.load_config(None, [*TOY, f"run.out_dir='{ref}'"]))
    runs = {
        "toy_cp4": [*TOY, "parallel.cp=4", f"run.out_dir='{tmp_path / 'toy_cp4'}'"],
        "toy_cp2_hsdp": [*TOY, "parallel.cp=2", f"run.out_dir='{tmp_path / 'toy_cp2_hsdp'}'"],  # dp_replicate 2
        "toy_cp2_tp2": [*TOY, "parallel.cp=2", "parallel.tp=2", f"run.out_dir='{tmp_path / 'toy_cp2_tp2'}'"],
        "toy_cp2_pp2": [*TOY, "parallel.cp=2", "parallel.pp=2", *PP, f"run.out_dir='{tmp_path / 'toy_cp2_pp2'}'"],
        "sft_cp2_pp2": sft_gpt(sft, "sft_cp2_pp2", "parallel.cp=2", "parallel.pp=2", *PP),
        "sft_cp4": sft_gpt(sft, "sft_cp4", "parallel.cp=4", "batch.micro_batch_size=4"),
        "sft_cp4_a2a": sft_gpt(sft, "sft_cp4_a2a", "parallel.cp=4", "parallel.cp_attention='alltoall'"),
        "sft_cp2_fsdp2": sft_gpt(
            sft, "sft_cp2_fsdp2", "parallel.cp=2", "parallel.dp_shard=2", "batch.micro_batch_size=2"
        ),
    }
    run_ranks(_train_many, 4, runs, timeout=600)
    for name in ("toy_cp4", "toy_cp2_hsdp", "toy_cp2_tp2", "toy_cp2_pp2"):
        _assert_same(_norms_and_losses(str(tmp_path / name)), _norms_and_losses(ref), name)
    for name in ("sft_cp4", "sft_cp4_a2a", "sft_cp2_fsdp2", "sft_cp2_pp2"):
        _assert_same(_norms_and_losses(os.path.join(sft["root"], name)), gpt_reference, name)


@pytest.mark.slow  # world 8 on this machine's two cores
def test_gpt_at_hsdp_over_dp_shard_and_cp_equals_one_process(tmp_path):
    """dp_replicate 2 x dp_shard 2 x cp 2 (world 8): HSDP over dp_replicate x (dp_shard x cp), the
    2-D FSDP2 mesh whose shard dimension is dp_shard x cp flattened; two steps equal one process."""
    import paratrain

    short = [*TOY, "run.steps=2"]
    ref = str(tmp_path / "ref")
    paratrain.train(paratrain.load_config(None, [*short, f"run.out_dir='{ref}'"]))
    layout = ["parallel.cp=2", "parallel.dp_replicate=2", "parallel.dp_shard=2"]
    run_ranks(_train_many, 8, {"hsdp": [*short, *layout, f"run.out_dir='{tmp_path / 'hsdp'}'"]}, timeout=600)
    _assert_same(_norms_and_losses(str(tmp_path / "hsdp")), _norms_and_losses(ref), "hsdp dp_shard x cp")


@pytest.mark.slow  # about 50 s: compiling the blocks in two ranks
def test_compiled_gpt_at_cp2_equals_one_process(tmp_path):
    """train.compile with the ring (the blocks compiled, the ring's autograd.Function and its
    point-to-point calls inside them): two steps at cp = 2 equal one uncompiled process."""
    import paratrain

    short = [*TOY, "run.steps=2"]
    ref = str(tmp_path / "ref")
    paratrain.train(paratrain.load_config(None, [*short, f"run.out_dir='{ref}'"]))
    run = [*short, "parallel.cp=2", "parallel.cp_attention='ring'", "train.compile=true"]
    run.append(f"run.out_dir='{tmp_path / 'compiled'}'")
    run_ranks(_train_many, 2, {"compiled": run}, timeout=400)
    _assert_same(_norms_and_losses(str(tmp_path / "compiled")), _norms_and_losses(ref), "compiled cp2")


def _hsdp_mesh_rank() -> tuple:
    import torch.distributed as dist

    from paratrain.distributed.parallel_dims import ParallelDims

    dist.init_process_group("gloo")
    dims = ParallelDims(2, 2, 1, 1, 8, cp=2)
    mesh = dims.submesh("fsdp")
    out = (mesh.mesh_dim_names, tuple(mesh.mesh.shape), mesh.mesh.tolist())
    dist.destroy_process_group()
    return out


@pytest.mark.slow  # world 8
def test_hsdp_mesh_shards_over_dp_shard_and_cp():
    """The FSDP2 mesh at dp_replicate 2 x dp_shard 2 x cp 2: replicas {0..3} and {4..7}, each
    sharded over its dp_shard x cp ranks (mesh order dp_replicate, dp_shard, cp)."""
    attempts = 4
    for attempt in range(1, attempts + 1):
        try:
            results = run_ranks(_hsdp_mesh_rank, 8)
            break
        except AssertionError as e:
            # Eight ranks on a loaded 2-core machine: gloo's connection set-up of a new group was
            # seen once in five runs reset by its peer (DistNetworkError) before any mesh check,
            # and twice in a row in a CI rehearsal beside other jobs. A set-up failure is not the
            # layout under test: retried, then it counts.
            if attempt == attempts or "Connection reset by peer" not in str(e):
                raise
    for names, shape, ranks in results:
        assert names == ("dp_replicate", "dp_shard_cp") and shape == (2, 4)
        assert ranks == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.slow
def test_packed_gpt_at_cp2_equals_one_process(sft, gpt_reference):
    """Packed documents at cp = 2 (world 2), with accumulation; and with activation checkpointing
    (full and selective), whose recomputation runs the ring again."""
    runs = {
        "sft_cp2": ["batch.micro_batch_size=4"],
        "sft_cp2_ac_full": ["parallel.activation_checkpointing='full'", "batch.micro_batch_size=8"],
        "sft_cp2_ac_sel": ["parallel.activation_checkpointing='selective'", "batch.micro_batch_size=8"],
    }
    run_ranks(_train_many, 2, {name: sft_gpt(sft, name, "parallel.cp=2", *extra) for name, extra in runs.items()})
    for name in runs:
        _assert_same(_norms_and_losses(os.path.join(sft["root"], name)), gpt_reference, name)


# ----------------------------------------------------------------------------- refused layouts


@pytest.mark.parametrize(
    "extra,world,message",
    [
        (["model.args={block_size = 18}", "data.args={block_size = 18}"], 2, "use block_size 16 or 20"),
        (["parallel.tp=2", "parallel.sequence_parallel=true"], 4, "parallel.cp with parallel.sequence_parallel is not"),
        (["model.args={attention = 'flex'}"], 2, "model.args.attention = 'flex'"),
        (["parallel.cp_attention='alltoall'", "model.args={n_head = 3, d_model = 48}"], 2, "n_head = 3 over cp x tp"),
    ],
)
def test_layouts_cp_cannot_run_are_refused_in_one_line(extra, world, message):
    from paratrain.config import ConfigError, load_config
    from paratrain.preflight import check_run

    cfg = load_config(None, ["parallel.cp=2", *extra])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
        check_run(cfg, world)
    assert "\n" not in str(e.value)


def test_hf_model_with_cp_and_tp_or_pp_passes_the_preflight(tmp_path):
    """model.hf at cp x tp and cp x pp are layouts like any other (tested against one process below)."""
    from paratrain.config import load_config
    from paratrain.preflight import check_run
    from paratrain.testing.hf_models import save_tiny

    path = save_tiny("llama", str(tmp_path / "llama"), weights=False)
    for extra in (["parallel.pp=2"], ["parallel.tp=2"], ["parallel.tp=2", "parallel.cp_attention='alltoall'"]):
        check_run(load_config(None, ["parallel.cp=2", *extra, f"model.hf='{path}'", "data.args={block_size = 32}"]), 4)


def test_cp_counts_in_the_world_size():
    from paratrain.config import ConfigError, ParallelConfig
    from paratrain.distributed.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(ParallelConfig(cp=2, dp_shard=-1), 4)
    assert (dims.dp_shard, dims.cp, dims.dp, dims.fsdp_enabled) == (2, 2, 2, True)
    assert ParallelDims.from_config(ParallelConfig(cp=2), 2).dp == 1
    with pytest.raises(ConfigError, match="x cp 2"):
        ParallelDims.from_config(ParallelConfig(cp=2, dp_replicate=1), 4)


# ----------------------------------------------------------------------------- model.hf at cp > 1


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_hf_llama_at_cp_equals_transformers_on_each_conversation_alone(sft, cp):
    """A tiny Llama (grouped-query attention, RoPE) through transformers' AttentionInterface at
    cp = 2 and 4, ring and all-to-all, packed conversations: one SGD step's loss and grad_norm equal plain transformers
    run on each conversation alone (tests/distributed/test_sft.py's reference), within 1e-5."""
    from paratrain.data.tokens import build_tokens
    from paratrain.testing.sft import reference, sft_config

    ref_loss, ref_items, ref_norm = reference(sft, sft["convs"])
    rows = len(build_tokens(sft["train"], block_size=512))
    runs = {
        f"hf_cp{cp}_{kind}": [
            *sft_config(sft, sft["train"], f"hf_cp{cp}_{kind}", f"batch.global_batch_size={rows}", "run.steps=1"),
            f"parallel.cp={cp}",
            f"parallel.cp_attention='{kind}'",
            f"batch.micro_batch_size={rows}",
        ]
        for kind in ("ring", "alltoall")
    }
    run_ranks(_train_many, cp, runs)
    for name in runs:
        (row,) = read_metrics(os.path.join(sft["root"], name))
        assert row["trainable_tokens"] == ref_items
        torch.testing.assert_close(row["loss"], ref_loss, rtol=1e-5, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(row["grad_norm"], ref_norm, rtol=1e-5, atol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_checkpoints_resume_across_cp_degrees(tmp_path):
    """cp is a layout: a cp = 2 run's step-3 checkpoint (FSDP2 shards over the cp ranks) resumes
    in one process, and one process's resumes at cp = 2; steps 4-6 are the uninterrupted run's."""
    import paratrain
    from paratrain.testing.resilience import TOY as CKPT_TOY

    base = [*CKPT_TOY, *plain_sgd(0.5)]

    def train_here(name: str, *extra: str) -> list[dict]:
        paratrain.train(paratrain.load_config(None, [*base, f"run.out_dir='{tmp_path / name}'", *extra]))
        return read_metrics(str(tmp_path / name))

    want = train_here("one")
    one_ckpt = tmp_path / "one" / "checkpoints" / "step-3"
    runs = {
        "cp2": [*base, "parallel.cp=2", f"run.out_dir='{tmp_path / 'cp2'}'"],
        "one_to_cp2": [
            *base,
            "parallel.cp=2",
            f"run.out_dir='{tmp_path / 'one_to_cp2'}'",
            f"checkpoint.resume='{one_ckpt}'",
        ],
    }
    run_ranks(_train_many, 2, runs)
    cp2_to_one = train_here("cp2_to_one", f"checkpoint.resume='{tmp_path / 'cp2' / 'checkpoints' / 'step-3'}'")
    for name, rows, expected in (
        ("cp2", read_metrics(str(tmp_path / "cp2")), want),
        ("one_to_cp2", read_metrics(str(tmp_path / "one_to_cp2")), want[3:]),
        ("cp2_to_one", cp2_to_one, want[3:]),
    ):
        assert [r["step"] for r in rows] == [r["step"] for r in expected], name
        _assert_same(
            (torch.tensor([r["loss"] for r in rows]), torch.tensor([r["grad_norm"] for r in rows])),
            (torch.tensor([r["loss"] for r in expected]), torch.tensor([r["grad_norm"] for r in expected])),
            name,
        )


HF_TOY = [
    "data.factory='paratrain.testing.toy:toy_lm'",
    "data.args={n = 64, seq_len = 16, vocab = 128}",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "run.steps=3",
    "run.progress=false",
    "metrics.plot=false",
    "checkpoint.interval=0",
    *plain_sgd(0.5),
]


@pytest.mark.slow  # world 4, tiny Llama: about 2 minutes here
@pytest.mark.timeout(600)  # above run_ranks' own, which names the rank that hangs
def test_hf_llama_at_cp2_with_tp2_or_pp2_equals_one_process(tmp_path, sft):
    """model.hf composed at world 4: cp = 2 x tp = 2 (each tp rank's heads through the ring or the
    all-to-all; grouped-query attention with one key/value head per tp rank) and cp = 2 x pp = 2
    (1F1B; every stage's attention runs cp's and gets the global positions; the default 'auto' picks
    the all-to-all for the causal rows, the ring for packed documents). Causal rows: three
    SGD steps equal one process; packed conversations: one step equals plain transformers on each
    conversation alone (tests/distributed/test_sft.py's reference), so the document masks reach every stage."""
    import paratrain
    from paratrain.data.tokens import build_tokens
    from paratrain.testing.hf_models import save_tiny
    from paratrain.testing.sft import reference, sft_config

    model = [*HF_TOY, f"model.hf='{save_tiny('llama', str(tmp_path / 'llama'))}'"]
    ref = str(tmp_path / "ref")
    paratrain.train(paratrain.load_config(None, [*model, f"run.out_dir='{ref}'"]))
    toy = {
        "cp2_tp2_ring": ["parallel.tp=2", "parallel.cp_attention='ring'"],
        "cp2_tp2_a2a": ["parallel.tp=2", "parallel.cp_attention='alltoall'"],
        "cp2_pp2": ["parallel.pp=2", "parallel.pp_schedule='1f1b'"],
    }
    runs = {n: [*model, "parallel.cp=2", *x, f"run.out_dir='{tmp_path / n}'"] for n, x in toy.items()}
    rows = len(build_tokens(sft["train"], block_size=512))
    packed = {
        "hf_cp2_pp2_packed": ["parallel.pp=2", "parallel.pp_schedule='1f1b'"],
        "hf_cp2_tp2_packed": ["parallel.tp=2"],
    }
    for name, extra in packed.items():
        one_step = [f"batch.global_batch_size={rows}", f"batch.micro_batch_size={rows}", "run.steps=1"]
        runs[name] = [*sft_config(sft, sft["train"], name, *one_step), "parallel.cp=2", *extra]
    run_ranks(_train_many, 4, runs, timeout=540)
    for name in toy:
        _assert_same(_norms_and_losses(str(tmp_path / name)), _norms_and_losses(ref), f"hf {name}")
    ref_loss, ref_items, ref_norm = reference(sft, sft["convs"])
    for name in packed:
        (row,) = read_metrics(os.path.join(sft["root"], name))
        assert row["trainable_tokens"] == ref_items
        _assert_same(
            (torch.tensor([row["loss"]]), torch.tensor([row["grad_norm"]])),
            (torch.tensor([ref_loss]), torch.tensor([ref_norm])),
            name,
        )
