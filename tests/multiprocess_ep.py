"""One process of a multi-process expert-parallel run on CPU (tests/test_parallel.py starts them).

    python tests/multiprocess_ep.py PROCESS_ID NUM_PROCESSES PORT OUT.npz

Each process joins ``jax.distributed`` through a coordinator on localhost (CPU collectives over
gloo), owns one CPU device of the global mesh, runs ``moe_stack_ep`` forward and ``jax.grad`` of
a loss through it on global arrays built from the same seeds, and gathers the results; process 0
writes them to OUT.npz for the parent to compare with one process. This is how the EP stack runs
across GPU hosts too: one process per host (or per GPU), the same program on every process.
"""

from __future__ import annotations

import os
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
PROCESS_ID, NUM_PROCESSES, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(coordinator_address=f"localhost:{PORT}", num_processes=NUM_PROCESSES,
                           process_id=PROCESS_ID)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax_moe.parallel as ep  # noqa: E402
from multiprocess_case import AXIS, case  # noqa: E402


def main() -> None:
    config, params, x, placement = case(NUM_PROCESSES)
    assert jax.process_count() == NUM_PROCESSES and len(jax.devices()) == NUM_PROCESSES
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    sharded = ep.shard_params(params, mesh, AXIS, placement=placement)  # the same host arrays everywhere
    x_global = jax.device_put(x, NamedSharding(mesh, P(AXIS)))

    def loss(p, h, s):
        y, s, dropped = ep.moe_stack_ep(p, h, s, mesh=mesh, axis_name=AXIS)
        return jnp.sum(jnp.sin(y)), (y, s, dropped)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), donate_argnums=2)
    scratch = ep.init_scratch_ep(config, mesh, AXIS, placement=placement)
    (_, (y, scratch, dropped)), (d_params, d_x) = step(sharded, x_global, scratch)
    results = multihost_utils.process_allgather({"y": y, "dropped": dropped, "d_x": d_x, **{
        f"d_{name}": leaf for name, leaf in d_params.items()}}, tiled=True)
    if PROCESS_ID == 0:
        slots = np.asarray(ep.placement_array(placement, config.num_experts))
        out = {name: np.asarray(value) for name, value in results.items()}
        for name in ("d_gate_up", "d_down"):
            out[name] = out[name][:, slots]  # slot order -> global expert order
        np.savez(OUT, **out)
    print(f"process {PROCESS_ID}: ok", flush=True)


if __name__ == "__main__":
    main()
