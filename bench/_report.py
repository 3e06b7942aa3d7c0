"""Figures, targets, and how they are printed and written to
``docs/performance.md``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ._util import median


@dataclass(frozen=True)
class Target:
    """A target for a figure's median: ``op`` is ``"<"``, ``"<="`` or ``">="``."""

    op: str
    value: float
    text: str

    def verdict(self, v: float, unit: str) -> str:
        if math.isnan(v):
            return "not measured"
        met = {"<": v < self.value, "<=": v <= self.value, ">=": v >= self.value}[self.op]
        if met:
            return "met"
        gap = abs(v - self.value)
        rel = gap / self.value * 100 if self.value else math.inf
        return f"missed by {num(gap)} {unit} ({rel:.0f}%)"


@dataclass
class Figure:
    """One measured quantity: one value per run (for latency figures, each
    run's percentile), reported as median, min and max."""

    label: str
    unit: str
    runs: list[float]
    target: Target | None = None
    note: str = ""
    quoted: str = ""  # set for figures not measured here: the quoted range

    @property
    def median(self) -> float:
        return median([v for v in self.runs if not math.isnan(v)])

    @property
    def min(self) -> float:
        xs = [v for v in self.runs if not math.isnan(v)]
        return min(xs) if xs else math.nan

    @property
    def max(self) -> float:
        xs = [v for v in self.runs if not math.isnan(v)]
        return max(xs) if xs else math.nan

    def verdict(self) -> str:
        if self.target is None:
            return ""
        return self.target.verdict(self.median, self.unit)

    def cells(self) -> list[str]:
        if self.quoted:
            return [self.label, self.quoted, "", "", self.unit, "", "quoted, not measured here"]
        t = self.target.text if self.target else ""
        return [
            self.label,
            num(self.median),
            num(self.min),
            num(self.max),
            self.unit,
            t,
            self.verdict(),
        ]


@dataclass(frozen=True)
class Chart:
    """A picture of a section (see :mod:`bench._charts`): its file name, relative
    to the folder the charts are drawn into, and its alt text."""

    file: str
    alt: str


@dataclass
class Section:
    name: str
    title: str
    method: str
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    runs: int = 0
    # every trial's value, all runs pooled, for the charts: label -> (unit, values)
    samples: dict[str, tuple[str, list[float]]] = field(default_factory=dict)
    limits: dict[str, float] = field(default_factory=dict)  # label -> target, same unit
    charts: list[Chart] = field(default_factory=list)
    # which code and when: "commit abc1234, 2026-11-28 02:30 UTC" (set by python -m bench)
    measured: str = ""
    # the report's headline (markdown under "## Headline"), for the section that has one
    headline: str = ""


HEADER = ["figure", "median", "min", "max", "unit", "target", "verdict"]


def num(v: float) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "n/a"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def text_table(section: Section) -> str:
    rows = [HEADER] + [f.cells() for f in section.figures]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = [f"== {section.title} ({section.runs} runs) =="]
    for j, r in enumerate(rows):
        cells = [
            c.ljust(widths[i]) if i in (0, 4, 5, 6) else c.rjust(widths[i]) for i, c in enumerate(r)
        ]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [f"  note: {n}" for n in section.notes]
    return "\n".join(lines)


def markdown_table(section: Section) -> str:
    rows = [HEADER] + [f.cells() for f in section.figures]
    rule = "|" + "|".join(["---"] + ["--:"] * 3 + ["---"] * 3) + "|"
    out = ["| " + " | ".join(rows[0]) + " |", rule]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows[1:]]
    return "\n".join(out)


def target_rows(s: Section) -> list[str]:
    """The rows of the Targets table for one section's figures."""
    at = s.measured.split(",")[0] if s.measured else ""
    return [
        f"| {s.title}: {f.label} | {num(f.median)} | {f.unit} | {f.target.text} | {f.verdict()} "
        f"| {at} |"
        for f in s.figures
        if f.target is not None
    ]


