"""The `paratrain` command: a thin layer over the library, one ``cmd_*`` function per subcommand.

Each subcommand imports what it needs when it runs, and only the invoked subcommand's arguments
are built, so a command that needs no torch (``prepare``, ``config``, ``report``) starts without
loading it (about 4 s of CPU on this project's machines; benchmarks/overhead/prepare_throughput.py).

Bad input exits with code 2 and one line naming the problem and the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from paratrain.config import (
    Config,
    ConfigError,
    add_resume_argument,
    add_set_argument,
    describe_keys,
    load_config,
    resume_overrides,
    to_toml,
)
from paratrain.observability.events import command_started


class NodesAction(argparse.Action):
    """``--nnodes N`` or ``MIN:MAX`` (torchrun's elastic form): ``nnodes`` = MIN, ``max_nnodes`` = MAX."""

    def __call__(self, parser, namespace, values, option_string=None):
        lo, _, hi = values.partition(":")
        if not lo.isdigit() or (hi and not hi.isdigit()) or int(lo) < 1 or (hi and int(hi) < int(lo)):
            raise ConfigError(f"--nnodes {values}: expected N or MIN:MAX with 1 <= MIN <= MAX (e.g. 1:2)")
        namespace.nnodes, namespace.max_nnodes = int(lo), int(hi or lo)


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes on this node (default 1)")
    p.add_argument(
        "--nnodes",
        action=NodesAction,
        default=1,
        metavar="N|MIN:MAX",
        help="number of nodes (default 1); MIN:MAX is elastic: the job goes on between MIN and MAX nodes",
    )
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (a hint under c10d rendezvous)")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous, the same on every node")
    p.add_argument("--max-restarts", type=int, default=0, help="restart the workers up to K times on failure")
    p.add_argument(
        "--rdzv-conf",
        default="",
        metavar="KEY=VALUE,...",
        help="rendezvous settings, e.g. last_call_timeout=30,join_timeout=600 (docs/resilience.md)",
    )
    p.add_argument(
        "--rdzv-id",
        default="",
        metavar="ID",
        help="the job's id on a shared rendezvous server, the same on every node (default: from its config)",
    )
    p.add_argument(
        "--job-secret-file",
        default="",
        metavar="FILE",
        help="file holding the secret every node of the job shares (else $PARATRAIN_JOB_SECRET; one node: generated)",
    )
    p.add_argument(
        "--bind",
        default="",
        metavar="ADDR",
        help="address this node listens on (multi-node; default: the one that reaches --rdzv-endpoint)",
    )


def launch_spec(args: argparse.Namespace):

    from paratrain.launch.agent import LaunchSpec  # lazy: see the module docstring

    spec = LaunchSpec(
        args.nproc_per_node,
        args.nnodes,
        args.node_rank,
        args.rdzv_endpoint,
        args.max_restarts,
        job_secret_file=args.job_secret_file,
        bind=args.bind,
        max_nnodes=getattr(args, "max_nnodes", args.nnodes),
        rdzv_conf=getattr(args, "rdzv_conf", ""),
        rdzv_id=getattr(args, "rdzv_id", ""),
    )
    spec.validate()
    return spec


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="TOML config file")
    add_launch_arguments(p)
    add_set_argument(p)
    add_resume_argument(p)
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a run.out_dir that holds another run, removing its outputs (run.overwrite = true)",
    )


