"""A CPU-bound process with nothing to share, for :func:`bench.suites.throughput.machine_scaling`
(run by the parent as ``python -m bench.children.spin_child N``; see :mod:`bench._util` for
the line protocol).

Prints ``ready``, waits for ``go`` on stdin, runs ``N`` rounds of plain
interpreter work (small dicts, byte strings, a list: what a worker's Python does,
with no I/O, no lock and no shared memory), then prints ``spun <wall s> <cpu s>``
(``time.perf_counter`` and ``time.process_time`` around the loop) and exits.

Two of these at once on a machine with two independent cores each take as long
as one alone. Where they take longer although each had its core all the time
(CPU time equal to wall time), the cores share the hardware under them (SMT
siblings, a host's oversubscription): the machine does not double what one
process does, whatever the software.
"""

from __future__ import annotations

import sys
import time


def spin(rounds: int) -> int:
    total = 0
    for i in range(rounds):
        d = {b"id": b"%d" % i, b"payload": b"%d" % (i + 1), b"tries": b"0"}
        items = [d[b"payload"], d[b"id"]]
        total += len(items[0]) + len(d[b"tries"])
    return total


def main() -> None:
    rounds = int(sys.argv[1])
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    t, c = time.perf_counter(), time.process_time()
    spin(rounds)
    print(f"spun {time.perf_counter() - t:.6f} {time.process_time() - c:.6f}", flush=True)


if __name__ == "__main__":
    main()
