"""The harness: what tests, tools, bench and the demo build a mesh under test
with. Private, and not API: it changes with its users.

- :mod:`~mesh._harness.peer`: start a peer (a worker, or any mesh program) as an
  OS process, the one way every user does.
- :mod:`~mesh._harness.topology`: throwaway redis-servers (standalone, Sentinel,
  Cluster) on free loopback ports.
- :mod:`~mesh._harness.driver`: the worker process of the fault tests and the
  soak; :mod:`~mesh._harness.sink` is where it reports what its handlers do,
  fenced by token, and :mod:`~mesh._harness.harness` drives a scenario of them.
- :mod:`~mesh._harness.proxy`: a TCP proxy that stalls, cuts and drops replies.
- :mod:`~mesh._harness.checks`: snapshots of a mesh's keys and the "one place"
  checks on them.

The core library never imports it (``mesh demo`` and ``mesh conformance``
start their peers with :mod:`~mesh._harness.peer`), and nothing here imports
``tests``.
"""