def check_out_dir(cfg: Config, *, one_node: bool) -> None:
    """Before any process starts: run.out_dir can be written (one line otherwise, not a worker's
    traceback), and holds no other run unless this one resumes it or run.overwrite says to start
    over (the run's rank 0 then removes the old outputs first: trainer.py, ``clear_run_outputs``;
    nothing is removed here, so a check that stops before the launch changes nothing). The
    second check is for one-node jobs: every node of a multi-node job runs this command, and a
    node that joins an elastic job late finds the job's own outputs there."""
    from paratrain.checkpoint.manifest import run_outputs  # lazy: see the module docstring

    out = cfg.run.out_dir
    # The probe is a folder of a unique name in run.out_dir, or in its nearest existing parent
    # when it is not there yet: the check makes nothing of the run's own, so a command refused
    # later (a wrong job secret, another check) leaves nothing behind, and the nodes of one job
    # checking the same new folder at once never remove it under each other (it did: a node
    # exited 2, "cannot be written", in benchmarks/resilience/chaos.py's two-node job).
    where = os.path.abspath(out)
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        os.rmdir(tempfile.mkdtemp(dir=where, prefix=".paratrain-write-check-"))
    except OSError as e:
        raise ConfigError(
            f"run.out_dir = {out!r} cannot be written ({e.strerror or e}); pick a folder you can write to"
        ) from None
    if cfg.checkpoint.resume or cfg.run.overwrite or not one_node:
        return
    found = run_outputs(out, cfg.checkpoint.dir)
    if found:
        raise ConfigError(
            f"run.out_dir = {out!r} holds another run ({', '.join(found)}); continue it with --resume, start over"
            " there with --overwrite (its outputs and checkpoints are removed), or pick a new run.out_dir"
        )


