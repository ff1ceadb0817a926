"""Find PyTorch/XLA and CUDA code to move to tpu: `torch-tpu migrate PATH [--apply] [--check] [--json]`.

Without options: a report (file:line, what, the tpu replacement, mechanical or
manual). --apply rewrites the mechanical cases in place (only files under PATH)
and prints the diff; --check exits 1 while anything is left (after --apply:
while manual cases are left); --json prints the findings as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a directory (searched for .py files) or one .py file")
    parser.add_argument("--apply", action="store_true", help="rewrite the mechanical cases in place, print the diff")
    parser.add_argument("--check", action="store_true", help="exit 1 while anything is left to migrate")
    parser.add_argument("--json", action="store_true", help="findings as JSON")


def run(args: argparse.Namespace) -> int:
    from torch_tpu import migrate

    if not os.path.exists(args.path):
        print(f"torch-tpu migrate: {args.path}: no such file or directory", file=sys.stderr)
        return 2
    if args.apply:
        findings, diff, errors = migrate.apply(args.path)
        applied = [f for f in findings if f.mechanical]
        left = [f for f in findings if not f.mechanical]
    else:
        findings, errors = migrate.scan(args.path)
        diff, applied, left = "", [], findings
    if args.json:
        json.dump({"findings": [f.as_dict() for f in findings], "applied": len(applied), "left": len(left),
                   "errors": errors}, sys.stdout, indent=1)
        print()
    else:
        if diff:
            print(diff, end="" if diff.endswith("\n") else "\n")
        shown = left if args.apply else findings
        for finding in shown:
            print(finding)
        mechanical = sum(f.mechanical for f in findings)
        if args.apply:
            print(f"rewrote {len(applied)} mechanical cases; {len(left)} left to change by hand")
        else:
            print(f"{len(findings)} findings: {mechanical} mechanical (torch-tpu migrate --apply rewrites them), "
                  f"{len(findings) - mechanical} to change by hand")
        for error in errors:
            print(f"skipped {error}", file=sys.stderr)
    if args.check and (left or errors):
        return 1
    return 0
