"""The vision covering design (src/paratrain/testing/vision_sweep.py, issue 57): every pair of the
image-text features (family, layout, accumulation, activation checkpointing, packing, LoRA, a
frozen vision tower, DPO) run against one process under plain SGD, or refused in one line.

Fast tier: the stored design still covers every pair, its refused pairs are still refused and its
layouts still accepted. Slow tier: every layout of it equals one process (loss 1e-5, grad_norm 1e-4).
"""

from __future__ import annotations

import pytest

from paratrain.testing.sweep import _complete, refusal, unaccounted
from paratrain.testing.vision_sweep import DESIGN_FILE, VISION_FEATURES, configure, load, make_data, run

pytest.importorskip("transformers")
pytest.importorskip("PIL")

REBUILD = "run python -m paratrain.testing.vision_sweep --design-only"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp("vision_sweep")))


def test_the_stored_vision_design_covers_every_pair_and_its_refusals_still_hold(data):
    """A feature or level added to VISION_FEATURES, or a refusal added to or dropped from
    paratrain.preflight.support, fails here until the design is rebuilt."""
    design = load()
    missing = sorted(unaccounted(design))
    assert not missing, f"in no layout of {DESIGN_FILE}: {missing[:5]}; {REBUILD}"
    for target, why in design.refused.items():
        now = [
            refusal(_complete(dict(target), dp, VISION_FEATURES), data, configure)
            for dp in ("dp_shard", "dp_replicate")
        ]
        assert all(now), f"{target} is accepted now: {REBUILD}"
        assert why == now[0] and "\n" not in why
    refused = {lay.name: why for lay in design.layouts if (why := refusal(lay, data, configure))}
    assert not refused, f"refused now: {refused}; {REBUILD}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_layout_of_the_vision_design_equals_one_process(data, tmp_path):
    """One launch per world size (1: the references, 2, 4), every layout's run in it."""
    results = run(load().layouts, data, str(tmp_path), timeout=400)
    wrong = {lay.name: r for lay, r in results.items() if not r["ok"]}
    assert not wrong, f"differs from one process: {wrong}"


def test_lora_keeps_out_of_a_frozen_qwen2vl_tower_that_has_no_projector_of_its_own():
    """The design's first run found Qwen2-VL + LoRA + model.vision = 'freeze' failing to build
    (its projector's name is None: a TypeError joining the names to keep out)."""
    import re
    from types import SimpleNamespace

    from paratrain.models.hf.vision import lora_keep_out

    keep_out = lora_keep_out(SimpleNamespace(vision="freeze"), SimpleNamespace(model_type="qwen2_vl"))
    assert re.fullmatch(keep_out, "model.visual.blocks.0.attn.qkv")
    assert not re.fullmatch(keep_out, "model.language_model.layers.0.self_attn.q_proj")
