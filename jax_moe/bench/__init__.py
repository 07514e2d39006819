"""Benchmarks of jax_moe on the device: ``python -m jax_moe.bench --suite NAME``.

Each suite is a module ``<name>_suite`` (its docstring says what it measures) with its models and
token counts, ``run`` and ``table``: ``permute`` (permute and unpermute per layer), ``stack`` (a decode
step against the pure-JAX stack), ``gemm`` (the grouped GEMM against ragged_dot, Pallas and a dense
dot), ``decode`` (the stack per layer against its roofline and the PyTorch peer), ``train`` (a training
step against the pure-JAX stack and the PyTorch peer), ``parallel`` (the expert-parallel stack);
``all`` runs permute, stack and gemm. What they share (timing, ceilings, params, child processes,
records and tables) is ``common``; the model shapes are ``models``. Results go to a scratch folder
unless ``--out`` names one; a file git tracks is replaced only with ``--overwrite``.

Host dispatch (tens of µs a jitted call, more than a decode layer) is kept out of every time: a
per-layer time is the difference of two programs scanning L1 < L2 layers, a per-call time that of two
in-graph loops of N1 < N2 calls, a step time the mean of back-to-back steps. Per-layer inputs are scan
inputs, never constants, each layer's output feeds the next, and every output of a timed op is
consumed, so XLA can neither fold nor drop the work (``tests/test_bench.py`` checks the programs).
"""

from jax_moe.bench.cli import main

__all__ = ["main"]
