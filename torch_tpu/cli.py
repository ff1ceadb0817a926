"""The `torch-tpu` command: `torch-tpu <command> [options]`.

Each command lives in its own module and exposes `add_arguments(parser)` and
`run(args) -> int`; this module only routes. Add a command by adding a line
to COMMANDS.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# command name -> module implementing it
COMMANDS = {
    "info": "torch_tpu.cli_info",
    "numerics": "torch_tpu.cli_numerics",
    "cache": "torch_tpu.cli_cache",
    "doctor": "torch_tpu.cli_doctor",
    "migrate": "torch_tpu.cli_migrate",
    "report": "torch_tpu.cli_report",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torch-tpu", description="torch_tpu: a TPU as a native PyTorch device")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
