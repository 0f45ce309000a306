"""The ``relayrl`` command: train | sft | serve | eval | plot | show | demo.

Each subcommand imports its heavy modules lazily so ``relayrl --help`` is instant.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relayrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("config-reference", help="Print the reference of every config field (docs/config.md).")
    args, rest = parser.parse_known_args(argv)
    if args.command == "config-reference":
        from relayrl.api.config import config_reference

        print(config_reference(), end="")
        return 0
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
