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
from paratrain.testing.hf_models import save_tiny
from paratrain.testing.sft_data import CHATML_PLAIN, VOCAB, save_chat_tokenizer, stdlib_conversations, write_jsonl

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
    import warnings

    capsys.readouterr()
    args = ["generate", lora_run, "--chat", "What is the module os for?", "--max-new-tokens", "6"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli_main(args) == 0
    assert not caught, [str(w.message) for w in caught]
    out, err = capsys.readouterr()
    assert out.strip() is not None and not err, err
    assert cli_main(args) == 0 and capsys.readouterr().out == out  # the seed decides the sample
    assert cli_main(["generate", lora_run, "--prompt", "import ", "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("import ") and not err, err


def test_a_reply_that_ends_at_once_is_said_so(chat, lora_run, capsys, monkeypatch):
    """A model whose first token is end-of-turn: the empty reply on stdout, and a note on stderr
    (it printed an empty line alone)."""
    import paratrain.generate

    def ends_at_once(model, tok, ids, **kw):
        return torch.cat([ids, torch.tensor([[tok.eos_token_id, 5]])], dim=1)

    monkeypatch.setattr(paratrain.generate, "_sample_hf", ends_at_once)
    capsys.readouterr()
    assert cli_main(["generate", lora_run, "--chat", "What is the module os for?"]) == 0
    out, err = capsys.readouterr()
    assert out == "\n", out
    assert err.startswith("(the reply ended at once: the model's first token was end-of-turn '"), err


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


# ----------------------------------------------------------------------------- nothing replaced unasked


def _train_cli(out: str, *args: str, launched: list) -> int:
    """`paratrain train configs/debug.toml` through the CLI up to the launcher (which records instead)."""
    import paratrain.launch.agent

    sets = ["--set", f"run.out_dir='{out}'"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paratrain.launch.agent, "launch", lambda *a, **k: launched.append(a) or 0)
        return cli_main(["train", "configs/debug.toml", *args, *sets])


def test_train_into_a_used_out_dir_is_refused_unless_resumed_or_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints" / "step-4").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "model.safetensors").write_bytes(b"old weights")
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    launched: list = []
    assert _train_cli(str(out), launched=launched) == 2
    err = capsys.readouterr().err.strip()
    assert "holds another run (metrics.jsonl, model.safetensors, checkpoints)" in err and "--overwrite" in err, err
    assert "\n" not in err and not launched
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing touched
    assert _train_cli(str(out), "--resume", launched=launched) == 0 and len(launched) == 1
    assert (out / "metrics.jsonl").exists()  # resuming keeps the run
    assert _train_cli(str(out), "--overwrite", launched=launched) == 0 and len(launched) == 2
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # the run's rank 0 clears, not the check
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _train_cli(str(empty), launched=launched) == 0  # an empty folder is not a run


def test_overwrite_starts_over_without_the_old_runs_outputs(tmp_path):
    """run.overwrite (train --overwrite): the run's rank 0 removes the old run's outputs and its
    checkpoints before writing its own; its metrics are its own steps only."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step-4").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    (out / "adapter").mkdir()
    tiny = ["model.args={n_layer = 1, n_head = 2, d_model = 16, block_size = 32}", "data.args.max_bytes=20000"]
    sets = [*tiny, f"run.out_dir='{out}'", "run.steps=1", "run.progress=false", "metrics.plot=false"]
    paratrain.train(load_config("configs/debug.toml", [*sets, "run.overwrite=true"]))
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [1]
    assert not (out / "checkpoints").exists() and not (out / "adapter").exists()
    assert (out / "model.safetensors").stat().st_size > 1000


def test_an_unwritable_out_dir_is_one_line_before_any_process(capsys):
    """Before: a worker's traceback and exit 1. (No folder can be made in /proc, even by root.)"""
    launched: list = []
    assert _train_cli("/proc/paratrain-test/run", launched=launched) == 2
    err = capsys.readouterr().err.strip()
    assert "run.out_dir = '/proc/paratrain-test/run' cannot be written (" in err, err
    assert "\n" not in err and not launched, err


def test_the_adapter_of_a_base_without_weights_loads_with_the_auto_class(chat, tmp_path, capsys):
    """model.hf of a config and tokenizer only (as configs/sft/model): the run trained on a base
    made from its seed. `export RUN --peft DIR` writes that base to DIR/base and names it, so
    AutoPeftModelForCausalLM.from_pretrained(DIR) loads from any folder and gives the merged
    model's logits; the run's own adapter has it too. A checkpoint (adapters only) names model.hf
    and says the auto class cannot load it. (Before: OSError, no model.safetensors in model.hf.)"""
    import shutil

    bare = str(tmp_path / "bare")
    shutil.copytree(chat["model"], bare, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    out = str(tmp_path / "run")
    sets = [*_overrides(chat, out, "run.steps=2", "checkpoint.interval=1"), f"model.hf='{bare}'"]
    paratrain.train(load_config("configs/sft.toml", sets))
    adapter, merged = str(tmp_path / "adapter"), str(tmp_path / "merged")
    capsys.readouterr()
    assert cli_main(["export", out, "--peft", adapter]) == 0
    said = capsys.readouterr().out
    assert f"holds no weights), written to {os.path.join(adapter, 'base')}" in said, said
    for folder in (adapter, os.path.join(out, "adapter")):
        config = json.load(open(os.path.join(folder, "adapter_config.json")))
        assert config["base_model_name_or_path"] == os.path.join(os.path.abspath(folder), "base")
    assert cli_main(["export", out, "--hf", merged, "--merge"]) == 0
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        peft_logits, merged_logits = _peft_and_merged_logits(adapter, merged)
    finally:
        os.chdir(cwd)
    torch.testing.assert_close(peft_logits, merged_logits, rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    assert cli_main(["export", f"{out}/checkpoints/step-2", "--peft", str(tmp_path / "from_checkpoint")]) == 0
    said = capsys.readouterr().out
    assert "holds no weights (the run trained on a base made from its seed), so AutoPeftModelForCausalLM" in said, said
    assert not os.path.exists(tmp_path / "from_checkpoint" / "base")


def test_export_never_replaces_a_file_or_model_unasked(chat, lora_run, tmp_path, capsys):
    """--to onto a file, --hf into a model directory, --peft into an adapter: refused, the target
    untouched; --overwrite replaces it."""
    target = tmp_path / "weights.safetensors"
    target.write_bytes(b"precious")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for argv, path in (
        (["--to", str(target)], target),
        (["--hf", str(model), "--merge"], model / "config.json"),
        (["--peft", str(model)], model / "config.json"),
    ):
        capsys.readouterr()
        assert cli_main(["export", lora_run, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert "exists" in err and "--overwrite" in err and "\n" not in err, err
        assert path.read_bytes() in (b"precious", b"{}")
    assert cli_main(["export", lora_run, "--to", str(target), "--overwrite"]) == 0
    assert target.stat().st_size > 1000
    assert cli_main(["export", lora_run, "--hf", str(model), "--merge", "--overwrite"]) == 0
    assert json.load(open(model / "config.json"))["model_type"] == "llama"


# ----------------------------------------------------------------------------- preparing


def test_prepare_again_from_another_folder_is_the_same_corpus(chat, tmp_path, monkeypatch):
    """Without --chat-template the fingerprint records none (it recorded the current directory, so
    the same command run from elsewhere was refused as 'a different corpus')."""
    from paratrain.data.prepare import prepare

    out = str(tmp_path / "corpus")
    for cwd in (tmp_path, chat["root"]):
        monkeypatch.chdir(cwd)
        meta = prepare([chat["rows"]], out_dir=out, tokenizer=chat["model"], fmt="chat", progress=False)
    assert meta["fingerprint"]["chat_template"] == ""


def test_sharegpt_rows_are_mapped_and_skips_are_counted_per_reason(chat, tmp_path, capsys):
    """ShareGPT's conversations of {from, value} with human/gpt/system roles give the tokens of the
    same conversations as messages; rows with nothing to train are counted per reason."""
    from paratrain.data.prepare import prepare
    from paratrain.testing.sft_data import write_jsonl

    convs = stdlib_conversations(6)
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    share = [
        {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in c["messages"]]} for c in convs
    ]
    mixed = [{"messages": [{"role": names[m["role"]], "content": m["content"]} for m in c["messages"]]} for c in convs]
    no_reply = {"conversations": [{"from": "human", "value": "Hello?"}]}
    metas = {}
    for name, rows in (("messages", convs), ("sharegpt", [*share, no_reply]), ("roles", mixed)):
        path = write_jsonl(str(tmp_path / f"{name}.jsonl"), rows)
        metas[name] = prepare([path], out_dir=str(tmp_path / name), tokenizer=chat["model"], fmt="auto", progress=False)
    for name in ("sharegpt", "roles"):
        for s in ("train", "val"):
            assert metas[name]["splits"][s]["tokens"] == metas["messages"]["splits"][s]["tokens"]
            assert metas[name]["splits"][s]["trainable_tokens"] == metas["messages"]["splits"][s]["trainable_tokens"]
    assert metas["sharegpt"]["skipped_by_reason"] == {"no assistant turn (roles user)": 1}
    long = {"messages": [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl(str(tmp_path / "cut.jsonl"), [*convs, no_reply, long])
    capsys.readouterr()
    argv = ["prepare", path, "--format", "chat", "--tokenizer", chat["model"], "--out", str(tmp_path / "cut")]
    assert cli_main([*argv, "--max-length", "100"]) == 0
    out = capsys.readouterr().out
    assert "2 skipped (1 no assistant turn (roles user), 1 cut by --max-length before its first target)" in out, out


# ----------------------------------------------------------------------------- the whole journey


@pytest.mark.slow  # about 80 s: every command is a process of its own, training on two
def test_the_lora_journey_through_the_cli(chat, tmp_path):
    """prepare, train LoRA on 2 processes with the shipped configs/sft.toml, eval of the run's
    newest checkpoint and of an older one, generate --chat, export --peft and --merge of the run:
    each exits 0 and prints no warning, and PEFT's AutoPeftModelForCausalLM on the adapter gives
    the merged model's logits."""
    from paratrain.testing.dist_utils import paratrain_cli

    data, out = str(tmp_path / "data"), str(tmp_path / "run")
    sets = [
        f"model.hf='{chat['model']}'",
        f"data.args={{path = '{data}', block_size = 512}}",
        f"run.out_dir='{out}'",
        "model.lora.target_modules=['q_proj', 'v_proj']",
        "run.steps=4",
        "checkpoint.interval=2",
        "eval.interval=2",
    ]
    commands = [
        [
            "prepare",
            chat["rows"],
            "--format",
            "chat",
            "--tokenizer",
            chat["model"],
            "--out",
            data,
            "--val-fraction",
            "0.2",
        ],
        ["train", "configs/sft.toml", "--nproc-per-node", "2", *[a for s in sets for a in ("--set", s)]],
        ["eval", f"{out}/config.toml", "--checkpoint", "latest", "--json"],
        ["eval", f"{out}/config.toml", "--checkpoint", f"{out}/checkpoints/step-2", "--json"],
        ["generate", out, "--chat", "What is the module os for?", "--max-new-tokens", "8"],
        ["export", out, "--peft", str(tmp_path / "adapter")],
        ["export", out, "--hf", str(tmp_path / "merged"), "--merge"],
    ]
    results = []
    for argv in commands:
        res = paratrain_cli(*argv, timeout=300)
        assert res.returncode == 0, (argv, res.stderr[-3000:])
        noise = [line for line in res.stderr.splitlines() if "warn" in line.lower() or "Traceback" in line]
        assert not noise, (argv, noise)
        results.append(res)
    logged = {r["step"]: r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))}
    for step, res in ((4, results[2]), (2, results[3])):
        result = json.loads(res.stdout.strip().splitlines()[-1])
        assert result["step"] == step and result["val_loss"] == pytest.approx(logged[step]["val_loss"], rel=1e-5)
    assert "lora: the adapters in" in results[1].stderr.splitlines()[-2]
    peft_logits, merged_logits = _peft_and_merged_logits(str(tmp_path / "adapter"), str(tmp_path / "merged"))
    torch.testing.assert_close(peft_logits, merged_logits, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- said, not silent


def test_adaptive_batch_compression_and_a_resume_with_nothing_left_are_said(tmp_path, capsys):
    """batch.adaptive and comm.compression each have a start-up line; a resume at run.steps ends
    with a `done: 0 steps` line (it printed nothing)."""
    out = str(tmp_path / "run")
    tiny = ["model.args={n_layer = 1, n_head = 2, d_model = 16, block_size = 32}", "data.args.max_bytes=20000"]
    sets = [*tiny, f"run.out_dir='{out}'", "run.steps=2", "run.progress=false", "metrics.plot=false"]
    extra = ["batch.adaptive=true", "comm.compression='bf16'", "checkpoint.at_end=true"]
    paratrain.train(load_config("configs/debug.toml", [*sets, *extra]))
    err = capsys.readouterr().err  # the run's log handler writes to stderr
    assert "adaptive batch: global batch 8, grown by accumulation up to 64" in err, err
    assert "comm: gradient compression bf16 (no effect at this layout" in err, err
    paratrain.train(load_config("configs/debug.toml", [*sets, "checkpoint.resume='latest'"]))
    err = capsys.readouterr().err
    assert "done: 0 steps (resumed at step 2, run.steps = 2: nothing left" in err, err


def test_config_keys_into_a_reader_that_leaves_is_no_error():
    """`paratrain config --keys | head -1`: exit 0 and nothing on stderr (was a BrokenPipeError)."""
    import subprocess
    import sys

    from paratrain.testing.dist_utils import REPO

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "paratrain", "config", "--keys"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    proc.stdout.readline()
    proc.stdout.close()  # the reader leaves after one line
    assert proc.wait(timeout=60) == 0
    assert proc.stderr.read() == b""


def test_relative_paths_name_the_folder_they_are_read_from(tmp_path, monkeypatch, capsys):
    """A relative model.hf or corpus path from elsewhere: one line naming the current directory and
    that config paths are not read from the config file's folder (it suggested a hub download)."""
    from paratrain.testing.dist_utils import REPO

    monkeypatch.chdir(tmp_path)
    config = os.path.join(REPO, "configs", "sft.toml")
    for sets, needle in (
        (
            [],
            f"model.hf = 'configs/sft/model' is not a local directory (a relative path in a config is taken from where paratrain runs, {str(tmp_path)!r}, not from the config file's folder",
        ),
        (
            ["--set", f"model.hf='{REPO}/configs/sft/model'"],
            f"data.args.path = 'data/sft' holds no prepared corpus under the current directory {str(tmp_path)!r} (relative paths are taken from where paratrain runs, not from the config file's folder)",
        ),
    ):
        assert cli_main(["train", config, *sets]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err


def test_generate_of_a_run_it_cannot_decode_names_why(tmp_path, capsys):
    """A GPT trained on a data.factory of another vocabulary: one line naming the vocabulary and the
    data, not 'needs data.name = tokens' of a run that may have it."""
    out = str(tmp_path / "run")
    sets = [
        "model.args={n_layer = 1, n_head = 2, d_model = 16, block_size = 16, vocab_size = 128}",
        "data.factory='paratrain.testing.toy:toy_lm'",
        "data.args={n = 8, seq_len = 16, vocab = 128}",
        f"run.out_dir='{out}'",
        "run.steps=1",
        "run.progress=false",
        "metrics.plot=false",
    ]
    paratrain.train(load_config("configs/debug.toml", sets))
    capsys.readouterr()
    assert cli_main(["generate", out]) == 2
    err = capsys.readouterr().err.strip()
    assert "trained a GPT of vocab_size 128 on data.name = 'stdlib_bytes' (a data.factory)" in err, err
    assert "\n" not in err