def cmd_train(args: argparse.Namespace) -> int:
    with command_started():  # the workers' start-up lines count from here (observability/events.py)
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    from paratrain.launch.agent import launch  # lazy: see the module docstring
    from paratrain.observability.trackers import check_trackers  # lazy: see the module docstring
    from paratrain.preflight import check_run  # lazy: see the module docstring

    spec = launch_spec(args)
    if args.resume is not None:  # the flag sets checkpoint.resume (a TOML string literal)
        resume = resume_overrides(args.resume, args.overrides)  # first: a --set that disagrees is refused
        if args.resume != "latest" and not os.path.isdir(args.resume):
            raise ConfigError(
                f"--resume {args.resume}: no such checkpoint folder; pass a step-N folder"
                " (or omit PATH for the run's newest checkpoint)"
            )
        args.overrides = [*args.overrides, *resume]
    if args.overwrite:
        args.overrides = [*args.overrides, "run.overwrite=true"]
    cfg = load_config(args.config, args.overrides)
    for nodes in range(spec.nnodes, spec.max_nnodes + 1):  # elastic: every world the job may shrink or grow to
        try:
            check_run(cfg, spec.nproc_per_node * nodes)  # refuse an impossible layout before any process starts
        except ConfigError as e:
            if spec.max_nnodes == spec.nnodes:
                raise
            raise ConfigError(f"--nnodes {spec.nnodes}:{spec.max_nnodes} at {nodes} node(s): {e}") from None
    check_trackers(cfg.metrics, out_dir=cfg.run.out_dir)  # and a tracker that could not start
    check_out_dir(cfg, one_node=spec.max_nnodes == 1)  # last: the refusals above leave the folder as it was
    module_args = [args.config] + [a for o in args.overrides for a in ("--set", o)]
    # After a preemption the workers leave checkpoint.exit_code_on_preempt to their node's launcher.
    return launch(spec, "paratrain.launch.worker", module_args, job=cfg)


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="TOML config file")
    p.add_argument(
        "--checkpoint",
        default="",
        metavar="PATH",
        help="a step-N checkpoint folder, or 'latest' (default: the model as configured, e.g. its model.hf weights)",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_launch_arguments(p)
    add_set_argument(p)


def cmd_eval(args: argparse.Namespace) -> int:
    from paratrain.launch.agent import launch  # lazy: see the module docstring
    from paratrain.launch.eval_worker import check_eval_args  # lazy: see the module docstring
    from paratrain.preflight import check_run  # lazy: see the module docstring

    spec = launch_spec(args)
    cfg = load_config(args.config, args.overrides)
    check_run(cfg, spec.world_size)
    check_eval_args(cfg, args.checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        module_args = [args.config, "--checkpoint", args.checkpoint, "--result", result_file]
        code = launch(
            spec, "paratrain.launch.eval_worker", module_args + [a for o in args.overrides for a in ("--set", o)]
        )
        if code != 0:
            return code
        with open(result_file) as f:
            result = json.load(f)
    if args.json:
        print(json.dumps(result))
    else:
        where = (
            f"at step {result['step']} ({result['checkpoint']}" if result["checkpoint"] else "(the model as configured"
        )
        extra = "".join(f", {k[4:]} {v:.4f}" for k, v in result.items() if k in ("val_recall_at_1", "val_mrr"))
        print(
            f"val_loss {result['val_loss']:.6f}{extra} over {result['samples']} samples ({result['val_items']} items)"
            f" {where}, world {result['world_size']}, {result['eval_time_s']:.1f}s)"
        )
    return 0


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="TOML config file")
    p.add_argument("--steps", type=int, default=5, help="optimiser steps of each run (default 5)")
    p.add_argument(
        "--tol",
        type=float,
        default=1e-4,
        help="relative tolerance of losses, gradient norms and parameters (default 1e-4)",
    )
    p.add_argument("--out-dir", default="", help="where both runs write (default: RUN.OUT_DIR/verify)")
    p.add_argument(
        "--layouts",
        default="",
        help="instead of the config's layout, a set of layouts of its objective against one process under plain"
        " SGD: comma-separated among accum, ddp, fsdp, tp, pp, cp, or 'all' (docs/objectives.md)",
    )
    add_launch_arguments(p)
    add_set_argument(p)


def cmd_verify(args: argparse.Namespace) -> int:

    from paratrain.verify import verify, verify_layouts  # lazy: see the module docstring

    if args.layouts:
        names = [n.strip() for n in args.layouts.split(",") if n.strip()]
        return verify_layouts(args.config, args.overrides, names, steps=args.steps, tol=args.tol, out_dir=args.out_dir)
    return verify(
        args.config, args.overrides, spec=launch_spec(args), steps=args.steps, tol=args.tol, out_dir=args.out_dir
    )


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", help="run.out_dir of a finished run (the built-in GPT, or model.hf: full or LoRA)")
    p.add_argument("--prompt", default="def ", help="text to continue (default %(default)r)")
    p.add_argument(
        "--chat",
        default=None,
        metavar="MESSAGE",
        help="one user turn through the run's chat template; prints the reply (instead of --prompt)",
    )
    p.add_argument(
        "--image",
        action="append",
        default=None,
        metavar="PATH",
        help="with --chat, an image shown before the message (repeatable; an image-text run)",
    )
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample at most (default %(default)s)")
    p.add_argument(
        "--temperature", type=float, default=0.8, help="sampling temperature; 0: greedy (default %(default)s)"
    )
    p.add_argument(
        "--top-k", type=int, default=40, help="sample among the k likeliest tokens; 0: all (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default %(default)s)")


def cmd_generate(args: argparse.Namespace) -> int:
    from paratrain.generate import chat_turn, generate_text  # lazy: see the module docstring

    options = {k: getattr(args, k) for k in ("max_new_tokens", "temperature", "top_k", "seed")}
    # Before the run is read: a negative --top-k ended in torch's "selected index k out of range"
    # traceback, and negative tokens or temperature printed the prompt alone or decoded greedily.
    for flag, value, least in (("--max-new-tokens", args.max_new_tokens, 1), ("--top-k", args.top_k, 0)):
        if value < least:
            raise ConfigError(f"generate {flag} {value}: must be >= {least}")
    if args.temperature < 0:
        raise ConfigError(f"generate --temperature {args.temperature}: must be >= 0 (0: greedy)")
    if args.image and args.chat is None:
        raise ConfigError("generate --image goes with --chat MESSAGE (the question about the image)")
    if args.chat is not None:
        reply, note = chat_turn(args.out_dir, args.chat, images=args.image, **options)
        print(reply)
        if note:  # on stderr: stdout stays the reply alone
            print(note, file=sys.stderr)
        return 0
    print(generate_text(args.out_dir, args.prompt, **options))
    return 0


def add_prepare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, directories (recursive) or globs")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (shards, tokenizer.json, meta.json)")
    p.add_argument(
        "--tokenizer",
        required=True,
        metavar="SPEC",
        help="'bytes', 'bpe:VOCAB' (trained here), or a tokenizer.json / its dir (chat/prompt: a transformers tokenizer dir)",
    )
    p.add_argument(
        "--format",
        choices=("chat", "prompt", "preference", "unpaired", "text", "auto"),
        default="text",
        help="chat: jsonl/parquet rows of messages; prompt: rows of prompt + completion; preference: rows of (prompt,)"
        " chosen + rejected, unpaired: prompt + completion + label (KTO; docs/preference.md); text (default);"
        " auto: by the fields",
    )
    p.add_argument(
        "--chat-template", default="", metavar="FILE", help="a Jinja chat template replacing the tokenizer's own"
    )
    p.add_argument(
        "--loss-on",
        choices=("assistant", "last", "all"),
        default="assistant",
        help="chat: train on every assistant turn (default), the last one, or all tokens (prompt rows: the completion)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=0,
        metavar="N",
        help="cut longer documents to N tokens, counted (default: none)",
    )
    p.add_argument("--text-field", default="text", help="field (jsonl) or column (parquet) of the text (default text)")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.005,
        help="share of documents in the val split (default 0.005; 1: all, for a held-out file prepared on its own)",
    )
    p.add_argument("--workers", type=int, default=1, help="tokenising processes (default 1)")
    p.add_argument(
        "--eos", type=int, default=None, metavar="ID", help="EOS id after each document (default: the tokenizer's)"
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="skip files whose path matches (fnmatch; repeatable)",
    )