def headline_markdown(sections: Sequence[Section], charts_dir: str = "img") -> str | None:
    """The ``## Headline`` block: the headline of the (first) section that
    has one, with the commit it was measured at and its charts; None if no
    section has one."""
    s = next((s for s in sections if s.headline), None)
    if s is None:
        return None
    parts = ["## Headline", ""]
    if s.measured:
        parts += [f"Measured at {s.measured} ({s.title}, {s.runs} runs).", ""]
    parts += [s.headline.strip(), ""]
    for c in s.charts:
        parts += [f"![{c.alt}]({charts_dir}/{c.file})", ""]
    return "\n".join(parts).rstrip("\n")


def section_markdown(s: Section, charts_dir: str = "img") -> str:
    """One section: its heading, method, charts, table and notes."""
    parts = [f"## {s.title}", ""]
    if s.measured:
        parts += [f"Measured at {s.measured}.", ""]
    parts += [s.method.strip(), "", f"Runs: {s.runs}.", ""]
    for c in [] if s.headline else s.charts:  # a headline shows them
        parts += [f"![{c.alt}]({charts_dir}/{c.file})", ""]
    parts.append(markdown_table(s))
    if s.notes:
        parts.append("")
        parts += [f"- {n}" for n in s.notes]
    return "\n".join(parts)


TARGETS_HEAD = ["## Targets", "", "| figure | median | unit | target | verdict | measured at |",
                "|---|--:|---|---|---|---|"]  # fmt: skip
HISTORY = "## Update history"


INTRO = (
    "Written by `python -m bench` (the figures below are what its runs measured; "
    "nothing here is typed in by hand). Every benchmark starts its own "
    "redis-server on 127.0.0.1 and its own worker processes; each figure is the "
    "median of the runs, with the smallest and largest run, and names the commit "
    "it was measured at. The verdict compares the median with the target. Which "
    "run measured what: the update history at the end."
)


def markdown(
    sections: Sequence[Section],
    machine: dict[str, str],
    command: str,
    when: str,
    charts_dir: str = "img",
) -> str:
    """The report: the headline (if a section has one), the targets, the
    machine, each section (its charts embedded as images under
    ``charts_dir``, relative to the report), and the update history."""
    parts = ["# Performance", "", INTRO]
    head = headline_markdown(sections, charts_dir)
    if head is not None:
        parts += ["", head]
    parts += ["", *TARGETS_HEAD]
    for s in sections:
        parts += target_rows(s)
    parts += ["", "## Machine", "", "| | |", "|---|---|"]
    parts += [f"| {k} | {v} |" for k, v in machine.items()]
    for s in sections:
        parts += ["", section_markdown(s, charts_dir)]
    parts += ["", HISTORY, "", f"Run: `{command}`, {when}."]
    return "\n".join(parts) + "\n"


