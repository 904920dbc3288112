"""The combination sweep (src/paratrain/testing/sweep.py): every pair of the features of paratrain.preflight.support run
against one process under plain SGD (loss and grad_norm per step), or refused in one line.

Fast tier: the stored design still covers every pair of the declared features, its refused pairs
are still refused, docs/support.md is rendered from the table, and a seeded sample of the
layouts (with the pipeline x FSDP2 x chunked-loss layout that once trained wrong losses) equals
one process. ``PARATRAIN_SWEEP_SEED=N`` picks another sample; the failure message names it.
Slow tier: every layout of the stored design equals one process (``python -m paratrain.testing.sweep``
rebuilds the design from its seed and runs it).
"""

from __future__ import annotations

import os
import random

import pytest

from paratrain.preflight.support import render_support
from paratrain.testing.sweep import (
    DESIGN_FILE,
    ROOT,
    Layout,
    load_design,
    make_corpus,
    refusal,
    run_layouts,
    unaccounted,
)

# Pipeline x FSDP2 x chunked loss: the pipeline stage's FSDP2 resharded the output layer that the
# chunked loss reads after the forward (4.8e-3 off at step 1, nothing raised).
REGRESSIONS = [Layout((("dp_shard", "2"), ("pp", "1f1b"), ("chunked_loss", "16")))]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("sweep")))


def test_the_stored_design_covers_every_pair_of_the_declared_features():
    """A feature added to paratrain.preflight.support.FEATURES fails here until `python -m paratrain.testing.sweep`
    has built a design that holds its pairs (and triples)."""
    missing = sorted(unaccounted(load_design()))
    assert not missing, (
        f"in no layout of {DESIGN_FILE}: {missing[:5]}; run python -m paratrain.testing.sweep --design-only"
    )


def test_refused_pairs_are_still_refused_in_one_line(corpus):
    from paratrain.testing.sweep import _complete

    for target, why in load_design().refused.items():
        now = [refusal(_complete(dict(target), dp), corpus) for dp in ("dp_shard", "dp_replicate")]
        assert all(now), f"{target} is accepted now: run python -m paratrain.testing.sweep to test it"
        assert why == now[0] and "\n" not in why


def test_the_support_page_is_rendered_from_the_table():
    with open(os.path.join(ROOT, "docs", "support.md")) as f:
        assert f.read() == render_support(), (
            "docs/support.md is stale: python -c 'import paratrain.preflight.support as s; print(s.render_support(), end=\"\")' > docs/support.md"
        )


@pytest.mark.timeout(900)
def test_a_seeded_sample_of_the_sweep_equals_one_process(corpus, tmp_path):
    """The regression layouts and one layout of the design drawn by the seed (one without
    compile, whose inductor build is the slow tier's)."""
    seed = int(os.environ.get("PARATRAIN_SWEEP_SEED", "0"))
    layouts = [lay for lay in load_design().layouts if "compile" not in dict(lay.levels)]
    sample = [*REGRESSIONS, random.Random(seed).choice(layouts)]
    results = run_layouts(sample, corpus, str(tmp_path), timeout=400)  # 2 groups, under the 900 s above
    wrong = {lay.name: r for lay, r in results.items() if not r["ok"]}
    assert not wrong, f"PARATRAIN_SWEEP_SEED={seed}: differs from one process: {wrong}"


def test_every_stored_layout_is_still_accepted(corpus):
    """A refusal added to paratrain.preflight.support after the design was built fails here until
    `python -m paratrain.testing.sweep` has built a design without the layouts it refuses."""
    refused = {lay.name: why for lay in load_design().layouts if (why := refusal(lay, corpus))}
    assert not refused, f"refused now: {refused}; run python -m paratrain.testing.sweep --design-only"


@pytest.mark.slow
@pytest.mark.timeout(4500)
def test_the_whole_sweep_equals_one_process(corpus, tmp_path):
    """Every layout of the stored design (docs/combinations.md shows their differences)."""
    results = run_layouts(load_design().layouts, corpus, str(tmp_path), timeout=1400)  # 3 groups
    wrong = {lay.name: r for lay, r in results.items() if not r["ok"]}
    assert not wrong, f"differs from one process: {wrong}"


def test_combinations_found_failing_outside_the_design_are_refused(corpus):
    """Refusals that no pair of the design holds: each layout seen to fail (the first by the
    sweep, in a pipeline stage; the second without one, world 2), and their neighbours that run."""
    for failed in (
        Layout((("tp", "2"), ("pp", "gpipe"), ("activation_checkpointing", "full"), ("compile", "on"))),
        Layout((("tp", "2"), ("activation_checkpointing", "full"), ("compile", "on"))),
    ):
        assert "train.compile with parallel.tp > 1 and parallel.activation_checkpointing = 'full'" in refusal(
            failed, corpus
        )
    for fine in (
        Layout((("pp", "gpipe"), ("activation_checkpointing", "full"), ("compile", "on"))),
        Layout((("tp", "2"), ("activation_checkpointing", "selective"), ("compile", "on"))),
    ):
        assert refusal(fine, corpus) is None
