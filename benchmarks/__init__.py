"""Benchmark harness for jaxflash: `python -m benchmarks.bench --help`."""
