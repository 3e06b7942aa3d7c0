"""Prometheus metrics for trio-mesh (the ``metrics`` extra:
``pip install 'trio-mesh[metrics]'``).

* :class:`WorkerCollector`: one worker's counters, read from
  :meth:`mesh.Worker.statistics` at each scrape (``mesh_worker_*``).
* :class:`MeshCollector`: the mesh-wide view read from Redis at each scrape,
  so queue depth is visible with no worker running (``mesh_*``).
* :func:`serve_metrics`: serve a registry over HTTP (prometheus-client's own
  server, in a thread), binding 127.0.0.1 unless told otherwise.

``mesh worker --metrics-port PORT`` and ``mesh exporter --port PORT`` use
these. docs/operating.md lists every metric, what it means, and example
alerts.
"""

from __future__ import annotations

try:
    import prometheus_client  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "mesh.metrics needs prometheus-client: pip install 'trio-mesh[metrics]'"
    ) from exc

from ._collect import MeshCollector as MeshCollector
from ._collect import WorkerCollector as WorkerCollector
from ._http import serve_metrics as serve_metrics

__all__ = ["MeshCollector", "WorkerCollector", "serve_metrics"]
