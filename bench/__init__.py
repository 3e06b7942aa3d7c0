"""trio-mesh benchmarks: ``python -m bench`` runs them all (see ``docs/performance.md``)."""
