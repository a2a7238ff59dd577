"""Frozen ``multilock run`` supervisors: the scenario runner and the tick checker.

`FreezeRun` starts two or three ``multilock run --forever`` supervisors (real processes,
``python -m multilock.cli``, the store's URL in ``MULTILOCK_URL`` so no password shows in
the process list) on one fresh group. Each supervisor's command is `TICK_PROGRAM`: it
appends ``monotonic_time pid token`` to a log of its own (one per supervisor, appended to
by every command that supervisor runs) every 10 to 20 ms, line-buffered; ``time.monotonic``
is one clock for every process of a Linux machine. The faults (`KINDS`), drawn from a
seeded RNG, each hit the current leader, found from the tick logs (the most recent ticker;
its command's pid is in its ticks):

- ``freeze-supervisor``: SIGSTOP of the leading supervisor's pid only, for 1.5..2.5
  leases, then SIGCONT: its command must die by the term's deadline anyway (the watchdog);
- ``freeze-command``: SIGSTOP of the leading command's process group for 0.8..1.2 leases,
  then SIGCONT: the healthy supervisor keeps its term;
- ``freeze-both``: the supervisor and its command's group, as ``freeze-supervisor``;
- ``kill-supervisor``: SIGKILL of the leading supervisor, relaunched once a successor's
  command ticks.

After each fault the run waits, with a deadline, until exactly one command ticks and every
supervisor is alive and not stopped, then judges the tick logs so far (`check_ticks`) and
stops at the first overlap. `check_ticks` reads the commands' own ticks only, not what the
supervisors log: a command's run is its first to its last tick under one token in one log,
and no two runs may overlap, not even by a tie (the ticks' times are taken by the commands
themselves, so the checker trusts no supervisor). It also measures, from the supervisors'
stderr, how late after the term's deadline each frozen supervisor's watchdog sent its
SIGKILL (``multilock: watchdog: the term's deadline passed X ms ago ...``), and from the
ticks the gap between the killed command's last tick and the next command's first.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "CONTROL_KIND",
    "ENDING_KINDS",
    "KINDS",
    "TICK_PROGRAM",
    "WATCHDOG_KINDS",
    "FreezeRun",
    "Outcome",
    "Overlap",
    "Run",
    "Tick",
    "TickReport",
    "check_ticks",
    "format_summaries",
    "markdown_table",
    "parse_ticks",
    "plan",
    "summarize",
    "watchdog_lines",
]

KINDS = ("freeze-supervisor", "freeze-command", "freeze-both", "kill-supervisor")
#: Kinds after which the leader's term must be over (a new token ticks).
ENDING_KINDS = frozenset({"freeze-supervisor", "freeze-both", "kill-supervisor"})
#: Kinds whose command only the watchdog can kill: its supervisor is stopped.
WATCHDOG_KINDS = frozenset({"freeze-supervisor", "freeze-both"})
#: Not a fault of the campaign but its negative control: the leading supervisor AND its
#: watchdog stopped for 3..3.5 leases (what a frozen cgroup holding both would do; the
#: command runs on). The next leader's command starts meanwhile: the checker must see it.
CONTROL_KIND = "freeze-supervisor-and-watchdog"

#: The supervised command: ``python tick.py LOG``. One ``write`` per line (line-buffered,
#: ``O_APPEND``), so a SIGKILL never leaves half a line.
TICK_PROGRAM = '''\
"""Append "monotonic_time pid token" to sys.argv[1] every 10 to 20 ms, until killed."""
import os, random, sys, time
token, pid = int(os.environ["MULTILOCK_TOKEN"]), os.getpid()
with open(sys.argv[1], "a", buffering=1) as log:
    while True:
        log.write("%.6f %d %d\\n" % (time.monotonic(), pid, token))
        time.sleep(random.uniform(0.010, 0.020))
'''

#: A command "ticks" when its last tick is this recent (it ticks every 10 to 20 ms; the
#: margin is for a loaded machine).
RECENT = 0.3
POLL = 0.02
#: Interpreters (and gRPC, kazoo, psycopg) start slowly on a loaded 2-core machine.
STARTUP = 30.0
#: Past a fault's own duration and the failover bound, how long the run may wait for a
#: sole ticking command: liveness is not what this run measures, only a stuck run fails.
SETTLE = 30.0
STOP_TIMEOUT = 10.0

_WATCHDOG = re.compile(
    r"multilock: watchdog: (?P<why>.*?): sent SIGKILL to process group (?P<groups>[\d, ]+)$"
)
_LATE = re.compile(r"passed (?P<ms>[\d.]+) ms ago")


# -- the ticks and the checker -------------------------------------------------------------


@attrs.frozen
class Tick:
    """One line of a command's log: when (monotonic seconds), which process, which term."""

    t: float
    pid: int
    token: int


