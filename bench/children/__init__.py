"""Child processes of the benchmarks (run as ``python -m bench.children.<name>``) and
the Node drivers of the peers."""
