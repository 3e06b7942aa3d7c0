"""Stand-alone measurements, each run as ``python -m bench.tools.<name>``; not part of
``python -m bench``."""