def cmd_prepare(args: argparse.Namespace) -> int:

    from paratrain.data.prepare import prepare  # lazy: see the module docstring

    meta = prepare(
        args.inputs,
        out_dir=args.out,
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        val_fraction=args.val_fraction,
        workers=args.workers,
        eos=args.eos,
        exclude=args.exclude,
        fmt=args.format,
        chat_template=args.chat_template,
        loss_on=args.loss_on,
        max_length=args.max_length,
    )
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    chat = (
        f"; trainable tokens: train {train['trainable_tokens']}, val {val['trainable_tokens']};"
        f" {meta['truncated_documents']} truncated, {meta['skipped_documents']} skipped"
        + (
            " (" + ", ".join(f"{n} {why}" for why, n in meta.get("skipped_by_reason", {}).items()) + ")"
            if meta["skipped_documents"]
            else ""
        )
        if meta["loss_mask"]
        else ""
    )
    docs = train["documents"] + val["documents"]
    paired = meta["document_format"] in ("preference", "unpaired")
    what = (
        f"{docs // 2} {'pairs' if meta['document_format'] == 'preference' else 'rows'} ({docs} documents)"
        if paired
        else f"{docs} documents"
    )
    print(
        f"prepared {what} ({meta['document_format']},"
        f" {meta['text_bytes'] / 1e6:.1f} MB of text): train {train['tokens']} tokens, val {val['tokens']} tokens{chat},"
        f" vocab {meta['vocab_size']} ({meta['dtype']}), EOS {meta['eos_id']} -> {args.out}"
    )
    return 0


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        metavar="SOURCE",
        help="a step-N checkpoint folder, a checkpoints folder (its newest), or a finished run's run.out_dir (its"
        " final model.safetensors)",
    )
    p.add_argument("--to", metavar="FILE", help="output .safetensors file")
    p.add_argument(
        "--hf", metavar="DIR", help="output directory in transformers format (runs with model.hf): from_pretrained(DIR)"
    )
    p.add_argument(
        "--peft",
        metavar="DIR",
        help="a LoRA run's adapters as a PEFT directory: PeftModel.from_pretrained(base, DIR), or"
        " AutoPeftModelForCausalLM.from_pretrained(DIR) for model.hf runs",
    )
    p.add_argument("--merge", action="store_true", help="with --hf: a LoRA run's adapters merged into the base")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file or directory")


def refuse_overwrite(path: str, flag: str, *, overwrite: bool) -> None:
    """One line, before anything is read or written, for an output that exists (a file, or a
    directory with anything in it) unless ``--overwrite``: an export never replaces a model unasked."""
    if overwrite or not os.path.exists(path):
        return
    if os.path.isdir(path) and not os.listdir(path):
        return  # an empty directory holds nothing to lose
    kind = "directory" if os.path.isdir(path) else "file"
    raise ConfigError(f"{flag} {path}: the {kind} exists; pick a new path, or pass --overwrite to replace it")


