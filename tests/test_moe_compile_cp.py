"""Mixtures of experts with context parallel and with ``train.compile`` (docs/moe.md, issue 24).

``model.hf`` MoE at cp = 2: each cp rank holds half of every sequence, so the router hook's
sequence-wise balance loss sums the expert counts over the cp ranks and each rank differentiates
its own tokens' share (models/hf/moe.py ``_router_stats``, as models/gpt/moe.py does). Whole runs
against one process under plain SGD: loss, aux_loss, grad_norm, tokens per expert, final weights
(tests/test_moe_hf.py's comparison).
"""

from __future__ import annotations

import pytest
import torch

from tests.hf_models import save_tiny
from tests.test_moe_hf import assert_same_run, moe_runs
from tests.test_sft import sft  # noqa: F401 - the SFT data path's fixture (packed conversations)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """Tiny Qwen3-MoE (one sparse layer of two) and one process's run of it (micro-batch 8)."""
    tmp = tmp_path_factory.mktemp("moe_cp_qwen3")
    src = save_tiny("qwen3_moe", str(tmp / "src"))
    return src, moe_runs(tmp, 1, src, {"ref": ["batch.micro_batch_size=8"]})["ref"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hf_moe_at_cp2_equals_one_process(tmp_path, qwen3_moe):
    """cp = 2 at world 2 (ring and all-to-all attention), causal rows: the same three SGD steps."""
    src, ref = qwen3_moe
    assert ref["aux_loss"][0] > 0 and ref["tokens"][0][0] != ref["tokens"][0][1]
    runs = moe_runs(
        tmp_path,
        2,
        src,
        {
            "cp2_ring": ["parallel.cp=2", "parallel.cp_attention='ring'", "batch.micro_batch_size=4"],
            "cp2_alltoall": ["parallel.cp=2", "parallel.cp_attention='alltoall'", "batch.micro_batch_size=8"],
        },
    )
    for name, got in runs.items():
        try:
            assert_same_run(got, ref, 1e-5)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_packed_hf_moe_at_cp2_equals_one_process(tmp_path, sft):  # noqa: F811
    """Packed conversations (tests/test_sft.py's corpus, documents restarting their positions in
    each row: the ring's document masks) through a tiny Qwen3-MoE at cp = 2: two SGD steps equal
    one process. A packed row counts as one sequence of the balance loss, split over the cp ranks."""
    from paratrain.data.tokens import build_tokens
    from tests.dist_utils import read_metrics, run_ranks
    from tests.sft_data import VOCAB
    from tests.test_moe_hf import train_many
    from tests.test_sft import _config

    model = save_tiny("qwen3_moe", str(tmp_path / "moe"), vocab_size=VOCAB, max_position_embeddings=512)
    rows = len(build_tokens(sft["train"], block_size=512))
    common = [f"batch.global_batch_size={rows}", f"batch.micro_batch_size={rows}", "run.steps=2"]

    def config(name: str, *extra: str) -> list[str]:
        return [*_config(sft, sft["train"], name, *common, *extra), f"model.hf='{model}'"]

    run_ranks(train_many, 1, [config("packed_ref")])
    run_ranks(train_many, 2, [config("packed_cp2", "parallel.cp=2")])
    ref, got = (read_metrics(f"{sft['root']}/{n}") for n in ("packed_ref", "packed_cp2"))
    assert ref[0]["aux_loss"] > 0
    for key in ("aux_loss", "loss", "grad_norm", "expert_tokens_min", "expert_tokens_max"):
        torch.testing.assert_close(
            torch.tensor([r[key] for r in got]),
            torch.tensor([r[key] for r in ref]),
            rtol=1e-5,
            atol=0,
            msg=lambda m, k=key: f"{k}: {m}",
        )
