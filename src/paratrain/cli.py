"""The `paratrain` command: a thin layer over the library.

Bad input exits with code 2 and one line naming the problem and the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from paratrain.config import ConfigError, describe_keys, load_config, to_toml


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config key (value is a TOML literal); repeatable; wins over the file",
    )


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes on this node (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (a hint under c10d rendezvous)")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous, the same on every node")
    p.add_argument("--max-restarts", type=int, default=0, help="restart the workers up to K times on failure")


def launch_spec(args: argparse.Namespace):
    from paratrain.launch import LaunchSpec

    spec = LaunchSpec(args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint, args.max_restarts)
    spec.validate()
    return spec


def cmd_train(args: argparse.Namespace) -> int:
    from paratrain.launch import launch
    from paratrain.trainer import check_layout

    spec = launch_spec(args)
    if args.resume is not None:  # the flag sets checkpoint.resume (a TOML string literal)
        if args.resume != "latest" and not os.path.isdir(args.resume):
            raise ConfigError(
                f"--resume {args.resume}: no such checkpoint folder; pass a step-N folder"
                " (or omit PATH for the run's newest checkpoint)"
            )
        args.overrides = [*args.overrides, "checkpoint.resume=" + json.dumps(args.resume)]
    cfg = load_config(args.config, args.overrides)
    check_layout(cfg, spec.world_size)  # refuse an impossible layout before any process starts
    module_args = [args.config] + [a for o in args.overrides for a in ("--set", o)]
    return launch(spec, "paratrain.train", module_args)


def cmd_verify(args: argparse.Namespace) -> int:
    from paratrain.verify import verify

    return verify(
        args.config, args.overrides, spec=launch_spec(args), steps=args.steps, tol=args.tol, out_dir=args.out_dir
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from paratrain.generate import generate_text

    print(
        generate_text(
            args.out_dir,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
        )
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from paratrain.checkpoint import export_safetensors

    info = export_safetensors(args.checkpoint, args.to)
    print(
        f"exported {info['tensors']} tensors ({info['parameters'] / 1e6:.2f}M parameters) of step"
        f" {info['step']} from {info['path']} to {args.to}"
    )
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.keys:
        print(describe_keys())
    else:
        print(to_toml(load_config(args.config, args.overrides)), end="")
    return 0


def cmd_bench_comm(args: argparse.Namespace) -> int:
    from paratrain.bench.comm import validate_bench_args, worker_args
    from paratrain.launch import launch

    spec = launch_spec(args)
    validate_bench_args(args)  # refuse bad options before any process starts
    return launch(spec, "paratrain.bench.comm", worker_args(args))


def cmd_bench_compute(args: argparse.Namespace) -> int:
    from paratrain.bench.compute import compute_main

    return compute_main(args)


def cmd_env(args: argparse.Namespace) -> int:
    from paratrain.env import env_main, env_worker_args
    from paratrain.launch import launch

    spec = launch_spec(args)
    if spec.world_size == 1:
        return env_main(args)
    return launch(spec, "paratrain.env", env_worker_args(args))


def cmd_find_batch(args: argparse.Namespace) -> int:
    from paratrain.find_batch import cli_find_batch

    cfg = load_config(args.config, args.overrides)
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


def cmd_plan(args: argparse.Namespace) -> int:
    from paratrain.plan import cli_plan

    return cli_plan(
        load_config(args.config, args.overrides),
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        hardware=args.hardware,
        calibrate_files=args.calibrate,
        memory_gib=args.memory_gib,
        top=args.top,
        as_json=args.json,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paratrain", description="Train any PyTorch model on many processes, GPUs and machines."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a config (through torchrun's launcher)")
    p.add_argument("config", help="TOML config file")
    add_launch_arguments(p)
    add_set_argument(p)
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="continue from the newest complete checkpoint of the run, or from PATH",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("export", help="write a checkpoint's full weights (any layout) to one safetensors file")
    p.add_argument("checkpoint", help="a step-N checkpoint folder (or a checkpoints folder: its newest)")
    p.add_argument("--to", required=True, metavar="FILE", help="output .safetensors file")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("verify", help="run a layout and the single-process reference; compare losses and weights")
    p.add_argument("config", help="TOML config file")
    p.add_argument("--steps", type=int, default=5, help="optimiser steps of each run (default 5)")
    p.add_argument("--tol", type=float, default=1e-4, help="relative tolerance of losses and parameters (default 1e-4)")
    p.add_argument("--out-dir", default="", help="where both runs write (default: RUN.OUT_DIR/verify)")
    add_launch_arguments(p)
    add_set_argument(p)
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser(
        "find-batch", help="find the largest micro-batch that fits in memory (trials on CUDA, else an estimate)"
    )
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
    p.set_defaults(func=cmd_find_batch)

    p = sub.add_parser("plan", help="rank the layouts of a config on a cluster: predicted step time and memory")
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
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("generate", help="sample text from a trained byte-level GPT")
    p.add_argument("out_dir", help="run.out_dir of a finished run")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("config", help="print the resolved config, or every key with --keys")
    p.add_argument("config", nargs="?", default=None, help="TOML config file (defaults if omitted)")
    p.add_argument("--keys", action="store_true", help="list every key with its type, default and meaning")
    add_set_argument(p)
    p.set_defaults(func=cmd_config)

    # --- communication and hardware: bench comm, bench compute, env ---------------------------
    from paratrain.bench.comm import add_bench_arguments
    from paratrain.bench.compute import add_compute_arguments
    from paratrain.env import add_env_arguments

    p = sub.add_parser("bench", help="benchmark collectives (comm) or one device (compute)")
    bench = p.add_subparsers(dest="bench", required=True)
    p = bench.add_parser("comm", help="collective bandwidth on the job's processes (checked results, slow links)")
    add_launch_arguments(p)
    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench_comm)
    p = bench.add_parser("compute", help="matmul FLOP/s and memory-copy bandwidth of one device")
    add_compute_arguments(p)
    p.set_defaults(func=cmd_bench_compute)

    p = sub.add_parser("env", help="versions, devices, network, variables and the problems found, with advice")
    add_launch_arguments(p)
    add_env_arguments(p)
    p.set_defaults(func=cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"paratrain: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
