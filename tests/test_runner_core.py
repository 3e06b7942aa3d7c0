"""The runner's decisions (mesh._runner_core), driven with no Redis and no
clock but the ``now`` each call is given: what to do next and how many, the
outcomes in hand, claims, pulls, re-checks, stop pacing and backoff."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from mesh._queue_config import QueueConfig
from mesh._replies import ClaimReply, QueueBeat, RebalanceReply
from mesh._runner_core import (
    BACKOFF_MAX,
    BACKOFF_MIN,
    CLAIM_MAX,
    DEPTH_MAX,
    HERD,
    HOLD_MAX,
    LONG_MIN,
    LONG_RTTS,
    STOP_CHUNK,
    STOP_PACE,
    STOP_RETRY,
    Action,
    Outcomes,
    RunnerCore,
    failure_line,
)
from mesh._stats import QueueCounters
from mesh._types import Process

Q = "jobs"


async def _noop(p: Process) -> None:
    pass


# Imports mesh._runner_core alone: the package's __init__ (which imports the
# whole library) is replaced by an empty package over the same directory, so
# what is loaded is what the core itself imports, directly or not.
_IMPORT_CORE = """
import json, sys, types
pkg = types.ModuleType("mesh")
pkg.__path__ = [sys.argv[1]]
sys.modules["mesh"] = pkg
import mesh._runner_core
print(json.dumps(sorted(sys.modules)))
"""


def test_core_imports_nothing_that_does_io() -> None:
    """The I/O-free core loads no connection, transport, wire or pub/sub
    module, no hiredis or redis-py, and nothing of the binding or the script
    loader and runner: the reply types it uses come from mesh._replies."""
    here = Path(__file__).resolve().parent.parent / "mesh"
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_CORE, str(here)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    loaded = set(json.loads(out))
    assert "mesh._runner_core" in loaded
    io = {
        "mesh._asyncio_stream",
        "mesh._binding",
        "mesh._connection",
        "mesh._eval",
        "mesh._pool",
        "mesh._pubsub",
        "mesh._scripts",
        "mesh._topology",
        "mesh._transport",
        "mesh._wire",
    }
    assert sorted(loaded & io) == []
    assert [m for m in loaded if m.split(".")[0] in ("hiredis", "redis")] == []


def make_core(balance_wait: float = 1.0, **options: object) -> RunnerCore:
    settings: dict[str, object] = {"concurrency": 10, "max_attempts": 3}
    settings.update(options)
    config = QueueConfig(
        Q,
        _noop,
        backoff=0.5,
        backoff_max=5.0,
        **settings,  # type: ignore[arg-type]
    )
    return RunnerCore(config, QueueCounters(), balance_wait=balance_wait, ttl=3.0)


def proc(pid: str, persistent: bool = False, attempts: int = 0, task: bytes = b"x") -> Process:
    return Process(pid, Q, task, int(pid), "w1", persistent, attempts)


def beat(**fields: object) -> QueueBeat:
    values: dict[str, object] = {
        "now_ms": 1_000,
        "state": -1,
        "held": 0,
        "idle": True,
        "idle_servers": 1,
    }
    values.update(fields)
    return QueueBeat(**values)  # type: ignore[arg-type]


# --- what to do next, while serving ----------------------------------------


def test_serving_does_the_reports_before_the_claim_in_a_fixed_order() -> None:
    core = make_core()
    core.resync_needed = True
    core.out.fail(proc("1"), "ValueError: no")
    core.out.returned.append("2")
    core.out.done.append("3")
    assert core.next_action(0.0, 5, 0) == (Action.RESYNC, 0)
    core.resynced()
    assert core.next_action(0.0, 5, 0) == (Action.FAILED, 0)
    core.out.take_failed()
    assert core.next_action(0.0, 5, 0) == (Action.RETURNED, 0)
    core.out.take_returned()
    # the finish report goes out with the claim, not before it
    assert core.next_action(0.0, 5, 0) == (Action.CLAIM, 5)


def test_a_claim_takes_the_free_slots_up_to_claim_max() -> None:
    core = make_core(concurrency=1000)
    assert core.next_action(0.0, 1000, 0) == (Action.CLAIM, CLAIM_MAX)
    assert core.next_action(0.0, 7, 0) == (Action.CLAIM, 7)


def test_no_claim_without_a_free_slot_or_a_reason() -> None:
    core = make_core()
    assert core.next_action(0.0, 0, 10) == (Action.WAIT, 0)  # full
    core.claim_begin(0.0)  # clears maybe_work
    assert core.next_action(0.0, 5, 5) == (Action.WAIT, 0)
    core.out.done.append("1")
    assert core.next_action(0.0, 5, 5) == (Action.FINISH, 0)  # reported alone


def test_a_due_time_passing_makes_the_runner_claim() -> None:
    core = make_core()
    core.claim_begin(0.0)
    core.wake_in(10.0, 2.5)
    assert core.next_due == 12.5
    core.wake_in(10.0, 5.0)  # a later one keeps the earlier
    assert core.next_due == 12.5
    assert core.next_action(12.4, 3, 0) == (Action.WAIT, 0)
    assert core.next_action(12.5, 3, 0) == (Action.CLAIM, 3)
    assert core.next_due == math.inf


def test_a_pull_is_bounded_by_the_free_slots_and_asked_once() -> None:
    core = make_core()
    core.claim_begin(0.0)
    core.pull = 8
    assert core.next_action(0.0, 3, 7) == (Action.PULL, 3)
    assert core.pull == 0
    assert core.next_action(0.0, 3, 7) == (Action.WAIT, 0)
    core.pull = 4
    core.out.done.append("9")
    # no free slot: nothing is asked for, and the pull is dropped
    assert core.next_action(0.0, 0, 10) == (Action.FINISH, 0)
    assert core.pull == 0


# --- what to do next, while stopping ----------------------------------------


def test_stopping_reports_then_waits_for_handlers_then_exits() -> None:
    core = make_core()
    core.resync_needed = True  # no re-check and no claim while stopping
    core.begin_stop(["1", "2"])
    assert core.stopping
    core.out.fail(proc("1"), "E")
    core.out.returned.append("2")
    core.out.done.append("3")
    assert core.next_action(0.0, 10, 1) == (Action.FAILED, 0)
    core.out.take_failed()
    assert core.next_action(0.0, 10, 1) == (Action.RETURNED, 0)
    core.out.take_returned()
    assert core.next_action(0.0, 10, 1) == (Action.FINISH, 0)
    core.out.take_done()
    assert core.next_action(0.0, 10, 1) == (Action.WAIT, 0)  # a handler runs
    assert core.next_action(0.0, 10, 0) == (Action.EXIT, 0)


# --- backoff after errors ----------------------------------------------------


def test_the_error_backoff_doubles_to_its_cap_and_a_claim_resets_it() -> None:
    core = make_core()
    waits = [core.failed_turn(connection=False) for _ in range(8)]
    assert waits[:3] == [BACKOFF_MIN, 2 * BACKOFF_MIN, 4 * BACKOFF_MIN]
    assert waits[-1] == BACKOFF_MAX
    assert not core.resync_needed  # a command error: Redis answered
    core.claim_done()
    assert core.failed_turn(connection=True) == BACKOFF_MIN
    assert core.resync_needed  # replies may have been lost: re-check


def test_an_error_while_stopping_waits_a_fixed_time() -> None:
    core = make_core()
    core.begin_stop([])
    assert core.failed_turn(connection=True) == STOP_RETRY
    assert core.failed_turn(connection=True) == STOP_RETRY
    assert core.backoff == BACKOFF_MIN


# --- claims -----------------------------------------------------------------


def test_a_full_claim_claims_again_and_a_partial_one_waits_to_be_woken() -> None:
    core = make_core()
    held_back, patience = core.claim_begin(1.0)
    assert (held_back, patience) == (None, 0)
    assert not core.maybe_work
    core.claimed(ClaimReply(0, 0, (proc("1"), proc("2"))), 2, 1.0, held_back)
    assert core.maybe_work  # took all it asked for: more may wait
    core.claim_begin(1.0)
    core.claimed(ClaimReply(0, 0, (proc("3"),)), 2, 1.0, None)
    assert not core.maybe_work  # in the idle set now: woken when work comes
    core.claim_begin(1.0)
    core.claimed(ClaimReply(0, 4, (proc("4"),)), 2, 1.0, None)
    assert core.maybe_work  # tasks remain (a rate limit, say)


def test_a_nudge_during_a_claim_is_not_undone_by_its_reply() -> None:
    core = make_core()
    core.claim_begin(0.0)
    core.maybe_work = True  # nudged while the claim was in flight
    core.claimed(ClaimReply(0, 0, ()), 5, 0.0, None)
    assert core.maybe_work


def test_held_back_by_the_fair_share_claims_again_with_patience() -> None:
    core = make_core(balance_wait=2.0)
    core.claim_begin(10.0)
    core.claimed(ClaimReply(0, 0, (), held_back=True), 5, 10.0, None)
    assert core.held_back_since == 10.0
    assert core.next_due == 12.0  # one balance wait later
    assert not core.check_idle(False, 5)  # held back: not lost from the idle set
    held_back, patience = core.claim_begin(11.0)
    assert (held_back, patience) == (10.0, 0)  # not waited long enough
    core.claimed(ClaimReply(0, 0, (), held_back=True), 5, 11.0, held_back)
    assert core.held_back_since == 10.0  # since the first time
    held_back, patience = core.claim_begin(12.0)
    assert (held_back, patience) == (10.0, 1800)  # 0.9 of the balance wait
    core.claimed(ClaimReply(0, 0, (proc("1"),)), 5, 12.0, held_back)
    assert core.held_back_since is None


def test_a_claim_reply_names_when_a_delayed_task_comes_due() -> None:
    core = make_core()
    core.claim_begin(5.0)
    core.claimed(ClaimReply(0, 0, (), next_due_ms=1500), 5, 5.0, None)
    assert core.next_due == 6.5


def test_a_lost_claim_is_tried_again() -> None:
    core = make_core()
    core.claim_begin(0.0)
    core.claim_lost()
    assert core.next_action(0.0, 1, 0) == (Action.CLAIM, 1)


def test_which_claimed_processes_start() -> None:
    core = make_core()
    early = {"2": 0.5}
    start = core.to_start([proc("1"), proc("2"), proc("3")], early)
    assert [p.id for p in start] == ["1", "3"]
    assert early == {}  # taken
    assert (core.counters.started, core.counters.cancelled) == (2, 1)
    core.begin_stop([])
    assert core.to_start([proc("4")], {}) == []
    assert core.out.returned == ["4"]  # handed back unstarted
    assert core.counters.started == 2


# --- signals from the heartbeat ----------------------------------------------


def test_about_herd_idle_servers_act_on_a_due_time_drawn_once() -> None:
    core = make_core()
    assert core.retry_due(1_000, 300, draw=lambda: 0.5) is False  # 150 >= HERD
    assert core.retry_due(1_000, 300, draw=lambda: 0.0) is False  # not drawn again
    assert core.retry_due(2_000, 300, draw=lambda: 0.001) is True  # 0.3 < HERD
    assert core.retry_due(3_000, HERD, draw=lambda: 0.99) is True  # few servers: all act


def test_a_pull_is_planned_below_the_fair_share_and_not_repeated_in_vain() -> None:
    core = make_core()
    b = beat(weight=0, persistent=100, servers=20)  # share 5, holds 0
    assert core.plan_pull(b, has_handler=True)
    assert core.pull == 5
    assert not core.plan_pull(beat(weight=0, persistent=100, servers=20, state=0), True)  # ready
    assert core.pull == 0
    core.pulled(RebalanceReply(marked=0, persistent=100, servers=20, held=0))
    assert core.fruitless == (0, 100, 20)
    assert not core.plan_pull(b, True)  # nothing changed since it found nothing
    assert core.plan_pull(beat(weight=0, persistent=120, servers=20), True)
    core.pulled(RebalanceReply(marked=3, persistent=120, servers=20, held=0))
    assert core.fruitless is None and core.counters.pulled == 3
    assert not core.plan_pull(b, has_handler=False)
    assert not make_core(rebalance=False).plan_pull(b, True)
    core.begin_stop([])
    assert not core.plan_pull(b, True)


def test_a_runner_missing_from_the_idle_set_with_a_free_slot_claims() -> None:
    core = make_core()
    core.claim_begin(0.0)
    assert core.check_idle(in_idle_set=False, free=1)
    assert not core.check_idle(in_idle_set=True, free=1)
    assert not core.check_idle(in_idle_set=False, free=0)
    core.maybe_work = True  # about to claim anyway
    assert not core.check_idle(in_idle_set=False, free=1)


def test_a_held_count_that_disagrees_asks_for_a_re_check() -> None:
    core = make_core()
    core.out.done.append("a")
    assert not core.check_held(3, running=2)  # 2 running + 1 reported next
    assert not core.resync_needed
    assert core.check_held(2, running=2)  # fewer: some were lost
    core.resynced()
    assert core.check_held(4, running=2)  # more, and nothing in flight
    core.resynced()
    core.unsure = 1  # a report or claim in flight may account for one
    assert not core.check_held(4, running=2)
    assert core.check_held(5, running=2)


def test_a_re_check_hands_back_what_is_not_run_and_cancels_what_is_not_held() -> None:
    core = make_core()
    core.resync_needed = True
    core.out.done.append("d")
    core.out.returned.append("r")
    lost, ghosts = core.resync({"9", "1", "d", "r", "7"}, ["1", "2"])
    assert lost == ["7", "9"]  # not run here, not in hand
    assert ghosts == ["2"]
    core.claim_begin(0.0)
    core.resynced()
    assert not core.resync_needed and core.maybe_work


# --- reports ---------------------------------------------------------------


def test_reports_take_their_lists_and_put_them_back_on_an_error() -> None:
    out = Outcomes(result_ttl=0)
    out.finished(proc("1"), b"ignored")
    taken = out.take_done()
    out.finished(proc("2"), None)  # ended while the report was in flight
    out.restore_done(taken)
    assert out.done == ["1", "2"] and out.results == {}
    out.fail(proc("3"), "E: three", "three")
    out.fail(proc("4"), "E: four")
    failed, errors = out.take_failed()
    assert (failed, errors) == (["3", "4"], ["E: three", "E: four"])
    out.restore_failed(failed)
    out.returned.append("5")
    assert out.take_returned() == ["5"]
    out.restore_returned(["5"])
    assert out.count() == 5 and out.in_hand()
    assert out.ids() == {"1", "2", "3", "4", "5"}


def test_results_are_kept_only_when_every_reported_one_has_one() -> None:
    out = Outcomes(result_ttl=2.5)
    out.finished(proc("1"), "one")
    out.finished(proc("2"), bytearray(b"two"))
    done = out.take_done()
    keep = out.keep(done)
    assert keep is not None and keep.ttl_ms == 2500
    assert dict(keep.values) == {"1": (b"x", b"one"), "2": (b"x", b"two")}
    out.finished(proc("3"), None)
    assert out.keep(["3", "4"]) is None  # 4 has no result here
    assert set(out.results) == {"3"}  # those reported already are forgotten
    assert Outcomes(result_ttl=0).keep(["1"]) is None


def test_reported_failures_are_counted_logged_and_retried() -> None:
    core = make_core()
    core.claim_begin(0.0)
    for pid in "1234":
        core.out.fail(proc(pid, attempts=1), "E", "why " + pid)
    failed, _ = core.out.take_failed()
    lines = core.failures_reported(100.0, failed, [(0, 0), (1, 0), (2, 2500), (3, 0)])
    assert core.counters.failed == 3  # result 0: no longer ours, not counted
    assert lines == [
        "queue jobs: task 'x' failed (attempt 2 of 3): why 1; it was no longer this "
        "worker's (recycled or cancelled meanwhile)",
        "queue jobs: task 'x' failed (attempt 2 of 3): why 2; retrying now",
        "queue jobs: task 'x' failed (attempt 2 of 3): why 3; retrying in 2.5 s",
        "queue jobs: task 'x' failed (attempt 2 of 3): why 4; dead-lettered",
    ]
    assert core.next_due == 102.5 and not core.maybe_work
    assert core.out.fail_info == {} and core.out.why == {}
    core.out.fail(proc("5"), "E")
    core.failures_reported(100.0, ["5"], [(2, 0)])
    assert core.maybe_work  # queued again now: claim it


def test_a_failure_line_names_a_persistent_task_without_a_limit() -> None:
    line = failure_line(proc("1", persistent=True), "boom", 3, 2, 0)
    assert line == "queue jobs: persistent task 'x' failed (attempt 1): boom; retrying now"
    assert "attempt 1;" not in failure_line(proc("1"), "boom", 0, 1, 0)
    assert "(attempt 1)" in failure_line(proc("1"), "boom", 0, 1, 0)


# --- stop pacing -------------------------------------------------------------


def test_a_stop_cancels_in_claim_order_a_chunk_at_a_time_paced_by_time() -> None:
    core = make_core()
    pids = [str(i) for i in range(2 * STOP_CHUNK + 5)]
    core.begin_stop(pids)
    assert not core.stop_due(0.0)  # nothing cancelled yet: the loop starts it
    gone = {"3", "150"}  # ended (or cancelled in the mesh) meanwhile
    first = core.stop_group(1.0, lambda pid: pid not in gone)
    assert len(first) == STOP_CHUNK
    assert first[:4] == ["0", "1", "2", "4"] and "3" not in first
    assert core.cancel_at == 1.0 + STOP_PACE
    assert not core.stop_due(1.0 + STOP_PACE / 2)
    assert core.stop_due(1.0 + STOP_PACE)
    second = core.stop_group(1.0 + STOP_PACE, lambda pid: pid not in gone)
    assert (first[-1], second[0], second[-1]) == ("100", "101", "201")
    assert "150" not in second and len(second) == STOP_CHUNK
    rest = core.stop_group(2.0, lambda pid: True, n=len(core.stop_order))
    assert rest == pids[-3:]
    assert not core.stop_order and not core.stop_due(10.0)


@pytest.mark.parametrize("n", [0, 1])
def test_an_empty_stop_has_nothing_due(n: int) -> None:
    core = make_core()
    core.begin_stop([str(i) for i in range(n)])
    core.stop_group(0.0, lambda pid: True)
    assert not core.stop_due(1.0)


# --- adaptive pipelining (prefetch=None, the default) -------------------------


def full(n: int = 10, remaining: int = 5) -> ClaimReply:
    return ClaimReply(0, remaining, tuple(proc(str(i + 1)) for i in range(n)))


def ran(core: RunnerCore, handler_s: float, rtt_s: float, handlers: int = 10) -> None:
    """A claim round trip of ``rtt_s`` and ``handlers`` runs of ``handler_s``."""
    core.counters.claim.observe(rtt_s)
    for _ in range(handlers):
        core.counters.handler.observe(handler_s)


def test_pipelining_starts_once_handlers_ran_short_with_a_backlog() -> None:
    core = make_core()
    core.counters.claim.observe(0.001)
    core.claimed(full(), 10, 0.0, None)
    assert core.depth == 0  # no handler ran yet: nothing known of them
    ran(core, 0.0001, 0.001)
    core.claimed(full(), 10, 0.1, None)
    # the slots run 100 in a round trip: DEPTH_MAX times concurrency beyond it
    assert core.depth == DEPTH_MAX * 10
    assert core.rtt == pytest.approx(0.001) and core.handler_mean == pytest.approx(0.0001)
    # all it asked for and nothing left: maybe more, so still a backlog
    ran(core, 0.0001, 0.001)
    core.claimed(full(remaining=0), 10, 0.2, None)
    assert core.depth == DEPTH_MAX * 10


def test_pipelining_stops_when_the_queue_is_empty() -> None:
    core = make_core()
    ran(core, 0.0001, 0.001)
    core.claimed(full(), 10, 0.0, None)
    assert core.depth == DEPTH_MAX * 10
    ran(core, 0.0001, 0.001)
    core.claimed(full(3, remaining=0), 10, 0.1, None)
    assert core.depth == 0


def test_pipelining_stops_when_handlers_are_long_against_a_round_trip() -> None:
    core = make_core()
    ran(core, 0.0001, 0.001)
    core.claimed(full(), 10, 0.0, None)
    assert core.depth == DEPTH_MAX * 10
    ran(core, 0.05, 0.001)  # handlers of 50 round trips
    core.claimed(full(), 10, 0.1, None)
    assert core.depth == 0
    # a round trip that takes no new claim timing keeps the means
    mean = core.handler_mean
    core.claimed(full(), 10, 0.2, None)
    assert (core.depth, core.handler_mean) == (0, mean)
    # short again: the running mean comes back down over a few round trips
    for i in range(30):
        ran(core, 0.0001, 0.001)
        core.claimed(full(), 10, 0.3 + i, None)
    assert core.depth == DEPTH_MAX * 10


def test_the_depth_is_what_the_slots_run_in_a_round_trip_within_its_bounds() -> None:
    core = make_core()
    ran(core, 0.0004, 0.001)  # 10 slots run 25 processes per round trip
    core.claimed(full(), 10, 0.0, None)
    assert core.depth == 25
    core = make_core()
    ran(core, 0.0019, 0.001)  # at most SHORT_RTTS round trips: still short
    core.claimed(full(), 10, 0.0, None)
    assert core.depth == 6
    core = make_core()
    ran(core, 0.0021, 0.001)  # longer: none
    core.claimed(full(), 10, 0.0, None)
    assert core.depth == 0
    # never more than HOLD_MAX held in all: at concurrency 100, none beyond
    for concurrency, depth in [(50, HOLD_MAX - 50), (HOLD_MAX, 0)]:
        core = make_core(concurrency=concurrency)
        ran(core, 0.000001, 0.001)
        core.claimed(full(), 10, 0.0, None)
        assert core.depth == depth


@pytest.mark.parametrize("options", [{"prefetch": 0}, {"prefetch": 3}, {"batch": 5}])
def test_pipelining_is_only_the_default_for_plain_handlers(options: dict[str, int]) -> None:
    core = make_core(**options)
    for i in range(3):
        ran(core, 0.0001, 0.001)
        core.claimed(full(), 10, float(i), None)
    assert core.depth == 0


def test_every_slot_long_or_persistent_is_stuck_and_says_when_to_look_again() -> None:
    core = make_core(concurrency=2)
    ran(core, 0.0001, 0.001)
    core.claimed(full(2), 2, 0.0, None)
    long_after = core.long_after()
    assert long_after == max(LONG_RTTS * 0.001, LONG_MIN)
    # a free slot: never stuck
    assert core.slots_stuck(10.0, [(False, 0.0)]) == (False, math.inf)
    # both busy with handlers that began at 1.0 and 1.001: not yet long
    stuck, look_again = core.slots_stuck(1.002, [(False, 1.0), (False, 1.001)])
    assert not stuck and look_again == pytest.approx(1.001 + long_after)
    assert core.slots_stuck(1.001 + long_after, [(False, 1.0), (False, 1.001)])[0]
    # a persistent handler is stuck at once; the other slot decides
    stuck, look_again = core.slots_stuck(1.0, [(True, 1.0), (False, 1.0)])
    assert not stuck and look_again == pytest.approx(1.0 + long_after)
    assert core.slots_stuck(1.0, [(True, 1.0), (True, 1.0)]) == (True, math.inf)


def test_a_fixed_prefetch_is_stuck_only_behind_persistent_handlers() -> None:
    core = make_core(concurrency=2, prefetch=2)
    assert core.slots_stuck(100.0, [(False, 0.0), (False, 0.0)]) == (False, math.inf)
    assert core.slots_stuck(0.0, [(True, 0.0), (True, 0.0)]) == (True, math.inf)
