"""The `paratrain` command: a thin layer over the library.

Bad input exits with code 2 and one line naming the problem and the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from paratrain.config import ConfigError, describe_keys, load_config, to_toml
from paratrain.train import add_set_argument


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
    cfg = load_config(args.config, args.overrides)
    check_layout(cfg, spec.world_size)  # refuse an impossible layout before any process starts
    module_args = [args.config] + [a for o in args.overrides for a in ("--set", o)]
    return launch(spec, "paratrain.train", module_args)


def cmd_generate(args: argparse.Namespace) -> int:
    from paratrain.generate import generate_text

    print(generate_text(args.out_dir, args.prompt, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_k=args.top_k, seed=args.seed))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.keys:
        print(describe_keys())
    else:
        print(to_toml(load_config(args.config, args.overrides)), end="")
    return 0


def cmd_find_batch(args: argparse.Namespace) -> int:
    from paratrain.find_batch import cli_find_batch

    cfg = load_config(args.config, args.overrides)
    if args.memory_gib is not None:
        if args.memory_gib <= 0:
            raise ConfigError("--memory-gib must be > 0 (GiB per rank)")
        cfg.batch.memory_gib = args.memory_gib
    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise ConfigError("--nproc-per-node and --nnodes must be >= 1")
    return cli_find_batch(cfg, world_size=args.nproc_per_node * args.nnodes,
                          local_processes=args.local_processes or args.nproc_per_node,
                          estimate=args.estimate, as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paratrain", description="Train any PyTorch model on many processes, GPUs and machines.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a config (through torchrun's launcher)")
    p.add_argument("config", help="TOML config file")
    add_launch_arguments(p)
    add_set_argument(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("find-batch", help="find the largest micro-batch that fits in memory (trials on CUDA, else an estimate)")
    p.add_argument("config", help="TOML config file")
    p.add_argument("--memory-gib", type=float, default=None, help="per-rank memory budget in GiB (implies the estimate)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line (the table goes to stderr)")
    p.add_argument("--estimate", action="store_true", help="estimate on fake tensors even where a GPU could run trials")
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes per node of the job to plan (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of the job to plan (default 1)")
    p.add_argument("--local-processes", type=int, default=0, help=argparse.SUPPRESS)  # RAM share on CPU
    add_set_argument(p)
    p.set_defaults(func=cmd_find_batch)

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
