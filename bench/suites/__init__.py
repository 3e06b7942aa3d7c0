"""The suites that ``python -m bench`` runs, one module each."""
