"""The protocol's conformance suite: script vectors and scenarios (data under
``protocol/conformance/``), the harness that runs them against a peer, and the
Python peer of the suite's line protocol (``python -m mesh.conformance.peer``).

Not part of the library's public API: the core (``mesh``) never imports it.
``mesh conformance`` (:mod:`mesh.cli._conformance`) is its command.
"""
