"""Smoke tests of ``bench/``: every benchmark runs in a tiny configuration and
produces figures of the right shape. Nothing here asserts a speed: timed
assertions would only measure the machine the tests run on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import _charts, _node
from bench._context import Context
from bench._report import Figure, Section, markdown, text_table
from bench.suites import cancel, delayed, failover, fleet, latency, memory, scale, throughput

pytestmark = pytest.mark.slow


SPIN = 100_000  # rounds of each CPU-bound process of the machine's 2 / 1


REPO = Path(__file__).resolve().parent.parent


def ctx() -> Context:
    return Context(runs=1, log=lambda line: None)


def figure(section: Section, label: str) -> Figure:
    for f in section.figures:
        if f.label == label:
            return f
    raise AssertionError(f"no figure {label!r} in {[f.label for f in section.figures]}")


def check(section: Section, name: str) -> None:
    assert section.name == name
    assert section.runs == 1
    assert section.method.strip()
    for f in section.figures:
        if f.quoted:
            assert not f.runs
            continue
        assert len(f.runs) == 1, f.label
        if f.label.endswith("per task: trio-mesh (concurrency 10) / the bare loop"):
            # a CPU time is read in clock ticks (10 ms): the loop's smoke run
            # of 2,000 tasks may read none, and the ratio is then not a number
            continue
        assert all(not math.isnan(v) for v in f.runs), f.label
        assert f.min <= f.median <= f.max
    text = text_table(section)
    assert section.title in text
    md = markdown([section], {"CPU": "test"}, "python -m bench", "now")
    assert f"## {section.title}" in md
    assert "| figure | median | min | max |" in md


async def test_throughput() -> None:
    s = await throughput.run(
        ctx(),
        throughput.Sizes(tasks=2000, peers=False, worqr=False, bullmq=False, spin=SPIN, spins=1),
    )
    check(s, "throughput")
    rate = figure(s, "trio-mesh, 1 worker process: processing")
    assert rate.unit == "tasks/s" and rate.median > 0
    assert rate.target is not None
    assert rate.verdict() == "met" or rate.verdict().startswith("missed by")
    assert figure(s, "trio-mesh, 2 worker processes: processing").median > 0
    busy = figure(s, "trio-mesh, 1 worker process: the machine's cores busy")
    assert busy.unit == "%" and 0 < busy.median <= 100
    enq = figure(s, "trio-mesh, 1 worker process: enqueue 2,000")
    assert enq.unit == "s" and enq.target is not None
    ratio = figure(s, "trio-mesh: 2 worker processes / 1")
    assert ratio.target is not None and ratio.median > 0
    # the default (adaptive pipelining) against pipelining off, same run
    assert figure(s, "trio-mesh: the default (adaptive pipelining) / prefetch 0").median > 0
    # the machine's own 2 / 1, measured in the same run, and the mesh's over it
    assert figure(s, "the machine: 1 CPU-bound process alone").median > 0
    machine = figure(s, "the machine: 2 CPU-bound processes / 1 (no Redis, nothing shared)")
    assert machine.median > 0 and machine.target is None
    assert (
        figure(s, "the machine: CPU time of the same work, 2 processes at once / 1 alone").median
        > 0
    )
    over = figure(s, "trio-mesh: 2 worker processes / 1, over the machine's 2 / 1")
    assert over.median == pytest.approx(ratio.median / machine.median)
    # the limit: the bare loop ran on the same queue shape, its figures
    # beside trio-mesh's, and issue 34's same-run ratios against it
    loop = "the limit: a bare Python loop with trio-mesh's batching"
    assert figure(s, f"{loop}: processing").median > 0
    assert figure(s, f"{loop}: script calls per task").median == pytest.approx(0.1, abs=0.02)
    assert figure(s, f"{loop}: worker CPU per task").median >= 0  # may be under a clock tick
    assert figure(s, "trio-mesh, 1 worker process, concurrency 100: processing").median > 0
    for label, value in (
        ("trio-mesh (concurrency 10) / the bare loop, same run", 0.7),
        ("Redis CPU per task: trio-mesh (concurrency 10) / the bare loop", 1.8),
        ("worker CPU per task: trio-mesh (concurrency 10) / the bare loop", 1.5),
    ):
        ratio = figure(s, label)
        assert ratio.target is not None and ratio.target.value == value
        # (the CPU ratios may be unreadable at this size: see above)
        # (a CPU figure under a clock tick reads 0, so its ratio may be 0 too)
        assert ratio.median > 0 if "CPU" not in label else not ratio.median < 0
    assert s.figures[0].label == "trio-mesh (concurrency 10) / the bare loop, same run"


async def test_throughput_node_peers() -> None:
    """Worqr and BullMQ run in the same run as trio-mesh, through their Node
    drivers, with the same figures as every peer; BullMQ at concurrency 10
    and 100, beside trio-mesh at both. Where node, npm, the Worqr tarball
    (outside the repository) or the npm registry is missing, the run goes on
    without that peer and says why (the next test forces that case)."""
    w, why = _node.prepare_worqr()
    b, why_b = _node.prepare_bullmq()
    s = await throughput.run(
        ctx(), throughput.Sizes(tasks=300, loop=False, peers=False, spin=SPIN, spins=1)
    )
    check(s, "throughput")
    assert figure(s, "trio-mesh, 1 worker process: processing").median > 0
    if b is None:
        assert why_b.startswith("BullMQ skipped: ") and why_b in s.notes
        assert not [f for f in s.figures if "BullMQ" in f.label]
    else:
        v = b.version.split()[0]
        for conc in (10, 100):
            label = f"BullMQ {v} (Node), concurrency {conc}"
            assert figure(s, f"{label}: processing").median > 0
            # a job's move to active and to completed are one script call
            # each, with several commands inside
            assert figure(s, f"{label}: Redis commands per task").median >= 4
            assert figure(s, f"{label}: Redis CPU per task").median > 0
            assert figure(s, f"{label}: worker CPU per task").median > 0
        for conc, most in ((10, 3.5), (100, 6.0)):
            same = figure(s, f"trio-mesh / BullMQ, both at concurrency {conc}, same run")
            assert same.target is not None and same.target.value == most and same.median > 0
        assert any(n.startswith("BullMQ ran under ") for n in s.notes)
    if w is None:
        assert why.startswith("Worqr skipped: ") and why in s.notes
        assert not [f for f in s.figures if "Worqr" in f.label]
        return
    label = f"Worqr {w.version.split()[0]} (Node)"
    assert figure(s, f"{label}: processing").median > 0
    # Worqr's dequeue + finishProcess are at least 8 commands per task
    assert figure(s, f"{label}: Redis commands per task").median >= 8
    assert figure(s, f"{label}: Redis CPU per task").median > 0
    assert figure(s, f"{label}: worker CPU per task").median > 0
    same = figure(s, "trio-mesh / Worqr, both at concurrency 10, same run")
    assert same.target is not None and same.target.value == 3.5 and same.median > 0
    assert any(n.startswith("Worqr ran under ") for n in s.notes)


async def test_throughput_without_worqr(monkeypatch: pytest.MonkeyPatch) -> None:
    """No tarball: Worqr is skipped with a note, and the run goes on."""
    monkeypatch.setenv("BENCH_WORQR_TGZ", "/nonexistent/worqr-1.2.3.tgz")
    s = await throughput.run(
        ctx(),
        throughput.Sizes(
            tasks=200, high=0, loop=False, bullmq=False, peers=False, spin=SPIN, spins=1
        ),
    )
    assert [n for n in s.notes if n.startswith("Worqr skipped: worqr-1.2.3.tgz not found")]
    assert not [f for f in s.figures if "Worqr" in f.label]
    assert figure(s, "trio-mesh, 1 worker process: processing").median > 0


def test_bullmq_without_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """No node on PATH: BullMQ is skipped with a one-line note, nothing raises."""
    monkeypatch.setenv("PATH", "/nonexistent")
    b, why = _node.prepare_bullmq()
    assert b is None and why == "BullMQ skipped: node and npm are needed (not found on PATH)"


async def test_failover() -> None:
    s = await failover.run(ctx(), failover.Sizes(trials=2, ttl=0.5))
    check(s, "failover")
    p99 = figure(s, "SIGKILL: p99")
    assert figure(s, "SIGKILL: p99 of all 2 trials pooled").target is not None
    # no worker can take over before the dead one's lease runs out
    assert p99.median > 0.5 * 2 / 3 - 0.05
    assert figure(s, "SIGKILL: p99 / TTL").median == pytest.approx(p99.median / 0.5)
    assert figure(s, "graceful stop (SIGTERM): p99").unit == "ms"
    # every trial is kept for the chart, the p99 among them
    unit, kills = s.samples["SIGKILL"]
    assert unit == "s" and len(kills) == 2 and max(kills) >= p99.median


async def test_cancel() -> None:
    s = await cancel.run(ctx(), cancel.Sizes(workers=2, per_process=2, processes=20))
    check(s, "cancel")
    for kind in ("persistent", "one-shot", "persistent, fleets"):
        p99 = figure(s, f"{kind}: after cancel() returned, p99")
        assert p99.unit == "ms" and p99.median >= 0 and p99.target is not None
        assert 0 <= figure(s, f"{kind}: cancelled before cancel() returned").median <= 100


async def test_latency() -> None:
    """trio-mesh and (where node and the registry are there) BullMQ, each run
    measuring both; the warm-up tasks are left out of the figures."""
    b, why = _node.prepare_bullmq()
    s = await latency.run(ctx(), latency.Sizes(tasks=60, warmup=10))
    check(s, "latency")
    p99 = figure(s, "trio-mesh: p99")
    assert p99.unit == "ms" and p99.median > 0 and p99.target is not None
    assert figure(s, "trio-mesh: max").median >= p99.median
    assert figure(s, "trio-mesh: achieved enqueue rate").median > 0
    unit, values = s.samples["trio-mesh"]
    assert unit == "ms" and len(values) == 50
    assert any(n.startswith("Clock check: ") for n in s.notes)
    if b is None:
        assert why in s.notes
        assert not [f for f in s.figures if "BullMQ" in f.label]
        return
    v = b.version.split()[0]
    assert len(s.samples[f"BullMQ {v}"][1]) == 50
    ratio = figure(s, f"BullMQ {v} p99 / trio-mesh p99, same run")
    assert ratio.target is not None and ratio.target.value == 3.0
    assert ratio.median == pytest.approx(figure(s, f"BullMQ {v}: p99").median / p99.median)


async def test_latency_against_a_base_tree() -> None:
    """``python -m bench --base TREE``: trio-mesh at that tree runs in the
    same runs, and this tree's p99 is read over its (here, the same tree)."""
    c = Context(runs=1, log=lambda line: None, base=str(REPO))
    s = await latency.run(c, latency.Sizes(tasks=60, warmup=10, bullmq=False))
    here, there = figure(s, "trio-mesh: p99"), figure(s, "trio-mesh, base tree: p99")
    ratio = figure(s, "trio-mesh p99 / at the base tree, same run")
    assert ratio.target is not None and ratio.target.value == 1.1
    assert ratio.median == pytest.approx(here.median / there.median)
    assert len(s.samples["trio-mesh, base tree"][1]) == 50


