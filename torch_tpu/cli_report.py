"""Render the metrics of a finished run: `torch-tpu report FILE [--json]`.

FILE is what the runtime writes at exit when TORCH_TPU_METRICS_FILE is set
(metrics_file.py): counters, report sections and the top recompiling sites.
"""
from __future__ import annotations

import argparse
import json
import sys

# Counters shown first, with their labels; the rest follow by name.
_LABELS = {
    "ops_executed": "ops executed",
    "programs_compiled": "programs compiled",
    "compile_seconds": "seconds compiling",
    "cache_hits": "program cache hits",
    "cache_misses": "program cache misses",
    "h2d_transfers": "host->device transfers",
    "d2h_transfers": "device->host transfers",
    "materializations": "materializations",
    "ops_deferred": "deferred ops",
    "flushes": "DeferAndFuse flushes",
    "fused_executions": "fused programs run",
    "decompositions": "decompositions",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the JSON file a run wrote (TORCH_TPU_METRICS_FILE)")
    parser.add_argument("--json", action="store_true", help="print the data as JSON instead of tables")


def load(path: str) -> dict:
    """The metrics file's data; ValueError if it is not one."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not a torch_tpu metrics file (invalid JSON: {err})") from None
    if not isinstance(data, dict) or "counters" not in data:
        raise ValueError(f"{path}: not a torch_tpu metrics file (no counters; written with TORCH_TPU_METRICS_FILE?)")
    return data


def _value(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def render(data: dict, console) -> None:
    from rich.table import Table

    command = " ".join(data.get("argv") or []) or "?"
    console.print(f"[bold]torch_tpu metrics[/bold] of `{command}` (pid {data.get('pid', '?')})")
    counters = data["counters"]
    table = Table(title="counters", show_header=True, header_style="bold")
    table.add_column("counter")
    table.add_column("value", justify="right")
    for name, label in _LABELS.items():
        if name in counters:
            table.add_row(label, _value(counters[name]))
    for name in sorted(counters):
        if name not in _LABELS and counters[name]:
            table.add_row(name, _value(counters[name]))
    console.print(table)
    for section, rows in (data.get("sections") or {}).items():
        if section == "recompiles":
            continue  # the structured table below says more
        table = Table(title=section, show_header=False)
        table.add_column("what")
        table.add_column("value")
        for label, value in rows.items():
            table.add_row(label, _value(value))
        console.print(table)
    sites = data.get("recompiles") or []
    if not sites:
        console.print("recompiles: none (no site compiled twice)")
        return
    table = Table(title="top recompiling sites", show_header=True, header_style="bold")
    for column in ("site", "where", "recompiles", "why (last)", "fix"):
        table.add_column(column, overflow="fold")
    for site in sites:
        last = "; ".join(f"{c['what']}: {c['old']} -> {c['new']}" for c in site.get("last", [])[:3])
        table.add_row(site["name"], site["where"], str(site["recompiles"]), last, site.get("fix", ""))
    console.print(table)


def run(args: argparse.Namespace) -> int:
    try:
        data = load(args.file)
    except (OSError, ValueError) as err:
        print(f"torch-tpu report: {err}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(data, sys.stdout, indent=1)
        print()
        return 0
    from rich.console import Console

    render(data, Console(width=None if sys.stdout.isatty() else 160))
    return 0
