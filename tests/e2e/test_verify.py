"""`paratrain verify`: passes on a correct layout, fails naming a parameter on a broken one."""

from __future__ import annotations

import re

import pytest

from paratrain.testing.dist_utils import paratrain_cli, plain_sgd

CONFIG = """
[run]
steps = 3
[model]
args = {{ n_layer = 2, n_head = 4, d_model = 32, block_size = 16, vocab_size = 32 }}
[data]
factory = "paratrain.testing.toy:toy_lm"
args = {{ n = 64, seq_len = 16, vocab = 32 }}
[batch]
global_batch_size = 8
micro_batch_size = 2
[optim]
lr = 3e-3
warmup_steps = 2
[parallel]
dp_shard = 2
{extra}
"""


def verify(tmp_path, extra: str = "", *sets: str):
    cfg = tmp_path / "layout.toml"
    cfg.write_text(CONFIG.format(extra=extra))
    args = ["verify", str(cfg), "--steps", "3", "--nproc-per-node", "2", "--out-dir", str(tmp_path / "v")]
    for s in sets:
        args += ["--set", s]
    return paratrain_cli(*args, timeout=300)


# A layout that must pass is verified under plain SGD: over the 3 steps AdamW (the config's) would grow the
# layouts' rounding differences step by step (a near-zero gradient's sign becomes a step of lr) toward --tol.
SGD = plain_sgd(0.3)


def test_verify_passes_on_sharded_data_parallel(tmp_path):
    r = verify(tmp_path, "", *SGD)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = re.findall(r"^\s+(\d)" + r"\s+(\S+)" * 6 + "$", r.stdout, re.M)
    assert [int(s) for s, *_ in rows] == [1, 2, 3]
    assert all(float(row[3]) <= 1e-4 and float(row[6]) <= 1e-4 for row in rows)  # loss, grad_norm
    assert "verify: OK" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "sets",
    [
        ["parallel.dp_shard=1", "parallel.cp=2"],  # context parallel: rows split over the two ranks
        ["parallel.ep=2"],  # expert parallel, borrowed from dp_shard 2
    ],
    ids=["cp2", "ep2"],
)
def test_verify_passes_on_context_and_expert_parallel(tmp_path, sets):
    """The reference run is one process: no cp, no ep (verify.reference_overrides)."""
    moe = "model.args={n_layer = 2, n_head = 4, d_model = 32, block_size = 16, vocab_size = 32, moe = {n_experts = 4}}"
    r = verify(tmp_path, "", moe, *sets, *SGD)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify: OK" in r.stdout


@pytest.mark.slow
def test_verify_fails_naming_a_parameter_when_a_rank_scales_its_gradient(tmp_path):
    # src/paratrain/testing/toy.py:gpt_skewed_grad multiplies, on rank 1 only, the gradient leaving block 0.
    r = verify(tmp_path, "", "model.factory='paratrain.testing.toy:gpt_skewed_grad'")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "verify: FAILED" in r.stdout
    m = re.search(r"first parameter past tolerance: (\S+)", r.stdout)
    assert m and m.group(1).startswith(("layers.0.", "tok_emb", "pos_emb")), r.stdout  # block 0 or below it


@pytest.mark.slow
def test_verify_fails_on_a_gradient_off_by_a_constant_factor(tmp_path):
    # src/paratrain/testing/toy.py:gpt_scaled_grad doubles the whole gradient on every rank of the 2-rank layout:
    # AdamW would divide the factor out of the updates; the gradient norm of step 1 shows it.
    r = verify(tmp_path, "", "model.factory='paratrain.testing.toy:gpt_scaled_grad'")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "verify: FAILED, the gradient norm differs from step 1" in r.stdout, r.stdout
    step1 = re.search(r"^\s+1" + r"\s+(\S+)" * 6, r.stdout, re.M)
    assert float(step1.group(6)) == pytest.approx(1.0, rel=1e-4)  # |2g - g| / |g|