def test_latency_summarize() -> None:
    """The warm-up is left out, the rate spans first to last enqueue, and a
    task that started twice or never is an error, not a figure."""
    rows = [(i, (i + 1) * 1_000_000) for i in range(5)]  # task i took i + 1 ms
    got = latency.summarize(reversed(rows), 5, 2, 0, 8_000_000, 500_000)
    assert got.ms == [3.0, 4.0, 5.0]
    assert got.rate == pytest.approx(4 / 0.008)
    assert got.p50 == 4.0 and got.max == 5.0 and got.clock_window_ms == 0.5
    with pytest.raises(RuntimeError, match="started twice"):
        latency.summarize([*rows, (3, 1)], 5, 0, 0, 1)
    with pytest.raises(RuntimeError, match=r"not started: \[4\]"):
        latency.summarize(rows[:4], 5, 0, 0, 1)
    with pytest.raises(RuntimeError, match=r"not ours: \[7\]"):
        latency.summarize([*rows, (7, 1)], 5, 0, 0, 1)


async def test_delayed() -> None:
    s = await delayed.run(ctx(), delayed.Sizes(tasks=200, workers=1))
    check(s, "delayed")
    assert figure(s, "200 due at once: all ran after").unit == "s"
    assert figure(s, "due at once: Redis CPU per task").median > 0
    assert figure(s, "plain queue, same tasks: rate").median > 0


