"""Benchmarks of jax_moe on the device: ``python -m jax_moe.bench --suite NAME``.

Suites (each a module ``<name>_suite`` with its models, token counts, ``run`` and ``table``):
- ``permute``: permute and unpermute per layer against the pure-JAX baselines, a floor and the copy ceiling;
- ``stack``: one decode step of the scanned stack against the pure-JAX stack, rolled and unrolled;
- ``gemm``: the expert GEMM against ragged_dot, Pallas and a dense dot; the layer against the pure-JAX layer;
- ``decode``: the stack per layer at decode and prefill sizes against its roofline, its kernel choices
  switched off one at a time, FP8 experts, and the PyTorch + Hugging Face peer;
- ``train``: one training step of the stack against the pure-JAX stack and the PyTorch peer;
- ``parallel``: the expert-parallel stack on every device, its collectives' share.
``all`` runs permute, stack and gemm. Results go to a scratch folder unless ``--out`` says where; a
file git tracks is replaced only with ``--overwrite``. What the suites share (timing, ceilings,
params, peer processes, records) is ``common``; the model shapes are ``models``.

How a time excludes host dispatch (a jitted call costs tens of µs of it, more than a decode layer):
a per-layer time is the difference of two programs scanning L1 < L2 layers, t(L) = fixed + L * per
layer (permute, parallel); a per-call time the difference of two in-graph loops of N1 < N2 calls
(gemm); a step's time is the mean of back-to-back steps, whose dispatch overlaps the device's work
(stack, decode, train). Inputs that vary per layer (routing) are scan inputs, never constants, each
layer's output feeds the next, and every output of a timed op is consumed (``common.consume_all``),
so XLA can neither fold nor drop the work; ``tests/test_bench.py`` checks the compiled programs.
Every row is written as it is measured, so a run cut short (``--time-limit``, a kill) keeps its results.
"""

from jax_moe.bench.cli import main

__all__ = ["main"]