def update_markdown(
    old: str,
    sections: Sequence[Section],
    note: str,
    charts_dir: str = "img",
    findings: str | None = None,
) -> str:
    """``old`` (a report written by :func:`markdown`, findings included) with
    ``sections`` measured anew: each replaces the section of the same title
    (a new one goes after the others, before the findings) and its rows of
    the Targets table, where they stood; every other section and row stays
    as it was, in the order it had (hand-written ones, and sections after
    the findings, included). A measured section with a headline replaces
    the ``## Headline`` block (put first if there was none).
    ``findings`` (the current ``bench/findings.md``) replaces the
    ``## Findings...`` section where it stands (goes at the end if there was
    none); None keeps it as it was. ``note`` (which run, which sections) goes
    first in the update history at the end (made there if missing, with the
    ``Run:`` and ``Updated:`` lines of an older report's head moved into it).

    Raises:
        ValueError: ``old`` has no Targets table (not a report of ours).
    """
    blocks = old.split("\n## ")
    head = blocks[0]
    parts = [("## " + b).rstrip("\n") for b in blocks[1:]]
    titles = [b.split("\n", 1)[0][3:].strip() for b in parts]
    if "Targets" not in titles:
        raise ValueError("not a report written by python -m bench: it has no Targets table")
    old_targets = parts[titles.index("Targets")].splitlines()
    new = {s.title: s for s in sections}
    headline = headline_markdown(sections, charts_dir)
    history_title = HISTORY[3:]
    history: list[str] = []
    if history_title in titles:
        history = parts[titles.index(history_title)].split("\n")[1:]
    # an older report: its run and update lines go into the history
    head_lines = head.rstrip("\n").split("\n")
    moved = [x for x in head_lines if x.startswith(("Run: ", "Updated: "))]
    head_lines = [x for x in head_lines if not x.startswith(("Run: ", "Updated: "))]
    history = [x for x in history if x.strip()] + moved
    # newest first, the full run's line last
    history = (
        [note]
        + [x for x in history if x.startswith("Updated: ")]
        + [x for x in history if not x.startswith("Updated: ")]
    )
    body: list[tuple[str, str]] = []
    for title, block in zip(titles, parts, strict=True):
        if title == history_title:
            continue
        if title == "Headline":
            body.append((title, block if headline is None else headline))
            headline = None
            continue
        if title.startswith("Findings"):
            # measured sections not in the old report go before the findings
            body += [(s.title, section_markdown(s, charts_dir)) for s in new.values()]
            new = {}
            body.append((title, block if findings is None else findings.strip("\n")))
            continue
        s = new.pop(title, None)
        body.append((title, block if s is None else section_markdown(s, charts_dir)))
    body += [(s.title, section_markdown(s, charts_dir)) for s in new.values()]
    if findings is not None and not any(t.startswith("Findings") for t, _ in body):
        body.append(("Findings", findings.strip("\n")))
    if headline is not None:
        body.insert(0, ("Headline", headline))
    # the Targets table: the rows of the measured sections replace theirs
    # where they stood (or go at the end); every other row, hand-written or
    # from a section measured earlier, and any text after the table stay
    measured = {s.title: s for s in sections}
    table_end = 2
    while table_end < len(old_targets) and old_targets[table_end].startswith("|"):
        table_end += 1
    rows: list[str] = []
    placed: set[str] = set()
    for row in old_targets[len(TARGETS_HEAD) : table_end]:
        owner = next((t for t in measured if row.startswith(f"| {t}: ")), None)
        if owner is None:
            rows.append(row)
        elif owner not in placed:
            rows += target_rows(measured[owner])
            placed.add(owner)
    for title, _ in body:
        if title in measured and title not in placed:
            rows += target_rows(measured[title])
    targets = "\n".join([*TARGETS_HEAD, *rows, *old_targets[table_end:]])
    out = ["\n".join(head_lines).rstrip("\n")]
    out += [targets if t == "Targets" else b for t, b in body]
    out.append("\n\n".join([HISTORY, *history]))
    return "\n\n".join(out) + "\n"


def figures_of(
    scenario: str, results: Sequence[Mapping[str, object]]
) -> tuple[list[Figure], list[str]]:
    """The figures of a scenario that reports a row of named values per run
    (the suites that were measuring scripts first: ``key: value``), all runs
    pooled: a number, or numbers separated by spaces (one per trial), is a
    figure labelled ``scenario: key`` (its unit is in the key); anything else,
    and a load average, is a note."""
    values: dict[str, list[float]] = {}
    notes: list[str] = []
    for res in results:
        for key, v in res.items():
            numbers = None if key.startswith("load") else _numbers(v)
            if numbers is None:
                notes.append(f"{scenario}: {key}: {v}")
            else:
                values.setdefault(key, []).extend(numbers)
    return [Figure(f"{scenario}: {k}", "", xs) for k, xs in values.items() if xs], notes


def _numbers(v: object) -> list[float] | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int | float):
        return [float(v)]
    try:
        return [float(x) for x in str(v).split()] or None
    except ValueError:
        return None