async def test_scale() -> None:
    sizes = scale.Sizes(
        processes=1,
        per_process=4,
        concurrency=2,
        ttl=1.0,
        idle_window=0.3,
        slowlog_window=1.5,
        recycle=(1, 2),
        herd=2,
        long_queue=1_000,
        claim_samples=10,
        compare_processes=1,
        compare_per_process=3,
        big_processes=1,
        big_per_process=5,
        # at ttl 3 s a worker or fleet beats once a second: a window shorter
        # than that may see no heartbeat at all (it did, about half the time)
        fleet_window=1.2,
        fleet_slowlog=1.2,
    )
    s = await scale.run(ctx(), sizes)
    check(s, "scale")
    assert figure(s, "idle Redis CPU, 4 workers").target is not None
    assert figure(s, "heartbeat: calls per second").median > 0
    assert figure(s, "recycle 2 dead workers (4 processes): Redis time").median > 0
    assert figure(s, "claim 1: queue of 1,000 / queue of 10").target is not None
    assert figure(s, "2 workers SIGKILLed: recycle calls by all peers").median >= 1
    assert 1 <= figure(s, "recycle 2 dead workers: recycle.lua calls").median <= 2
    s = await fleet.run(ctx(), sizes)
    check(s, "fleet")
    assert figure(s, "5 idle fleets, ttl 3 s, no tasks: Redis CPU").target is not None
    assert figure(s, "3 idle fleets, ttl 3 s: heartbeat.lua calls").median > 0
    assert figure(s, "3 idle open_workers, ttl 3 s: leases renewed").median > 0