def cmd_export(args: argparse.Namespace) -> int:
    from paratrain.checkpoint import export_safetensors  # lazy: see the module docstring

    if sum(map(bool, (args.to, args.hf, args.peft))) != 1:
        raise ConfigError(
            "paratrain export needs exactly one of --to FILE (safetensors), --hf DIR (transformers) or --peft DIR"
            " (a LoRA run's adapters)"
        )
    if args.merge and not args.hf:
        raise ConfigError("export --merge goes with --hf DIR (the merged model in transformers format)")
    flag, out = next((f, v) for f, v in (("--to", args.to), ("--hf", args.hf), ("--peft", args.peft)) if v)
    if os.path.abspath(out) == os.path.abspath(args.checkpoint):
        raise ConfigError(f"{flag} {out} is the folder being exported; pick another path")
    refuse_overwrite(out, flag, overwrite=args.overwrite)
    if args.to and os.path.isdir(args.to):
        raise ConfigError(f"--to {args.to} is a directory; pass a .safetensors file path")
    if args.peft or args.merge:
        return export_lora(args.checkpoint, peft=args.peft, merged=args.hf)
    if args.hf:
        return export_hf_dir(args.checkpoint, args.hf)
    info = export_safetensors(args.checkpoint, args.to)
    print(
        f"exported {info['tensors']} tensors ({info['parameters'] / 1e6:.2f}M parameters) of step"
        f" {info['step']} from {info['path']} to {args.to}"
    )
    return 0


def export_lora(checkpoint: str, *, peft: str | None, merged: str | None) -> int:
    """A LoRA checkpoint's (or run's) adapters -> a PEFT adapter directory, or merged into the base (docs/lora.md)."""
    from paratrain.checkpoint.export import read_export_source  # lazy: see the module docstring
    from paratrain.models.hf.weights import weight_files  # lazy: transformers, an optional extra
    from paratrain.models.lora_export import adapters_of, export_merged, export_peft  # lazy: see the module docstring

    weights, manifest, path, config_file = read_export_source(checkpoint)
    cfg = load_config(config_file)
    flag = "--peft" if peft else "--merge"
    if not cfg.model.lora.enabled:
        raise ConfigError(
            f"export {flag}: {path} is not of a LoRA run (no [model.lora] in its config.toml);"
            " export it with --to FILE or --hf DIR"
        )
    adapters = adapters_of(weights, path=path, flag=flag)
    # A run's final weights hold the very base it trained on (a checkpoint, adapters only).
    base = {k: v for k, v in weights.items() if k not in adapters} if "files" not in manifest else None
    if peft:
        n, base_path = export_peft(adapters, model_cfg=cfg.model, out_dir=peft, base_weights=base)
        print(f"exported {n} adapter tensors of step {manifest['step']} from {path} to {peft} (PEFT adapter)")
        if base_path and base_path.startswith(os.path.abspath(peft) + os.sep):
            print(f"its base, made from the run's seed ({cfg.model.hf} holds no weights), written to {base_path}")
        elif base_path and os.path.isdir(base_path) and not weight_files(base_path):
            print(
                f"note: its base {cfg.model.hf} holds no weights (the run trained on a base made from its seed), so"
                " AutoPeftModelForCausalLM cannot load this adapter; export the finished run's run.out_dir, which"
                " writes that base beside the adapter"
            )
        return 0
    if not cfg.model.hf:
        raise ConfigError(f"export --merge: {path} is not of a model.hf run; export its adapters with --peft DIR")
    # Merged into the run's own base: no hash to check.
    export_merged(adapters, model_cfg=cfg.model, out_dir=merged, base=manifest.get("base"), base_weights=base)
    print(f"exported the base with {len(adapters)} adapter tensors of step {manifest['step']} merged to {merged}")
    return 0


