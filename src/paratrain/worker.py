"""The process torchrun starts: ``torchrun ... -m paratrain.worker CONFIG [--set section.key=value ...]``.

Parses the config and calls :func:`paratrain.trainer.train`; a bad config exits with code 2 and
one line. (``-m paratrain.train`` is kept as an alias: see train.py.)
"""

from __future__ import annotations

import argparse
import json
import sys

from paratrain.cli import add_set_argument
from paratrain.config import ConfigError, load_config
from paratrain.distributed.hang import CollectiveTimeout
from paratrain.trainer import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paratrain.worker", description=__doc__)
    parser.add_argument("config", help="TOML config file")
    add_set_argument(parser)
    parser.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="continue from the newest complete checkpoint of the run, or from PATH",
    )
    args = parser.parse_args(argv)
    try:
        if args.resume is not None:
            args.overrides.append("checkpoint.resume=" + json.dumps(args.resume))
        train(load_config(args.config, args.overrides))
    except ConfigError as e:
        print(f"paratrain: error: {e}", file=sys.stderr)
        return 2
    except CollectiveTimeout as e:  # already explained: no traceback
        print(f"paratrain: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
