"""bench.py's subcommands, a module each: kernels (kernels, overlap, host), comm (collective, e2e),
models (hf, peer); common: timing, the results files, the tables."""
