from jax_moe.bench.cli import main

main()