def export_hf_dir(checkpoint: str, out_dir: str) -> int:
    """A checkpoint (or a finished run) of a ``model.hf`` run -> a directory ``from_pretrained`` loads (docs/huggingface.md)."""
    from paratrain.checkpoint.export import read_export_source  # lazy: see the module docstring
    from paratrain.models.hf import export_hf  # lazy: see the module docstring

    weights, manifest, path, config_file = read_export_source(checkpoint)
    cfg = load_config(config_file)  # the run's resolved config, saved with the checkpoint
    if cfg.model.lora.enabled:
        what = (
            "checkpoint {} holds LoRA adapters only, not the full model" if "files" in manifest else "{} is a LoRA run"
        )
        raise ConfigError(
            what.format(path) + ": export --hf DIR --merge writes the base with the adapters merged in, --peft DIR"
            " the adapters"
        )
    if not cfg.model.hf:
        raise ConfigError(f"{path} is not of a model.hf run (no transformers config to export with); use --to FILE")
    export_hf(weights, model_cfg=cfg.model, out_dir=out_dir)
    print(f"exported {len(weights)} tensors of step {manifest['step']} from {path} to {out_dir} (transformers format)")
    return 0


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None, help="TOML config file (defaults if omitted)")
    p.add_argument("--keys", action="store_true", help="list every key with its type, default and meaning")
    add_set_argument(p)


def cmd_config(args: argparse.Namespace) -> int:
    if args.keys:
        print(describe_keys())
    else:
        print(to_toml(load_config(args.config, args.overrides)), end="")
    return 0


def add_bench_commands(p: argparse.ArgumentParser) -> None:
    """``paratrain bench comm|compute``: two commands of their own under ``bench``."""
    from paratrain.hardware.bench_comm import add_bench_arguments  # lazy: see the module docstring
    from paratrain.hardware.bench_compute import add_compute_arguments  # lazy: see the module docstring

    bench = p.add_subparsers(dest="bench", required=True)
    p = bench.add_parser("comm", help="collective bandwidth on the job's processes (checked results, slow links)")
    add_launch_arguments(p)
    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench_comm)
    p = bench.add_parser("compute", help="matmul FLOP/s and memory-copy bandwidth of one device")
    add_compute_arguments(p)
    p.set_defaults(func=cmd_bench_compute)


def cmd_bench_comm(args: argparse.Namespace) -> int:

    from paratrain.hardware.bench_comm import validate_bench_args, worker_args  # lazy: see the module docstring
    from paratrain.launch.agent import launch  # lazy: see the module docstring

    spec = launch_spec(args)
    validate_bench_args(args)  # refuse bad options before any process starts
    return launch(spec, "paratrain.hardware.bench_comm", worker_args(args))


def cmd_bench_compute(args: argparse.Namespace) -> int:

    from paratrain.hardware.bench_compute import compute_main  # lazy: see the module docstring

    return compute_main(args)


def add_rendezvous_commands(p: argparse.ArgumentParser) -> None:
    """``paratrain rendezvous serve``: the rendezvous store as a process of its own."""
    from paratrain.distributed import rendezvous  # lazy: see the module docstring

    sub = p.add_subparsers(dest="rendezvous", required=True)
    p = sub.add_parser(
        "serve",
        help="host the rendezvous store of multi-node jobs until SIGTERM (no training node then hosts it)",
        description=(
            "Host the rendezvous store that `paratrain train --rdzv-endpoint HOST:PORT --rdzv-conf is_host=false`"
            " nodes meet at, so that no training node hosts it and an elastic job (--nnodes MIN:MAX) survives"
            " the loss of any node. It needs no job secret: the nodes sign and verify every value"
            " (docs/resilience.md)."
        ),
    )
    p.add_argument("--port", type=int, default=rendezvous.DEFAULT_PORT, help="port (default 29400; 0: a free one)")
    p.add_argument(
        "--bind",
        default="",
        metavar="ADDR",
        help="address to listen on (default: the one this host's name resolves to; 0.0.0.0: every interface)",
    )
    p.set_defaults(func=cmd_rendezvous_serve)


def cmd_rendezvous_serve(args: argparse.Namespace) -> int:
    from paratrain.distributed import rendezvous  # lazy: see the module docstring

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: expected a port within 0..65535")
    return rendezvous.serve(args.port, args.bind, ready=lambda line: print(line, flush=True))


def add_env_arguments(p: argparse.ArgumentParser) -> None:
    from paratrain.hardware import env as env_command  # lazy: see the module docstring

    add_launch_arguments(p)
    env_command.add_env_arguments(p)


