"""Command line: ``python -m jax_moe.bench --suite NAME [--quick] [--models ...] [--tokens ...] [--out DIR]``."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import tempfile

from jax_moe.bench import (common, decode_suite, gemm_suite, models, parallel_suite, permute_suite, stack_suite,
                           train_suite)

SUITES = {"permute": permute_suite, "stack": stack_suite, "gemm": gemm_suite, "decode": decode_suite,
          "train": train_suite, "parallel": parallel_suite}
ALL = ("permute", "stack", "gemm")  # the others take minutes a model, a peer process, or every device


def default_out() -> pathlib.Path:
    """A scratch folder: a run never lands on committed results unless asked to (``--out``)."""
    return pathlib.Path(tempfile.gettempdir()) / "jax_moe_bench"


def _names(values: list[str] | None) -> list[str] | None:
    return None if values is None else [name for value in values for name in value.split(",") if name]  # a b or a,b


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jax_moe.bench", description=(
        "Benchmarks of jax_moe on the device; the method is in the docstring of jax_moe.bench."))
    parser.add_argument("--suite", choices=(*SUITES, "all"), default="all", help=f"all: {', '.join(ALL)}")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help=f"folder for bench_<suite>.json and .md (default: {default_out()})")
    parser.add_argument("--overwrite", action="store_true", help="replace result files that git tracks")
    parser.add_argument("--quick", action="store_true", help="a small subset: a minute or two on a GPU")
    parser.add_argument("--models", nargs="+", metavar="NAME", help=f"from {', '.join(models.MODELS)}")
    parser.add_argument("--tokens", nargs="+", metavar="T", help="token counts (default: per suite)")
    parser.add_argument("--layers", nargs=2, type=int, metavar=("L1", "L2"),
                        help="permute and parallel: the two scan lengths of the per-layer difference")
    parser.add_argument("--compile-threads", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--no-peer", action="store_true", help="train and decode: skip the PyTorch peer")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="start no new shape after this many seconds; what ran is still written")
    args = parser.parse_args(argv)
    args.models = _names(args.models)
    args.tokens = [int(t) for t in _names(args.tokens)] if args.tokens else None
    if [m for m in args.models or () if m not in models.MODELS]:
        parser.error(f"--models: expected names from {list(models.MODELS)}, got {args.models}")
    if args.layers is not None and not 1 <= args.layers[0] < args.layers[1]:
        parser.error(f"--layers: expected 1 <= L1 < L2, got {args.layers}")
    args.suites = ALL if args.suite == "all" else (args.suite,)
    args.out = args.out or default_out()
    tracked = tracked_files(args.out, [f"bench_{name}.{ext}" for name in args.suites for ext in ("json", "md")])
    if tracked and not args.overwrite:
        parser.error(f"--out {args.out}: would overwrite {', '.join(tracked)}, which git tracks; pass --overwrite "
                     "to replace them, or choose another --out")
    return args


def tracked_files(folder: pathlib.Path, names: list[str]) -> list[str]:
    """Which of ``names`` in ``folder`` git tracks (none where git is missing or the folder is in no repository)."""
    try:
        done = subprocess.run(["git", "-C", str(folder), "ls-files", "--", *names], capture_output=True, text=True)
    except OSError:
        return []
    return done.stdout.split() if done.returncode == 0 else []


def selection(args, suite) -> tuple[list, tuple[int, ...]]:
    names = args.models or (suite.QUICK_MODELS if args.quick else suite.MODELS)
    return [models.MODELS[name] for name in names], tuple(args.tokens or (suite.QUICK_TOKENS if args.quick
                                                                            else suite.TOKENS))


def main(argv=None) -> dict:
    """Runs the chosen suites, rewriting ``bench_<suite>.json`` and ``.md`` after every shape."""
    args = parse_args(argv)
    # Before JAX takes the card: its default pool (75 % of it) cannot hold DeepSeek-V3's stack.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    if {"train", "decode"} & set(args.suites):  # their PyTorch peer runs first, in a process of its own
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    clock, env, records = common.Clock(), common.environment(), {}
    clock.log(f"device {env['device_kind']} ({env['platform']}), jax {env['jax']}, native CUDA "
              f"{env['native_cuda']}, bench module {env['native_bench']}, compile threads {args.compile_threads}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.suites:
        suite, start = SUITES[name], clock.elapsed()
        options = ({"layer_counts": tuple(args.layers or suite.LAYER_COUNTS)} if name in ("permute", "parallel")
                   else {"with_peer": not args.no_peer} if name in ("train", "decode") else {})

        def save(rows, notes, name=name, suite=suite, start=start, options=options):
            record = {"suite": name, "meta": env, "about": " ".join(suite.__doc__.split()), "method": suite.METHOD,
                      "options": options, "notes": notes, "rows": rows, "elapsed_s": clock.elapsed() - start}
            (args.out / f"bench_{name}.json").write_text(json.dumps(record, indent=1, default=float) + "\n")
            (args.out / f"bench_{name}.md").write_text(common.document(suite.TITLE, record, suite.table(rows)) + "\n")
            records[name] = record

        rows, notes = suite.run(*selection(args, suite), clock, args.compile_threads, on_rows=save,
                                time_limit_s=args.time_limit, **options)
        save(rows, notes)
        clock.log(f"suite {name} done in {clock.elapsed() - start:.0f} s")
        print(f"\n{name}:\n{suite.table(rows)}\n", flush=True)
    print(f"results: {', '.join(f'bench_{name}.json and .md' for name in records)} in {args.out.resolve()}")
    return records