def parse_ticks(data: bytes) -> tuple[list[Tick], list[bytes], int]:
    """The complete lines of *data*: (ticks, malformed lines, bytes consumed).

    A last line without its newline is left for the next read (its writer may be mid-line).
    """
    end = data.rfind(b"\n") + 1
    ticks, bad = [], []
    for line in data[:end].splitlines():
        fields = line.split()
        try:
            t, pid, token = float(fields[0]), int(fields[1]), int(fields[2])
        except (IndexError, ValueError):
            bad.append(line)
            continue
        if len(fields) != 3:
            bad.append(line)
            continue
        ticks.append(Tick(t, pid, token))
    return ticks, bad, end


@attrs.frozen
class Run:
    """One command's run: its ticks under one token in one log."""

    log: str
    token: int
    pids: tuple[int, ...]
    first: float
    last: float
    ticks: int

    def describe(self) -> str:
        pids = ",".join(map(str, self.pids))
        return (
            f"{self.log} token {self.token} pid {pids}: {self.first:.6f} .. {self.last:.6f} "
            f"({self.last - self.first:.3f} s, {self.ticks} ticks)"
        )


@attrs.frozen
class Overlap:
    """Two runs of different commands that ticked at the same time."""

    earlier: Run
    later: Run

    @property
    def seconds(self) -> float:
        """How long both ran (0 for a tie: equal timestamps count too)."""
        return min(self.earlier.last, self.later.last) - self.later.first

    def describe(self) -> str:
        return (
            f"OVERLAP of {self.seconds * 1000:.1f} ms: {self.earlier.describe()} and "
            f"{self.later.describe()}"
        )