def cmd_env(args: argparse.Namespace) -> int:

    from paratrain.hardware.env import env_main, env_worker_args  # lazy: see the module docstring
    from paratrain.launch.agent import launch  # lazy: see the module docstring

    spec = launch_spec(args)
    if spec.world_size == 1:
        return env_main(args)
    return launch(spec, "paratrain.hardware.env", env_worker_args(args))


def add_find_batch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="TOML config file")
    p.add_argument(
        "--memory-gib", type=float, default=None, help="per-rank memory budget in GiB (implies the estimate)"
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object as the last line (the table goes to stderr)"
    )
    p.add_argument("--estimate", action="store_true", help="estimate on fake tensors even where a GPU could run trials")
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes per node of the job to plan (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of the job to plan (default 1)")
    p.add_argument("--local-processes", type=int, default=0, help=argparse.SUPPRESS)  # RAM share on CPU
    add_set_argument(p)


def cmd_find_batch(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    from paratrain.preflight.support import (  # lazy: torch, as the command's own imports
        refuse_image_estimate,
        refuse_unpriced_estimate,
    )

    refuse_image_estimate(cfg, "paratrain find-batch")
    refuse_unpriced_estimate(cfg, "paratrain find-batch")
    if args.memory_gib is not None:
        if args.memory_gib <= 0:
            raise ConfigError("--memory-gib must be > 0 (GiB per rank)")
        cfg.batch.memory_gib = args.memory_gib
    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise ConfigError("--nproc-per-node and --nnodes must be >= 1")
    return cli_find_batch(
        cfg,
        world_size=args.nproc_per_node * args.nnodes,
        local_processes=args.local_processes or args.nproc_per_node,
        estimate=args.estimate,
        as_json=args.json,
    )


def cli_find_batch(cfg: Config, *, world_size: int, local_processes: int, estimate: bool, as_json: bool) -> int:
    """`paratrain find-batch`: real trials on a local CUDA device, else the fake-tensor estimate."""
    from paratrain.batch.auto import estimate_without_group, find_micro_batch  # lazy: see the module docstring
    from paratrain.batch.measure import replica_dims  # lazy: see the module docstring
    from paratrain.batch.search import nothing_fits_error  # lazy: see the module docstring
    from paratrain.distributed.process_group import resolve_device  # lazy: see the module docstring
    from paratrain.preflight import check_run  # lazy: see the module docstring

    dims, _ = check_run(cfg, world_size)
    # The estimate runs one rank's step under fake process groups: a pipeline schedule's stages
    # cannot exchange their inputs' shapes there (torch's PipeliningMetadataError), and context
    # parallel's ring has no peers (the rows were measured whole, as at cp = 1). plan models both.
    for degree, what in (("pp", "a pipeline"), ("cp", "a context-parallel")):
        if getattr(dims, degree) > 1:
            raise ConfigError(
                f"paratrain find-batch cannot estimate {what} step yet (parallel.{degree} = {getattr(dims, degree)});"
                f" set parallel.{degree} = 1, or run `paratrain plan`, which prices the micro-batches of such layouts"
            )
    device = resolve_device(cfg.dist, 0)
    use_trial = (
        not estimate and device.type == "cuda" and cfg.batch.memory_gib <= 0 and replica_dims(dims).world_size == 1
    )
    if use_trial:
        # Replicas of one process hold the same memory on every GPU: one GPU answers for all.
        result = find_micro_batch(cfg, dims, device=device, method="trial", local_processes=local_processes)
    else:
        result = estimate_without_group(cfg, dims, device=device, local_processes=local_processes)
    print(result.table(), file=sys.stderr if as_json else sys.stdout)
    if as_json:
        print(json.dumps(result.to_json()))
    if result.micro_batch_size is None:
        raise nothing_fits_error(result, dims)
    return 0


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run.out_dir of runs (config.toml, metrics.jsonl)")
    p.add_argument("--out", default="report.html", help="the HTML file to write (default report.html)")
    p.add_argument("--png", default="", metavar="FILE", help="also write the plots alone to this PNG")


def cmd_report(args: argparse.Namespace) -> int:
    from paratrain.observability.report import write_report  # lazy: see the module docstring

    info = write_report(args.run_dirs, out=args.out, png=args.png)
    print(f"report of {info['runs']} run(s) written to {args.out}" + (f" and {args.png}" if args.png else ""))
    return 0


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="TOML config file")
    p.add_argument("--nproc-per-node", type=int, required=True, help="GPUs (processes) per node")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--memory-gib", type=float, default=0.0, help="memory per rank in GiB (default: the profile's)")
    p.add_argument("--hardware", default="h100-sxm", help="profile: a100-80gb, h100-sxm, h200, b200 or cpu")
    p.add_argument(
        "--calibrate",
        action="append",
        default=[],
        metavar="JSON",
        help="a `bench compute/comm --json` file; repeatable",
    )
    p.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line (table to stderr)")
    add_set_argument(p)


def cmd_plan(args: argparse.Namespace) -> int:
    from paratrain.plan import cli_plan  # lazy: see the module docstring

    cfg = load_config(args.config, args.overrides)
    from paratrain.preflight.support import (  # lazy: torch, as the command's own imports
        refuse_image_estimate,
        refuse_unpriced_estimate,
    )

    refuse_image_estimate(cfg, "paratrain plan")
    refuse_unpriced_estimate(cfg, "paratrain plan")
    return cli_plan(
        cfg,
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        hardware=args.hardware,
        calibrate_files=args.calibrate,
        memory_gib=args.memory_gib,
        top=args.top,
        as_json=args.json,
    )


# The subcommands: (name, help, the function that adds its arguments, the function that runs it).
# ``bench`` has commands of its own (comm, compute), each with its own function.
COMMANDS = (
    ("train", "train a config (through torchrun's launcher)", add_train_arguments, cmd_train),
    (
        "prepare",
        "tokenise text files, jsonl or parquet into token shards for data.name='tokens'",
        add_prepare_arguments,
        cmd_prepare,
    ),
    (
        "eval",
        "the validation loss of a checkpoint ([data] and [eval] of CONFIG), any world size",
        add_eval_arguments,
        cmd_eval,
    ),
    (
        "export",
        "write a checkpoint's full weights (any layout) to safetensors or an HF dir",
        add_export_arguments,
        cmd_export,
    ),
    (
        "verify",
        "run a layout and the single-process reference; compare losses and weights",
        add_verify_arguments,
        cmd_verify,
    ),
    (
        "find-batch",
        "find the largest micro-batch that fits in memory (trials on CUDA, else an estimate)",
        add_find_batch_arguments,
        cmd_find_batch,
    ),
    ("plan", "rank the layouts of a config on a cluster: predicted step time and memory", add_plan_arguments, cmd_plan),
    ("generate", "sample text or a chat reply from a trained run", add_generate_arguments, cmd_generate),
    (
        "report",
        "one self-contained HTML page comparing runs (plots, layouts, config diff)",
        add_report_arguments,
        cmd_report,
    ),
    ("config", "print the resolved config, or every key with --keys", add_config_arguments, cmd_config),
    ("bench", "benchmark collectives (comm) or one device (compute)", add_bench_commands, None),
    ("env", "versions, devices, network, variables and the problems found, with advice", add_env_arguments, cmd_env),
    ("rendezvous", "serve the rendezvous store of multi-node jobs (serve)", add_rendezvous_commands, None),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``command`` only that subcommand's arguments are built (the others are
    listed with their help, so ``paratrain --help`` still shows them all)."""
    parser = argparse.ArgumentParser(
        prog="paratrain", description="Train any PyTorch model on many processes, GPUs and machines."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_, add_arguments, run in COMMANDS:
        p = sub.add_parser(name, help=help_)
        if command is None or command == name:
            add_arguments(p)
        if run is not None:
            p.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        argv = sys.argv[1:] if argv is None else argv
        command = argv[0] if argv and not argv[0].startswith("-") else ""  # "": none (`paratrain --help`)
        args = build_parser(command).parse_args(argv)  # inside: an option's own check (--nnodes) raises ConfigError
        code = args.func(args)
        sys.stdout.flush()  # here, where a reader that left (BrokenPipeError) is handled, not at exit
        return code
    except ConfigError as e:
        print(f"paratrain: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader left (`paratrain config --keys | head`): not an error of ours. Point stdout at
        # devnull so the interpreter's flush at exit does not raise again (Python's signal docs).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
