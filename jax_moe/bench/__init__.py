"""Benchmarks of jax_moe on the device: ``python -m jax_moe.bench --suite NAME``.

Each suite is a module ``<name>_suite`` (its docstring says what it measures) with its models, token
counts, ``run`` and ``table``: permute, stack, gemm (the expert block against the JAX peers of
``jax_peers``), decode, train, parallel; ``all`` runs permute, stack and gemm. ``common`` holds what
they share, ``models`` the shapes. Results go to a scratch folder unless ``--out`` names one; a file
git tracks is replaced only with ``--overwrite``. No time includes host dispatch (``common``'s METHOD
texts say how), and every output of a timed op is consumed, so XLA can neither fold nor drop the work
(``tests/test_bench.py`` checks the programs).
"""

from jax_moe.bench.cli import main

__all__ = ["main"]