@attrs.frozen
class TickReport:
    """What `check_ticks` found: the runs in order of their first tick, and what is wrong."""

    runs: tuple[Run, ...]
    overlaps: tuple[Overlap, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.overlaps and not self.problems

    def run(self, log: str, token: int) -> Run | None:
        return next((r for r in self.runs if r.log == log and r.token == token), None)

    def next_run(self, run: Run) -> Run | None:
        """The first run of another command that began after *run* began."""
        return next(
            (
                r
                for r in self.runs
                if r.first > run.first and (r.log, r.token) != (run.log, run.token)
            ),
            None,
        )

    def gaps(self) -> list[float]:
        """Seconds from each run's last tick to the next run's first (negative: overlap)."""
        return [b.first - a.last for a, b in itertools.pairwise(self.runs)]

    def describe(self) -> str:
        lines = [run.describe() for run in self.runs]
        lines += [overlap.describe() for overlap in self.overlaps]
        lines += [f"PROBLEM: {problem}" for problem in self.problems]
        return "\n".join(lines)


def check_ticks(
    ticks_by_log: Mapping[str, Iterable[Tick]], malformed: Iterable[str] = ()
) -> TickReport:
    """Judge the commands' own tick logs: no two runs overlap, tokens rise run after run.

    A run is (log, token): one command. Two runs overlap when one's first tick is at or
    before the other's last (a tie counts: the allowance is 0). Tokens must rise strictly
    in the order in which the runs began; a token in two logs, a run with two processes or
    a line that is not a tick is a problem too.
    """
    spans: dict[tuple[str, int], list[Any]] = {}
    for log, ticks in ticks_by_log.items():
        for tick in ticks:
            span = spans.get((log, tick.token))
            if span is None:
                spans[(log, tick.token)] = [tick.t, tick.t, [tick.pid], 1]
                continue
            span[0], span[1], span[3] = min(span[0], tick.t), max(span[1], tick.t), span[3] + 1
            if tick.pid not in span[2]:
                span[2].append(tick.pid)
    runs = sorted(
        (
            Run(log, token, tuple(pids), first, last, count)
            for (log, token), (first, last, pids, count) in spans.items()
        ),
        key=lambda r: (r.first, r.last, r.log),
    )
    overlaps = [
        Overlap(earlier, later)
        for i, later in enumerate(runs)
        for earlier in runs[:i]
        if later.first <= earlier.last
    ]
    problems = [f"not a tick: {line!r}" for line in malformed]
    problems += [
        f"{run.log} token {run.token}: {len(run.pids)} processes ({run.pids})"
        for run in runs
        if len(run.pids) > 1
    ]
    logs_of: dict[int, set[str]] = {}
    for run in runs:
        logs_of.setdefault(run.token, set()).add(run.log)
    problems += [
        f"token {token} ran in {sorted(logs)}" for token, logs in logs_of.items() if len(logs) > 1
    ]
    problems += [
        f"token {b.token} ({b.log}) began after token {a.token} ({a.log}): tokens must rise"
        for a, b in itertools.pairwise(runs)
        if b.token <= a.token
    ]
    return TickReport(tuple(runs), tuple(overlaps), tuple(problems))


def watchdog_lines(text: str) -> list[tuple[str, tuple[int, ...], float | None]]:
    """The watchdog's kills in *text* (a supervisor's stderr): (why, groups, ms late or None)."""
    found = []
    for line in text.splitlines():
        match = _WATCHDOG.search(line)
        if match is None:
            continue
        why = match["why"]
        groups = tuple(int(g) for g in match["groups"].replace(",", " ").split())
        late = _LATE.search(why)
        found.append((why, groups, float(late["ms"]) if late else None))
    return found


# -- the processes -------------------------------------------------------------------------


def _state(pid: int) -> str | None:
    """The process's state letter (``T``: stopped, ``Z``: a zombie), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]


def _signal_group(group: int, signum: int) -> bool:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signum)
        return True
    return False


class _TickLog:
    """A command log, read incrementally (each poll reads only what was appended)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ticks: list[Tick] = []
        self.malformed: list[str] = []
        self._offset = 0

    def poll(self) -> None:
        try:
            with self.path.open("rb") as log:
                log.seek(self._offset)
                data = log.read()
        except FileNotFoundError:
            return
        ticks, bad, used = parse_ticks(data)
        self._offset += used
        self.ticks += ticks
        self.malformed += [f"{self.path.name}: {line!r}" for line in bad]

    @property
    def last(self) -> Tick | None:
        return self.ticks[-1] if self.ticks else None


class _Slot:
    """One supervisor, ``r1``, ``r2``...: its process (relaunched in place), logs, state."""

    def __init__(self, name: str, workdir: Path) -> None:
        self.name = name
        self.log = _TickLog(workdir / f"{name}.ticks")
        self.err = workdir / f"{name}.err"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def stopped(self) -> bool:
        return self.alive and _state(self.pid) in ("T", "t")

    def err_size(self) -> int:
        try:
            return self.err.stat().st_size
        except FileNotFoundError:
            return 0

    def err_since(self, offset: int) -> str:
        try:
            with self.err.open("rb") as err:
                err.seek(offset)
                return err.read().decode(errors="replace")
        except FileNotFoundError:
            return ""


@attrs.frozen
class Outcome:
    """One fault and what followed it (times in seconds unless named otherwise)."""

    kind: str
    #: The leader hit: its slot, token and command pid.
    slot: str
    token: int
    pid: int
    #: How long the freeze lasted (0 for a kill).
    hold: float
    #: The command ticking once the run settled, and whether it is the same term.
    new_slot: str
    new_token: int
    kept: bool
    #: The frozen supervisor's watchdog: why it killed, and how late after the deadline (ms).
    watchdog_why: str | None
    watchdog_ms: float | None
    #: The hit command's last tick came before its supervisor was thawed (or relaunched).
    died_before_thaw: bool | None
    #: From the hit command's last tick to the next command's first (None when kept).
    gap: float | None
    #: From the fault to the next command's first tick (None when kept).
    to_next: float | None
    #: Watchdog kills logged meanwhile by supervisors that were not hit.
    other_watchdog: tuple[str, ...] = ()
    #: Leaders found dead or ending before the fault could hit them (picked again).
    repicked: int = 0


def plan(count: int | None, rng: random.Random, others: int | None = None) -> list[str]:
    """The faults in a seeded random order.

    *count* None: each kind once. Otherwise *count* ``freeze-supervisor`` and *others* (a
    tenth of *count*, at least 1, by default) of each other kind.
    """
    if count is None:
        return rng.sample(list(KINDS), len(KINDS))
    extra = max(1, count // 10) if others is None else others
    kinds = ["freeze-supervisor"] * count + [k for k in KINDS[1:] for _ in range(extra)]
    rng.shuffle(kinds)
    return kinds


class FreezeRun:
    """*size* ``multilock run --forever`` supervisors on a fresh group of the store at *url*.

    ``with FreezeRun(...) as run: run.run(plan(...))``; `report` judges the tick logs.
    *stop* (set by another thread) makes every wait give up.
    """

    def __init__(
        self,
        name: str,
        url: str,
        lease: float,
        workdir: Path,
        rng: random.Random,
        *,
        size: int = 3,
        stop: threading.Event | None = None,
    ) -> None:
        if not 2 <= size <= 9:
            raise ValueError("size must be 2..9")
        self.name, self.url, self.lease, self.rng = name, url, lease, rng
        self.workdir = workdir
        self.group = f"freezes-{uuid.uuid4().hex[:12]}"
        self.slots = [_Slot(f"r{i}", workdir) for i in range(1, size + 1)]
        self.tick_program = workdir / "tick.py"
        self.stop = stop or threading.Event()
        #: A crashed leader's successor ticks within this long (the store's expiry, one
        #: campaign retry, a second for the interpreters).
        self.failover = lease + min(2.0, lease) + 1.0
        self.outcomes: list[Outcome] = []
        self.started = self.finished = 0.0

    # -- life cycle ----------------------------------------------------------------------------

    def __enter__(self) -> FreezeRun:
        self.tick_program.write_text(TICK_PROGRAM)
        try:
            for slot in self.slots:
                self._launch(slot)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _launch(self, slot: _Slot) -> None:
        command = [
            sys.executable, "-m", "multilock.cli", "run", "-v", "--forever",
            "--lease", f"{self.lease:g}", "--group", self.group, "--id", slot.name,
            "--", sys.executable, "-I", "-S", str(self.tick_program), str(slot.log.path),
        ]  # fmt: skip
        env = {**os.environ, "MULTILOCK_URL": self.url}
        with slot.err.open("ab") as err:
            slot.proc = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err
            )

    def close(self) -> None:
        """Thaw and stop every supervisor (SIGTERM, then SIGKILL), then any command left."""
        for slot in self.slots:
            if slot.alive:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
                    slot.proc.terminate()  # type: ignore[union-attr]
        for slot in self.slots:
            if slot.proc is None:
                continue
            try:
                slot.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                slot.proc.kill()
                slot.proc.wait()
        # The watchdogs and PR_SET_PDEATHSIG kill the commands; a stopped one is woken.
        for pid in {tick.pid for slot in self.slots for tick in slot.log.ticks[-50:]}:
            if self._is_command(pid):
                _signal_group(pid, signal.SIGKILL)
                _signal_group(pid, signal.SIGCONT)

    def _is_command(self, pid: int) -> bool:
        """*pid* is a live (not zombie) command of this run: it runs our tick program."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        return str(self.tick_program).encode() in cmdline and _state(pid) not in (None, "Z")

    @staticmethod
    def _watchdogs(pid: int) -> list[int]:
        """The watchdog processes among *pid*'s children (their program names itself)."""
        children: list[str] = []
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                children += (task / "children").read_text().split()
        found = []
        for child in map(int, children):
            with contextlib.suppress(OSError):
                if b"multilock: watchdog" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.append(child)
        return found

    # -- observation ---------------------------------------------------------------------------

    def ticks(self) -> dict[str, list[Tick]]:
        for slot in self.slots:
            slot.log.poll()
        return {slot.name: slot.log.ticks for slot in self.slots}

    def report(self) -> TickReport:
        """Judge every tick logged so far."""
        ticks = self.ticks()
        return check_ticks(ticks, [m for slot in self.slots for m in slot.log.malformed])

    def tail(self, lines: int = 12) -> str:
        """The end of each supervisor's stderr and tick log, for a failure message."""
        parts = []
        for slot in self.slots:
            err = slot.err_since(max(0, slot.err_size() - 4000)).splitlines()[-lines:]
            ticks = [f"{t.t:.6f} {t.pid} {t.token}" for t in slot.log.ticks[-3:]]
            state = "dead" if not slot.alive else "stopped" if slot.stopped else "running"
            parts.append(f"--- {slot.name} ({state}), last ticks: {ticks}\n" + "\n".join(err))
        return "\n".join(parts)

    def _sole_ticker(
        self,
        what: str,
        timeout: float,
        accept: Callable[[Tick], bool] = lambda tick: True,
        dead_ok: _Slot | None = None,
    ) -> tuple[_Slot, Tick]:
        """Wait until exactly one command ticks, *accept* takes its tick, and every
        supervisor (but *dead_ok*) is alive and not stopped."""
        deadline = time.monotonic() + timeout
        while True:
            self.ticks()
            now = time.monotonic()
            for slot in self.slots:
                if slot is not dead_ok and not slot.alive:
                    raise AssertionError(
                        f"{self.name}: supervisor {slot.name} exited with "
                        f"{slot.proc.returncode if slot.proc else None}\n{self.tail()}"
                    )
            ticking = [
                (slot, last)
                for slot in self.slots
                if (last := slot.log.last) is not None and last.t >= now - RECENT
            ]
            settled = all(slot is dead_ok or not slot.stopped for slot in self.slots)
            if settled and len(ticking) == 1 and accept(ticking[0][1]):
                return ticking[0]
            if now >= deadline or self.stop.is_set():
                raise AssertionError(
                    f"{self.name}: no {what} within {timeout:.1f} s (ticking: "
                    f"{[s.name for s, _ in ticking]})\n{self.tail()}"
                )
            time.sleep(POLL)

    def _wait_campaigning(self, slot: _Slot, offset: int) -> None:
        deadline = time.monotonic() + STARTUP
        while "campaigning for" not in slot.err_since(offset):
            if not slot.alive:
                raise AssertionError(f"{self.name}: relaunched {slot.name} exited\n{self.tail()}")
            if time.monotonic() >= deadline or self.stop.is_set():
                raise AssertionError(f"{self.name}: relaunched {slot.name} is not campaigning")
            time.sleep(POLL)

    # -- the faults ----------------------------------------------------------------------------

    def run(self, kinds: Sequence[str]) -> None:
        """Throw *kinds* one after the other; stop at the first overlap or failed wait."""
        self._sole_ticker("first command", STARTUP)
        self.started = time.monotonic()
        try:
            for number, kind in enumerate(kinds, 1):
                try:
                    outcome = self._throw(kind)
                except AssertionError as exc:
                    report = self.report()
                    raise AssertionError(
                        f"{self.name}: fault {number} of {len(kinds)} ({kind}): {exc}\n"
                        f"tick report so far:\n{report.describe()}"
                    ) from None
                self.outcomes.append(outcome)
                report = self.report()
                if not report.ok:
                    raise AssertionError(
                        f"{self.name}: after fault {number} ({outcome}), the tick logs show:\n"
                        f"{report.describe()}\n{self.tail(40)}"
                    )
        finally:
            self.finished = time.monotonic()

    def _pick_leader(self) -> tuple[_Slot, Tick, int]:
        """The leader and its command's last tick; a random pause first, so that faults
        land anywhere in the renew cycle. A leader whose command is already gone (its term
        just ended) is picked again."""
        repicked = 0
        while True:
            time.sleep(self.rng.uniform(0.1, 0.5) * self.lease)  # the pace, not a wait
            slot, tick = self._sole_ticker("sole ticking command", self.failover + SETTLE)
            if self._is_command(tick.pid):
                return slot, tick, repicked
            repicked += 1
            if repicked > 20:
                raise AssertionError(f"{self.name}: the leader's command keeps dying on its own")

    def _throw(self, kind: str) -> Outcome:
        slot, tick, repicked = self._pick_leader()
        offsets = {s.name: s.err_size() for s in self.slots}
        since = time.monotonic()
        hold = 0.0
        if kind == "kill-supervisor":
            assert slot.proc is not None
            slot.proc.kill()
            slot.proc.wait()
            self._sole_ticker(
                "successor's command",
                self.failover + SETTLE,
                lambda t: t.token > tick.token,
                dead_ok=slot,
            )
            thawed = time.monotonic()
            offset = slot.err_size()
            self._launch(slot)
            self._wait_campaigning(slot, offset)
        else:
            low, high = {"freeze-command": (0.8, 1.2), CONTROL_KIND: (3.0, 3.5)}.get(
                kind, (1.5, 2.5)
            )
            hold = self.lease * self.rng.uniform(low, high)
            pids = [slot.pid] if kind in WATCHDOG_KINDS | {CONTROL_KIND} else []
            if kind == CONTROL_KIND:
                pids += self._watchdogs(slot.pid)
                assert len(pids) == 2, f"{slot.name}: no watchdog process found"
            groups = [tick.pid] if kind in ("freeze-command", "freeze-both") else []
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            for group in groups:
                _signal_group(group, signal.SIGSTOP)
            time.sleep(max(0.0, since + hold - time.monotonic()))  # the fault's own length
            # The command first: were it still alive, it would tick before its supervisor
            # could kill it, and the checker would see that.
            for group in groups:
                _signal_group(group, signal.SIGCONT)  # ESRCH once the watchdog killed it
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            thawed = time.monotonic()
        ends = kind in ENDING_KINDS | {CONTROL_KIND}
        timeout = self.failover + SETTLE
        new_slot, new_tick = self._sole_ticker(
            "sole ticking command after the fault",
            timeout,
            (lambda t: t.token > tick.token) if ends else (lambda t: True),
        )
        report = self.report()
        hit = report.run(slot.name, tick.token)
        assert hit is not None
        kept = (new_slot.name, new_tick.token) == (slot.name, tick.token)
        after = None if kept else report.next_run(hit)
        gap = None if after is None else after.first - hit.last
        to_next = None if after is None else after.first - since

        # The hit supervisor's watchdog: a kill of the command's group, at the deadline
        # (frozen) or when the pipe closed (killed); its stderr is the supervisor's.
        mine = [m for m in watchdog_lines(slot.err_since(offsets[slot.name])) if tick.pid in m[1]]
        killed = [m for m in mine if m[2] is not None]
        others = tuple(
            why
            for other in self.slots
            if other is not slot
            for why, _, _ in watchdog_lines(other.err_since(offsets[other.name]))
        )
        died_before_thaw = None
        if kind in WATCHDOG_KINDS:
            died_before_thaw = hit.last < thawed
            assert not kept, f"the frozen supervisor's term {tick.token} went on\n{self.tail()}"
            assert died_before_thaw, (
                f"command {tick.pid} (token {tick.token}) ticked at {hit.last:.6f}, after its "
                f"supervisor {slot.name} was thawed at {thawed:.6f}: the watchdog did not kill "
                f"it\n{self.tail()}"
            )
            assert len(killed) == 1, (
                f"expected one watchdog kill of group {tick.pid} at the deadline in "
                f"{slot.name}'s stderr, got {mine}\n{self.tail()}"
            )
        elif kind == "kill-supervisor":
            died_before_thaw = hit.last < thawed
        return Outcome(
            kind=kind,
            slot=slot.name,
            token=tick.token,
            pid=tick.pid,
            hold=round(hold, 3),
            new_slot=new_slot.name,
            new_token=new_tick.token,
            kept=kept,
            watchdog_why=mine[0][0] if mine else None,
            watchdog_ms=killed[0][2] if killed else None,
            died_before_thaw=died_before_thaw,
            gap=None if gap is None else round(gap, 6),
            to_next=None if to_next is None else round(to_next, 3),
            other_watchdog=others,
            repicked=repicked,
        )


# -- the summary ---------------------------------------------------------------------------


def _stats(values: Sequence[float], digits: int = 3) -> dict[str, float | int | None]:
    return {
        "count": len(values),
        "min": round(min(values), digits) if values else None,
        "p50": round(statistics.median(values), digits) if values else None,
        "max": round(max(values), digits) if values else None,
    }


def summarize(run: FreezeRun, report: TickReport, seed: str) -> dict[str, Any]:
    """What *run* did and measured; *report* judged its tick logs."""
    outcomes = run.outcomes
    by_kind = Counter(o.kind for o in outcomes)
    frozen = [o for o in outcomes if o.kind in WATCHDOG_KINDS]
    return {
        "backend": run.name,
        "lease": run.lease,
        "seed": seed,
        "supervisors": len(run.slots),
        "faults": len(outcomes),
        "by_kind": {kind: by_kind[kind] for kind in KINDS if by_kind[kind]},
        "overlaps": len(report.overlaps),
        "problems": list(report.problems),
        "runs": len(report.runs),
        "kill_after_deadline_ms": _stats(
            [o.watchdog_ms for o in frozen if o.watchdog_ms is not None], 1
        ),
        "takeover_gap_s": _stats([o.gap for o in frozen if o.gap is not None]),
        "kill_supervisor_gap_s": _stats(
            [o.gap for o in outcomes if o.kind == "kill-supervisor" and o.gap is not None]
        ),
        "least_gap_s": round(min(report.gaps(), default=0.0), 6),
        "died_before_thaw": sum(bool(o.died_before_thaw) for o in frozen),
        "freeze_command_kept": sum(o.kept for o in outcomes if o.kind == "freeze-command"),
        "other_watchdog_kills": sum(len(o.other_watchdog) for o in outcomes),
        "repicked": sum(o.repicked for o in outcomes),
        "seconds": round(run.finished - run.started, 1),
        "outcomes": [attrs.asdict(o) for o in outcomes],
    }


def _span(stats: Mapping[str, Any], unit: str, digits: int, low: bool = False) -> str:
    """``p50 / max unit``, or ``min / p50 / max unit`` with *low*."""
    if not stats["count"]:
        return "n/a"
    values = (["min"] if low else []) + ["p50", "max"]
    return " / ".join(f"{stats[v]:.{digits}f}" for v in values) + f" {unit}"


def markdown_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """One row per backend, for FAULTS.md."""
    lines = [
        "| backend | lease | faults by kind | overlaps | kill after the deadline, p50 / max "
        "| takeover gap, min / p50 / max | least gap between runs | run time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        if "error" in s and not s.get("faults"):
            lines.append(f"| {s['backend']} | | failed: {s['error'].splitlines()[0]} | | | | | |")
            continue
        kinds = ", ".join(f"{k} {n}" for k, n in s["by_kind"].items())
        lines.append(
            f"| {s['backend']} | {s['lease']:g} s | {kinds} | {s['overlaps']} | "
            f"{_span(s['kill_after_deadline_ms'], 'ms', 1)} | "
            f"{_span(s['takeover_gap_s'], 's', 3, low=True)} | {s['least_gap_s']:.3f} s | "
            f"{s['seconds']:.0f} s |"
        )
    return "\n".join(lines)


def format_summaries(summaries: Sequence[Mapping[str, Any]]) -> str:
    """The summary printed at the end of the test module."""
    lines = ["", "multilock run, frozen supervisors: faults per backend"]
    for s in summaries:
        frozen = sum(n for k, n in s.get("by_kind", {}).items() if k in WATCHDOG_KINDS)
        if "error" in s and not s.get("faults"):
            lines.append(f"  {s['backend']}: FAILED: {s['error'].splitlines()[0]}")
            continue
        kinds = ", ".join(f"{k} {n}" for k, n in s["by_kind"].items())
        verdict = "no overlap" if not s["overlaps"] and not s["problems"] else "UNSAFE"
        lines += [
            f"  {s['backend']} (lease {s['lease']:g} s, {s['supervisors']} supervisors, seed "
            f"{s['seed']}): {s['faults']} faults in {s['seconds']} s, {s['runs']} runs, {verdict}",
            f"    by kind: {kinds}",
            f"    watchdog SIGKILL after the deadline: "
            f"{_span(s['kill_after_deadline_ms'], 'ms', 1)} (p50 / max); killed before the "
            f"thaw: {s['died_before_thaw']} of {frozen}",
            f"    killed command's last tick to the next command's first (min / p50 / max): "
            f"{_span(s['takeover_gap_s'], 's', 3, low=True)}; after kill-supervisor "
            f"{_span(s['kill_supervisor_gap_s'], 's', 3, low=True)}; least gap of the run "
            f"{s['least_gap_s']:.3f} s",
            f"    freeze-command kept the term {s['freeze_command_kept']} times; watchdog kills "
            f"by supervisors not hit: {s['other_watchdog_kills']}; leaders picked again: "
            f"{s['repicked']}",
        ]
        if "error" in s:
            lines.append(f"    FAILED: {s['error'].splitlines()[0]}")
    return "\n".join(lines)
