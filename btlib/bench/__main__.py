"""Command line: ``python -m btlib.bench list``, ``run NAME [--quick] [--threads N] [--rounds N] [--runs N] [--json PATH]``, ``summary [PATH ...]``."""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

from ..device import machine_line
from . import load_all, load_rows, run, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m btlib.bench", description="btlib's benchmarks")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list the declared benchmarks")
    r = sub.add_parser("run", help="check, then time, every provider of one benchmark")
    r.add_argument("name")
    r.add_argument("--quick", action="store_true", help="small sizes (as CI runs them)")
    r.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the run")
    r.add_argument("--json", default=None, help="write the rows to this JSON-lines file")
    r.add_argument("--rounds", type=int, default=1, help="run N times, keep each (provider, x)'s best row (noisy machines)")
    r.add_argument("--runs", type=int, default=None, help="time exactly N calls after one warm-up (default: 5 or more, >= 0.5 s)")
    r.add_argument("--providers", default=None, help="comma-separated subset of the providers, e.g. fastpath,btlib_packed")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a parameter, e.g. --set B=32 --set T=256 --set x_vals=[0.5,0.75] (Python literals)")
    s = sub.add_parser("summary", help="print a table of saved rows")
    s.add_argument("paths", nargs="*", default=["build/bench"], help="JSON-lines files or directories")
    args = parser.parse_args(argv)

    benches = load_all()
    if args.cmd == "list":
        for name, b in sorted(benches.items()):
            print(f"{name:28s} x={b.x_name:8s} {b.description}")
        return 0
    if args.cmd == "run":
        if args.name not in benches:
            print(f"unknown benchmark {args.name!r}; try: {', '.join(sorted(benches))}", file=sys.stderr)
            return 2
        bench = benches[args.name]
        try:
            params = {k: ast.literal_eval(v) for k, v in (item.split("=", 1) for item in args.set)}
        except (ValueError, SyntaxError) as e:
            print(f"--set takes KEY=VALUE with a Python literal value: {e}", file=sys.stderr)
            return 2
        x_vals = params.pop("x_vals", None)
        kwargs = dict(quick=args.quick or None, threads=args.threads, params=params, x_vals=x_vals,
                      providers=args.providers.split(",") if args.providers else None,
                      progress=lambda line: print(line, file=sys.stderr, flush=True))
        if args.runs:
            kwargs.update(warmup=1, min_runs=args.runs, max_runs=args.runs, min_time_s=0.0)
        if args.rounds > 1:
            from .core import run_rounds

            rows = run_rounds(bench, args.rounds, save=False, **kwargs)
            if args.json:
                Path(args.json).write_text("".join(json.dumps(row) + "\n" for row in rows))
        else:
            rows = run(bench, json_path=args.json, **kwargs)
        env = rows[0]["env"] if rows else {}
        print(f"# {machine_line(env)}, torch {env.get('torch')}")
        print(table(rows, bench.baseline))
        if bench.summary and rows:
            print(f"\n{bench.summary(rows)}")
        return 1 if any(r["status"] == "wrong" for r in rows) else 0
    rows = load_rows(args.paths)
    if not rows:
        print(f"no benchmark rows in {' '.join(args.paths)}")
        return 0
    by_bench: dict[str, list[dict]] = {}
    for row in rows:
        by_bench.setdefault(row["benchmark"], []).append(row)
    for name, rs in by_bench.items():
        env = rs[0]["env"]
        print(f"\n## {name}  ({machine_line(env)}, torch {env.get('torch')})")
        print(table(rs, benches[name].baseline if name in benches else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
