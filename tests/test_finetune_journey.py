"""The fine-tuning journey as a user walks it (docs/sft.md, docs/lora.md): a LoRA run on a tiny
Llama whose chat template has no ``{% generation %}`` marks (as most real models' have none),
then what its last lines tell the user to use: generate a reply, evaluate a checkpoint, export
the adapters for PEFT and the merged model for transformers. The reference is code we did not
write: PEFT's ``AutoPeftModelForCausalLM`` on the exported adapter must give the merged model's
logits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import paratrain
from paratrain.cli import main as cli_main
from paratrain.config import load_config
from tests.hf_models import save_tiny
from tests.sft_data import CHATML_PLAIN, VOCAB, save_chat_tokenizer, stdlib_conversations, write_jsonl

pytest.importorskip("transformers")
pytest.importorskip("peft")

LORA = ["model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=['q_proj', 'v_proj']"]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tiny Llama with weights and a chat tokenizer without generation marks, 24 conversations
    prepared with a validation split."""
    from paratrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("journey")
    model = save_tiny("llama", str(root / "model"), vocab_size=VOCAB, max_position_embeddings=512)
    save_chat_tokenizer(model, template=CHATML_PLAIN)
    rows = write_jsonl(str(root / "chat.jsonl"), stdlib_conversations(24))
    prepare([rows], out_dir=str(root / "data"), tokenizer=model, fmt="chat", val_fraction=0.2, progress=False)
    return {"root": str(root), "model": model, "rows": rows, "data": str(root / "data")}


def _overrides(chat: dict, out: str, *extra: str) -> list[str]:
    return [
        f"model.hf='{chat['model']}'",
        f"data.args={{path = '{chat['data']}', block_size = 512}}",
        f"run.out_dir='{out}'",
        "run.progress=false",
        "metrics.plot=false",
        *LORA,
        *extra,
    ]


@pytest.fixture(scope="module")
def lora_run(chat):
    """configs/sft.toml with LoRA, 4 steps, a checkpoint at step 2; trained in this process."""
    out = os.path.join(chat["root"], "run")
    extra = ("run.steps=4", "checkpoint.interval=2", "eval.interval=2")
    paratrain.train(load_config("configs/sft.toml", _overrides(chat, out, *extra)))
    return out


def _peft_and_merged_logits(adapter: str, merged: str) -> tuple[torch.Tensor, torch.Tensor]:
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    x = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft_logits = AutoPeftModelForCausalLM.from_pretrained(adapter)(input_ids=x).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged)(input_ids=x).logits
    return peft_logits, merged_logits


def test_a_lora_run_generates_a_reply_quietly(chat, lora_run, capsys):
    """generate --chat and --prompt on a LoRA run of a model.hf: transformers' generate through the
    adapters, no warning; the same seed gives the same reply. (Before: 55 torch warnings, then
    AttributeError: 'HFCausalLM' object has no attribute 'generate'.)"""
    capsys.readouterr()
    args = ["generate", lora_run, "--chat", "What is the module os for?", "--max-new-tokens", "6"]
    assert cli_main(args) == 0
    out, err = capsys.readouterr()
    assert out.strip() is not None and not err, err
    assert cli_main(args) == 0 and capsys.readouterr().out == out  # the seed decides the sample
    assert cli_main(["generate", lora_run, "--prompt", "import ", "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("import ") and not err, err


def test_generate_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        cli_main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default 0.8)", "(default 200)", "(default 40)", "(default 'def ')"):
        assert default in text, text


def test_a_lora_run_leaves_the_adapter_its_last_line_names(chat, lora_run, tmp_path, capsys):
    """The run ends with a PEFT adapter in out_dir/adapter (task CAUSAL_LM, an absolute base path:
    AutoPeftModelForCausalLM loads it from any folder), and `export RUN --hf DIR --merge` merges
    the run's own final adapters into its base: the two give the same logits. A folder that saved
    nothing is said to be so, not 'killed while being written'."""
    adapter = os.path.join(lora_run, "adapter")
    config = json.load(open(os.path.join(adapter, "adapter_config.json")))
    assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] == os.path.abspath(chat["model"])
    merged = str(tmp_path / "merged")
    capsys.readouterr()
    assert cli_main(["export", lora_run, "--hf", merged, "--merge"]) == 0
    out, err = capsys.readouterr()
    assert "merged to" in out and not err, err
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the adapter names its base by an absolute path
    try:
        peft_logits, merged_logits = _peft_and_merged_logits(adapter, merged)
    finally:
        os.chdir(cwd)
    torch.testing.assert_close(peft_logits, merged_logits, rtol=1e-5, atol=1e-5)
    # The adapters trained: the merged model is not the base.
    from transformers import AutoModelForCausalLM

    x = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = AutoModelForCausalLM.from_pretrained(chat["model"])(input_ids=x).logits
    assert (base_logits - merged_logits).abs().max() > 1e-4
    empty = tmp_path / "saved_nothing"
    empty.mkdir()
    (empty / "config.toml").write_text("")
    capsys.readouterr()
    assert cli_main(["export", str(empty), "--peft", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds no checkpoint" in err and "killed" not in err and "\n" not in err, err


def test_a_lora_checkpoint_evaluates_with_its_own_config(chat, lora_run):
    """`paratrain eval CONFIG --checkpoint step-N` of a LoRA run: the checkpoint holds the adapters
    only, the base is built as in training (before: 'has no parameter embed_tokens.weight')."""
    from paratrain.launch.eval_worker import eval_checkpoint

    cfg = load_config(os.path.join(lora_run, "config.toml"))
    result = eval_checkpoint(cfg, os.path.join(lora_run, "checkpoints", "step-2"))
    logged = {r["step"]: r for r in map(json.loads, open(os.path.join(lora_run, "metrics.jsonl")))}
    assert result["step"] == 2
    assert result["val_loss"] == pytest.approx(logged[2]["val_loss"], rel=1e-6)
