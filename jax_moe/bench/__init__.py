"""Benchmarks of jax_moe on the device: ``python -m jax_moe.bench --suite NAME``.

NAME is permute, stack, gemm, parallel, train, or all (every suite but parallel and train).

Suite ``permute`` (issue 3): per layer, inside a jitted ``lax.scan`` of L layers, jax_moe permute,
unpermute and the pair (scratch donated, and the pair not donated); the pure-JAX baselines
(argsort permute + argsort unpermute, and the MaxText ``jnp.repeat`` permute); the per-layer
floors (the same scan with a trivial body, and with two no-op custom calls on a donated buffer);
and a device-to-device copy of the same bytes as the bandwidth ceiling. Rolled (``unroll=1``)
and fully unrolled scans. Output: µs per layer, GB/s, % of the copy ceiling, ratio to argsort.

Suite ``stack`` (issue 4): one jitted decode step of the whole scanned MoE stack (``moe_stack``,
scratch donated or not, vs ``baseline_moe_stack``), rolled and unrolled.

Suite ``gemm`` (issue 8): the expert GEMMs on ``grouped_matmul`` against ``ragged_dot``, Pallas
``ragged_dot_mgpu`` and a dense ``jnp.dot``, and the whole layer against the pure-JAX layer
(``gemm_suite``, which also says how each op is timed; every output of a timed op is consumed,
``timing.consume_all``, or XLA would drop the work of the outputs nobody reads).

Suite ``train`` (issue 13; not in ``all``): one jitted training step (value_and_grad, all gradients
as outputs) of ``moe_stack`` against the pure-JAX stack and the PyTorch + Hugging Face peer, run
in its own process before JAX takes the card (``train_suite``).

Suite ``parallel`` (issues 6, 7; not in ``all``): the expert-parallel stack per layer on every
device JAX sees, its share of time in all-to-all, and the single-device stack of the same problem
(``parallel_suite``).

How a per-layer time is measured (host dispatch excluded). A jitted call costs tens of µs of host
dispatch, more than a decode layer, so one call per layer cannot be timed. Instead each case is
compiled for two scan lengths L1 < L2 (``--layers``: 4 and 12 for permute, 1 and 2 for parallel),
each call is timed from dispatch to ``block_until_ready``, and t(L) = fixed + L * per_layer, where
fixed holds the host dispatch, argument handling and anything a program does once (e.g. copying a
non-donated scratch). So per_layer = (median t(L2) - median t(L1)) / (L2 - L1). The routing (random
ids, softmax weights) is a per-layer input (scan ``xs``), never a constant; x is in the carry and
each layer's output is the next layer's input, so nothing is dead code or folded away
(``permute_suite`` says how; ``tests/test_bench.py`` checks the compiled programs).

Time budget (one H200, compile-bound): ``--suite permute`` about 3 min (800 small programs);
``--suite stack`` 3 min for Qwen3-30B alone (measured; the unrolled baseline at T=1024 compiles for
2 min), more with DeepSeek-V3; ``--suite gemm`` over 8 min for the four models (measured: Qwen3-30B
and DeepSeek-V3 take 6 min without DeepSeek-V3's T=4096 layer, whose ragged_dot baseline takes
seconds per call); ``--suite parallel`` under a minute for DeepSeek-V3 on one or two H200s;
``--quick`` about 2-3 min. All programs of one shape are lowered first, then compiled concurrently
in threads (XLA compiles without the GIL), then timed one by one; unrolled scans run only at decode
sizes (T <= 16); floors once per model; repeats adapt to about 0.15 s per case. JSON and markdown
are rewritten after every shape, so a run cut short (``--time-limit``, or a kill) keeps its
results.
"""

from jax_moe.bench.cli import main

__all__ = ["main"]