async def test_memory() -> None:
    s = await memory.run(ctx(), memory.Sizes(tasks=500))
    check(s, "memory")
    queued = figure(s, "one-shot: per queued task (32 B payload)")
    assert queued.unit == "B" and queued.median > 0 and queued.target is not None
    assert figure(s, "persistent: per running process (32 B payload)").median > 0


def test_charts(tmp_path: Path) -> None:
    """The charts are PNG files, embedded in the report, drawn from the
    figures and samples only."""
    tp = Section("throughput", "Throughput", "m", runs=3)
    for label, v in (("trio-mesh, 1 worker process", 20_000.0), ("Worqr 1.2.3 (Node)", 9_000.0)):
        tp.figures.append(Figure(f"{label}: processing", "tasks/s", [v * 0.9, v, v * 1.1]))
    fo = Section("failover", "Failover", "m", runs=1)
    fo.samples["SIGKILL"] = ("s", [0.8, 0.9, 1.0])
    fo.limits["SIGKILL"] = 1.25
    mem = Section("memory", "Memory", "m", runs=1)  # nothing to draw
    assert _charts.available() == ""
    _charts.draw([tp, fo, mem], tmp_path / "img")
    assert [c.file for c in tp.charts] == ["bench-throughput.png"]
    assert [c.file for c in fo.charts] == ["bench-failover.png"]
    assert not mem.charts
    for name in ("bench-throughput.png", "bench-failover.png"):
        data = (tmp_path / "img" / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5_000
    md = markdown([tp, fo, mem], {}, "python -m bench", "now", "img")
    assert "](img/bench-throughput.png)" in md and "](img/bench-failover.png)" in md


def test_update_markdown_replaces_only_what_was_measured() -> None:
    """--update: the sections measured anew replace theirs (figures, target
    rows naming the commit, charts, the headline); the others stay as they
    were; the note goes first in the update history at the end."""
    from bench._report import Chart, Target, update_markdown

    def section(name: str, title: str, v: float) -> Section:
        s = Section(name, title, f"method of {name}", runs=1)
        s.figures.append(Figure("rate", "x", [v], target=Target(">=", 1.0, ">= 1")))
        return s

    old = markdown(
        [section("throughput", "Throughput", 111.0), section("memory", "Memory", 222.0)],
        {"CPU": "test"},
        "python -m bench",
        "then",
    )
    old += "\n## Findings and profiles\n\nold findings\n"
    fresh = section("throughput", "Throughput", 333.0)
    fresh.charts.append(Chart("bench-throughput.png", "alt"))
    fresh.measured = "commit abc1234, now"
    fresh.headline = "| the headline table |"
    findings = "## Findings and profiles\n\ncurrent findings\n"
    new = update_markdown(old, [fresh], "Updated: now, Throughput anew.", findings=findings)
    assert findings.strip() in new and new.index(findings.strip()) < new.index("## Update history")
    assert "| Throughput: rate | 333 | x | >= 1 | met | commit abc1234 |" in new
    assert "| Memory: rate | 222 | x | >= 1 | met |" in new
    assert "111" not in new and "old findings" not in new
    # the headline first, with the commit and the charts (not repeated below)
    assert new.index("## Headline") < new.index("## Targets") < new.index("## Throughput")
    assert "Measured at commit abc1234, now (Throughput, 1 runs)." in new
    assert new.count("![alt](img/bench-throughput.png)") == 1
    assert new.index("![alt](img/bench-throughput.png)") < new.index("## Targets")
    assert "Measured at commit abc1234, now." in new
    history = new[new.index("## Update history") :]
    assert history.index("Updated: now, Throughput anew.") < history.index("Run: `python -m bench`")
    assert new.index("## Throughput") < new.index("## Memory")
    assert new.count("## Targets") == 1 and new.count("## Machine") == 1
    with pytest.raises(ValueError, match="no Targets table"):
        update_markdown("# something else\n\n## A\n", [fresh], "note")


def test_update_markdown_keeps_the_order_of_hand_written_sections() -> None:
    """--update keeps every section where it stood, findings and sections
    after them included, and hand-written rows of the Targets table; the
    findings are replaced by the current ones in place, a section new to the
    report goes before them."""
    from bench._report import Target, update_markdown

    def section(title: str, v: float) -> Section:
        s = Section(title.lower(), title, f"method of {title}", runs=1)
        s.figures.append(Figure("rate", "x", [v], target=Target(">=", 1.0, ">= 1")))
        return s

    old = markdown([section("Throughput", 111.0), section("Memory", 222.0)], {}, "cmd", "then")
    old = old.replace("| Memory: rate", "| By hand: rate | 7 | x | >= 1 | met |\n| Memory: rate")
    old += "\n## By hand\n\nwritten by hand\n"
    old += "\n## Findings and profiles\n\nold findings\n\n### A subsection\n"
    old += "\n## Topologies (by hand, after the findings)\n\nmore by hand\n"
    new = update_markdown(
        old,
        [section("Memory", 333.0), section("Delayed", 444.0)],
        "Updated: now.",
        findings="## Findings and profiles\n\nnew findings\n",
    )
    headings = [line for line in new.splitlines() if line.startswith("## ")]
    assert headings == [
        "## Targets",
        "## Machine",
        "## Throughput",
        "## Memory",
        "## By hand",
        "## Delayed",
        "## Findings and profiles",
        "## Topologies (by hand, after the findings)",
        "## Update history",
    ]
    rows = [line.split(" | ")[0] for line in new.splitlines() if ": rate |" in line]
    assert rows == [
        "| Throughput: rate",
        "| By hand: rate",
        "| Memory: rate",
        "| Delayed: rate",
    ]
    assert "| Memory: rate | 333 |" in new and "| Delayed: rate | 444 |" in new
    assert "new findings" in new and "old findings" not in new and "A subsection" not in new
    assert "more by hand" in new and "written by hand" in new
    # nothing measured, the same findings: the report is unchanged but for the note
    same = update_markdown(new, [], "Again.", findings="## Findings and profiles\n\nnew findings\n")
    assert same.replace("\n\nAgain.", "", 1) == new


async def test_parts() -> None:
    """bench.tools.parts times each piece of a runner's cycle (a real claim reply
    is parsed: the protocol's reply shape, not a copy of it)."""
    from bench.suites import parts

    rows = dict(await parts.run(rounds=20, repeat=1))
    assert len(rows) == 8
    assert all(v > 0 for v in rows.values())
    assert "parse a claim reply of 10 processes" in rows
    assert "run 10 handlers in the runner's pool (mesh._runner)" in rows


async def test_balance_fleet_rolling() -> None:
    """bench.tools.balance_fleet rolling: 2 peers replaced one after the other (OS
    processes whose children freeze their GC once serving), every task handed
    over, never to a peer while its old handler ran, balanced at the end."""
    from bench.suites import balance_fleet

    res = await balance_fleet.rolling(2, 20, 1.0, gc_freeze=True)
    assert res["children_gc"] == "gc.freeze() once serving"
    assert int(res["handovers"]) >= 20  # each task once at least
    assert res["overlaps"] == 0
    assert res["final_spread"] == "10-10"
    assert res["rejoins_after_fencing"] == 0


async def test_fleet_stop() -> None:
    """bench.tools.fleet_trials stop: a fleet cancelled from outside hands every task
    back, and the process exits; both times are reported, one per trial."""
    from bench.suites import fleet_trials

    out = await fleet_trials.stop(workers=5, ttl=3.0, trials=2)
    back = [float(x) for x in str(out["every task back in the queue after (s)"]).split()]
    exited = [float(x) for x in str(out["the process exited after (s)"]).split()]
    assert len(back) == len(exited) == 2
    assert all(0 < b <= e for b, e in zip(back, exited, strict=True))


async def test_groups() -> None:
    """bench.suites.groups at a tiny size: fairness read from every job's end,
    the cost of many groups against one (with Redis time by command), and the
    ungrouped A/B against the tree before groups (extracted by git archive)."""
    from bench.suites import groups

    sizes = groups.Sizes(
        big=2_000, small=20, small_jobs=5, workers=2, cost_jobs=2_000, ab_tasks=1_000, ab_rounds=1
    )
    s = await groups.suite(ctx(), sizes)
    assert s.name == "groups" and s.runs == 1 and s.method.strip()
    share = figure(s, "fairness: the same, share of the big group")
    assert share.target is not None and 0 <= share.median <= 100
    jain = figure(
        s, "fairness: Jain's index over the 21 groups' jobs done while all were backlogged"
    )
    assert 1 / 21 <= jain.median <= 1
    assert figure(s, "fairness: jobs done in the window").median > 0
    ratio = figure(s, "cost: 200 groups / 1 group, jobs/s, same run")
    assert ratio.target is not None and ratio.median > 0
    assert figure(s, "cost, 200 groups x 10: jobs/s").median > 0
    assert any("evalsha" in n for n in s.notes)
    ab = "ungrouped, 1,000 no-op tasks, 1 worker process, concurrency 10: this tree / the base tree"
    assert figure(s, ab).median > 0
    assert any(groups.BASE_REV in n for n in s.notes)
    assert "## Groups" in markdown([s], {"CPU": "test"}, "python -m bench", "now")


def test_groups_jain() -> None:
    from bench.suites import groups

    assert groups.jain([5, 5, 5]) == 1.0
    assert groups.jain([9, 0, 0]) == pytest.approx(1 / 3)
    done = [(1, "big"), (2, "s0"), (3, "s1"), (4, "big"), (5, "s0"), (6, "s1"), (7, "big")]
    got = groups.judge(done, groups.Sizes(big=3, small=2, small_jobs=2))
    # the small groups' last jobs end at 5 and 6: 2 of big's by then; the
    # window ends at the first of them (5): big 2, s0 1, s1 1 before it
    assert got.big_done == 2
    assert got.window_jobs == 4 and got.window == pytest.approx(4e-9)
    assert got.jain == pytest.approx(16 / 18)


async def test_script_cost() -> None:
    """bench.suites.script_cost at a tiny size, one measure: Redis
    instructions per task counted under callgrind, this tree against the tree
    before groups (git archive), and the ratio."""
    from bench.suites import script_cost

    s = await script_cost.suite(ctx(), n=300, measures=[("claim", 10)])
    here = figure(s, "claim, batch 10: Redis instructions per task, this tree").median
    there = figure(s, "claim, batch 10: the same, base tree").median
    # a claim of ten plain tasks costs Redis thousands of instructions per
    # task (about 55,000 on 2 cores here), far from zero and far from millions
    assert 5_000 < here < 500_000 and 5_000 < there < 500_000
    ratio = figure(s, "claim, batch 10: this tree / the base tree")
    assert ratio.median == pytest.approx(here / there) and ratio.target is not None
    assert any("8fa163c" in n for n in s.notes)


async def test_script_cost_without_valgrind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without valgrind the section says so and counts nothing."""
    from bench.suites import script_cost

    monkeypatch.setattr("shutil.which", lambda name: None)
    s = await script_cost.suite(ctx(), n=300)
    assert s.figures == [] and any("valgrind is not installed" in n for n in s.notes)
