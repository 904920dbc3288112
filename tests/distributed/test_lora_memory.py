"""benchmarks/memory/lora_memory.py: LoRA's gradient and AdamW-state bytes against full fine-tuning.

Byte counts are deterministic (no timing): after one AdamW step every trained parameter holds 4
bytes of gradient and 8 of moments, a frozen one none, so the ratio LoRA / full equals the ratio
of trained parameters. The trained count is anchored to PEFT's own ``get_peft_model`` on the same
transformers Llama (``get_nb_trainable_parameters``), code paratrain did not write.
"""

from __future__ import annotations

import pytest

from paratrain.testing.hf_models import save_tiny
from paratrain.testing.lora_memory import check, formula_bytes, measure, measure_all

LORA = dict(r=4, alpha=8, target_modules=["q_proj", "v_proj"])


def _row(model: dict) -> dict:
    full, lora = measure(dict(model), {}, 2), measure({**model, "lora": LORA}, {}, 2)
    return {"model": "m", "world": 1, "layout": "single", "full": [full], "lora": [lora]}


def test_lora_gradient_and_state_bytes_follow_the_formula_and_peft_count(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = save_tiny("llama", str(tmp_path / "llama"), weights=False)  # built from the seed, not the meta device
    llama = _row({"hf": hf, "vocab": 128})
    gpt = _row(
        {"name": "gpt", "args": dict(n_layer=2, d_model=32, n_head=4, vocab_size=64, block_size=32), "vocab": 64}
    )
    assert check([llama, gpt]) == []
    for row in (llama, gpt):
        full, lora = row["full"][0], row["lora"][0]
        assert full["trained"] == full["psi"] == lora["psi"] - lora["trained"]  # the same base, all frozen
        assert (full["grads"], full["state"]) == (4 * full["psi"], 8 * full["psi"])
        assert (lora["grads"] + lora["state"]) * full["trained"] == (full["grads"] + full["state"]) * lora["trained"]

    # The trained count is PEFT's on the same model and LoRA config.
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf))
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainable, total = peft_model.get_nb_trainable_parameters()
    assert llama["lora"][0]["trained"] == trainable
    assert llama["lora"][0]["grads"] == 4 * trainable and llama["lora"][0]["state"] == 8 * trainable
    assert llama["full"][0]["psi"] == total - trainable


def test_formula_shards_trained_parameters_under_fsdp2():
    rank = {"trained": 1000}
    assert formula_bytes(rank, 2, "FSDP2") == (2000, 4000)
    assert formula_bytes(rank, 2, "DDP") == (4000, 8000)


@pytest.mark.slow
def test_lora_memory_per_rank_at_world_2_ddp_and_fsdp2():
    rows = measure_all([2], 4, ["q_proj", "v_proj"])
    assert check(rows) == []
    assert {(r["model"], r["layout"]) for r in rows} == {(m, lay) for m in ("llama", "gpt") for lay in ("DDP", "FSDP2")}
