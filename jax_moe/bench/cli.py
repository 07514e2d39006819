"""Command line: ``python -m jax_moe.bench --suite permute|stack|all --out DIR [--quick] ...``."""

from __future__ import annotations

import argparse
import functools
import os
import pathlib

from jax_moe.bench import models as shapes
from jax_moe.bench import (decode_suite, gemm_suite, parallel_suite, permute_suite, report, stack_suite, timing,
                           train_suite)

DEFAULT_OUT = "notebooks/results"
# The DeepSeek-V3 stack holds 90 GB of weights; JAX's default pool (75 % of the card) is too small.
DEFAULT_MEM_FRACTION = "0.92"


def _names(values: list[str] | None) -> list[str] | None:
    """Accepts both ``--models a b`` and ``--models a,b``."""
    if values is None:
        return None
    return [name for value in values for name in value.split(",") if name]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jax_moe.bench",
        description="Benchmarks jax_moe per layer (suite permute), per decode step (suite stack) and its "
                    "expert GEMMs (suite gemm), a training step (suite train); "
                    "the method is in the docstring of jax_moe.bench.")
    parser.add_argument("--suite", choices=("permute", "stack", "parallel", "gemm", "train", "decode", "all"),
                        default="all")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--quick", action="store_true",
                        help="a small subset (permute: two models, three T; stack and gemm: one model, two T), "
                             "a minute or two on a GPU")
    parser.add_argument("--models", nargs="+", metavar="NAME",
                        help=f"models to run, from {', '.join(shapes.MODELS)} (default: per suite)")
    parser.add_argument("--tokens", nargs="+", metavar="T", help="token counts (default: per suite)")
    parser.add_argument("--layers", nargs=2, type=int, metavar=("L1", "L2"), default=None,
                        help="permute and parallel suites: the two scan lengths of the per-layer "
                             "difference (default %d %d and %d %d)" % (*permute_suite.LAYER_COUNTS,
                                                                       *parallel_suite.LAYER_COUNTS))
    parser.add_argument("--compile-threads", type=int, default=min(8, os.cpu_count() or 1),
                        help="programs compiled concurrently (default min(8, CPUs))")
    parser.add_argument("--no-peer", action="store_true",
                        help="train and decode suites: skip the PyTorch + Hugging Face peer (its own process)")
    parser.add_argument("--scratch-tokens", type=int, default=None, metavar="N",
                        help="decode suite: size each step's scratch for max(T, N) tokens, as a server that "
                             "decodes on the scratch it prefilled with (default: T)")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="start no new shape after this many seconds; what ran is still written")
    args = parser.parse_args(argv)
    args.models = _names(args.models)
    args.tokens = [int(t) for t in _names(args.tokens)] if args.tokens else None
    unknown = [m for m in args.models or () if m not in shapes.MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {list(shapes.MODELS)}")
    if args.scratch_tokens is not None and (args.scratch_tokens < 1 or args.suite != "decode"):
        parser.error(f"--scratch-tokens: expected a positive count with --suite decode, got {args.scratch_tokens} "
                     f"with --suite {args.suite}")
    if args.layers is not None:
        args.layers = tuple(args.layers)
        if not 1 <= args.layers[0] < args.layers[1]:
            parser.error(f"--layers: expected 1 <= L1 < L2, got {args.layers}")
    return args


def _selection(args, default_models, default_tokens, quick_models, quick_tokens):
    models = args.models or (quick_models if args.quick else default_models)
    tokens = args.tokens or (quick_tokens if args.quick else default_tokens)
    return [shapes.MODELS[name] for name in models], tuple(tokens)


def _run_suite(name: str, run, markdown, fields: dict, out_dir: pathlib.Path, clock, env) -> dict:
    """Runs one suite, rewriting its JSON and markdown after every shape and once at the end."""
    start = clock.elapsed()

    def save(rows, notes):
        record = {"suite": name, "meta": env, **fields, "notes": notes, "rows": rows,
                  "elapsed_s": clock.elapsed() - start}
        report.write(out_dir, name, record, markdown(record))
        return record

    rows, notes = run(on_rows=save)
    clock.log(f"suite {name} done in {clock.elapsed() - start:.0f} s")
    return save(rows, notes)


def main(argv=None) -> dict:
    """Runs the chosen suites, writes ``bench_<suite>.json/.md`` and returns the records."""
    args = parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION)  # before JAX starts
    if args.suite in ("train", "decode"):  # the PyTorch peer runs in a child process first: JAX must not hold the card
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    clock = timing.Clock()
    env = report.environment()
    clock.log(f"device {env['device_kind']} ({env['platform']}), jax {env['jax']}, "
              f"native CUDA {env['native_cuda']}, compile threads {args.compile_threads}")
    out_dir = pathlib.Path(args.out)
    records = {}

    if args.suite in ("permute", "all"):
        models, tokens = _selection(args, shapes.PERMUTE_MODELS, shapes.PERMUTE_TOKENS,
                                    shapes.QUICK_PERMUTE_MODELS, shapes.QUICK_PERMUTE_TOKENS)
        layer_counts = args.layers or permute_suite.LAYER_COUNTS
        records["permute"] = _run_suite(
            "permute",
            functools.partial(permute_suite.run, models, tokens, clock, args.compile_threads,
                              layer_counts=layer_counts, time_limit_s=args.time_limit),
            report.permute_markdown,
            {"method": timing.PER_LAYER_METHOD, "layer_counts": list(layer_counts),
             "bytes_formula": permute_suite.BYTES_FORMULA},
            out_dir, clock, env)

    if args.suite in ("stack", "all"):
        models, tokens = _selection(args, shapes.STACK_MODELS, shapes.STACK_TOKENS,
                                    shapes.QUICK_STACK_MODELS, shapes.QUICK_STACK_TOKENS)
        records["stack"] = _run_suite(
            "stack",
            functools.partial(stack_suite.run, models, tokens, clock, args.compile_threads,
                              time_limit_s=args.time_limit),
            report.stack_markdown, {"method": timing.STEP_METHOD}, out_dir, clock, env)

    if args.suite == "parallel":  # not in "all": it is the multi-device suite (issue 6)
        models, tokens = _selection(args, parallel_suite.MODELS, parallel_suite.TOKENS,
                                    parallel_suite.QUICK_MODELS, parallel_suite.QUICK_TOKENS)
        found = parallel_suite.facts()
        layer_counts = args.layers or parallel_suite.LAYER_COUNTS
        records["parallel"] = _run_suite(
            "parallel",
            functools.partial(parallel_suite.run, models, tokens, clock, args.compile_threads,
                              layer_counts=layer_counts, time_limit_s=args.time_limit, found=found),
            parallel_suite.markdown, {"method": timing.PER_LAYER_METHOD, "layer_counts": list(layer_counts),
                                      "facts": found}, out_dir, clock, env)

    if args.suite in ("gemm", "all"):
        models, tokens = _selection(args, gemm_suite.MODELS, gemm_suite.TOKENS,
                                    gemm_suite.QUICK_MODELS, gemm_suite.QUICK_TOKENS)
        records["gemm"] = _run_suite(
            "gemm",
            functools.partial(gemm_suite.run, models, tokens, clock, args.compile_threads,
                              time_limit_s=args.time_limit),
            gemm_suite.markdown, {"method": gemm_suite.METHOD}, out_dir, clock, env)

    # Not in "all": minutes per model, and the PyTorch peer in its own process (issues 13 and 14).
    peer_suites = {"train": train_suite, "decode": decode_suite}
    if args.suite in peer_suites:
        suite = peer_suites[args.suite]
        models, tokens = _selection(args, suite.MODELS, suite.TOKENS, suite.QUICK_MODELS, suite.QUICK_TOKENS)
        records[args.suite] = _run_suite(
            args.suite,
            functools.partial(suite.run, models, tokens, clock, args.compile_threads,
                              time_limit_s=args.time_limit, with_peer=not args.no_peer,
                              **({"scratch_tokens": args.scratch_tokens} if args.suite == "decode" else {})),
            suite.markdown, {"method": suite.METHOD}, out_dir, clock, env)

    print(flush=True)
    if "permute" in records:
        print("permute, µs per layer (ratio = jax_moe / argsort; % of the copy ceiling):")
        print(report.permute_tables(records["permute"]["rows"], report.COMPACT_COLUMNS, with_model=True))
        print("\nfloors, µs per layer:")
        print(report.floors_table(records["permute"]["rows"]))
        print()
    if "stack" in records:
        print("stack, one decode step:")
        print(report.stack_table(records["stack"]["rows"]))
        print()
    if "gemm" in records:
        print("gemm:")
        print(gemm_suite.table(records["gemm"]["rows"]))
        print()
    if "train" in records:
        print("train, fwd+bwd per layer:")
        print(train_suite.table(records["train"]["rows"]))
        print()
    if "decode" in records:
        print("decode, µs per layer:")
        print(decode_suite.table(records["decode"]["rows"]))
        print()
    if "parallel" in records:
        print("parallel, µs per layer:")
        print(parallel_suite.table(records["parallel"]["rows"]))
        print()
    for suite in records:
        print(f"wrote {out_dir / f'bench_{suite}.json'} and {out_dir / f'bench_{suite}.md'}")
    clock.log("done")
    return records
