"""The semaphore and shards campaign: faults thrown at real holder processes, and the checker.

`HoldersRun` starts four member processes (`holder_member.py`) on one fresh name of a
backend, each reaching the store through a `TcpProxy` of its own, in one of two scenarios
(`SCENARIOS`):

- ``semaphore``: each member loops on a ``Semaphore`` of limit 2: wait, hold a slot 1.5 to
  3.5 leases, release, pause;
- ``shards``: each member is a ``Shards`` participant over 12 shards.

Every member logs each hold (a slot, or a shard) as JSON lines on ``time.monotonic()``, one
clock for every process of the machine: ``begin`` when it knows it holds, ``renew`` with
each new local deadline, ``end`` with ``valid_until`` (see holder_member.py). The faults
(`KINDS`), drawn from a seeded RNG, each hit a random current holder:

- ``kill``: SIGKILL, relaunched once its slot or every shard it held has a newer term;
- ``stop``: SIGSTOP for 1.1 to 1.6 leases, then SIGCONT;
- ``cut-drop``, ``cut-blackhole``: its proxies reset every connection, or black-hole both
  directions, for 1.1 to 1.6 leases and at least until its units are taken over; then healed.

After each fault the run requires (liveness, each wait with a deadline): the victim's units
taken over by newer terms, and then every unit held (both slots in use, all 12 shards
owned), within `HoldersRun.takeover_bound` of the fault; each of the victim's holds ended
no later than a lease after the fault (its local deadline), and for a cut member, logged
within `STEP_DOWN_LAG` of that end; then the run whole again within `REJOIN` (every member
running; all slots in use, or all shards owned with every member owning some). It
then judges every log so far (`check_holds`) and stops at the first violation. At the
quiet end of a shards run, every member must own at most ``ceil(12 / live)`` shards within
`HoldersRun.balance_bound`, and keep to it for a lease.

`check_holds` (the checker) builds the holds from the records: a hold runs from its
``begin`` to ``min(t, valid_until)`` of its ``end``; a hold without an ``end`` (its process
was SIGKILLed, or is still running) runs to its last logged deadline. It reports two
holds of one unit (slot or shard) that overlap, not even by a tie; tokens that do not rise
strictly per unit in the order the holds began, or a token held twice; for a semaphore,
more than *limit* holds at any instant and a member holding two slots at once; and any
line that is not a record.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import random
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

from .backends import Backend
from .campaign import plan, proxied_urls
from .faults import failover_bound
from .proxy import TcpProxy

__all__ = [
    "CONTROL_KIND",
    "KINDS",
    "MEMBER_PROGRAM",
    "SCENARIOS",
    "Hold",
    "HoldLog",
    "HoldReport",
    "HoldersRun",
    "Outcome",
    "Scenario",
    "check_holds",
    "format_summaries",
    "markdown_table",
    "plan",
    "summarize",
]

KINDS = ("kill", "stop", "cut-drop", "cut-blackhole")
#: Not a fault of the campaign but its negative control: a holder SIGSTOPped for 3 to 3.5
#: leases, run with members that ignore the loss of their slot (``--ignore-loss``).
CONTROL_KIND = "stop-long"
MEMBER_PROGRAM = Path(__file__).with_name("holder_member.py")
URL_VAR = "MULTILOCK_HOLDERS_URL"


@attrs.frozen
class Scenario:
    """*members* processes; *size* is the semaphore's limit or the number of shards."""

    name: str
    members: int
    size: int


SCENARIOS = {
    "semaphore": Scenario("semaphore", members=4, size=2),
    "shards": Scenario("shards", members=4, size=12),
}

#: A cut member logs the end of each hold within this long of its ``valid_until`` (the
#: election ends the term on time whatever the store does; generous for a loaded machine).
STEP_DOWN_LAG = 1.0
#: Four interpreters importing the library (and gRPC, kazoo, psycopg) on a loaded machine.
STARTUP = 30.0
#: Past its bound, how long a wait goes on before the run gives up: a late takeover is
#: recorded (and fails the test); only a stuck run stops it.
SETTLE = 30.0
#: How long a healed, thawed or relaunched member may take to be back (owning shards again):
#: not a bound of the library's, only a stuck run fails it. A black-holed etcd member took
#: up to 58 s (see FAULTS.md), so this is generous.
REJOIN = 120.0
STOP_TIMEOUT = 10.0
POLL = 0.02
#: A victim slot holder still plans to hold this many leases: the fault, not its own
#: release, ends its hold.
MARGIN = 1.0
SLACK = 1.0


# -- the holds and the checker -------------------------------------------------------------


@attrs.frozen
class Hold:
    """One hold of a unit (a slot or a shard) by one process, on the shared monotonic clock."""

    member: str
    pid: int
    unit: int
    token: int
    start: float
    #: ``min(t, valid_until)`` of its ``end``, or its last logged deadline without one.
    end: float
    #: The ``end`` record's reason (``release``, ``lost``, ``released``, ``stopping``,
    #: ``ignored-loss``), or ``deadline`` when it has no ``end`` (killed, or still open).
    ended_by: str
    #: The last deadline logged (``begin`` or ``renew``).
    deadline: float
    #: When the ``end`` was logged, and its ``valid_until`` (None without an ``end``).
    logged_end: float | None = None
    valid_until: float | None = None
    #: A slot holder's planned release (None for a shard).
    hold_until: float | None = None

    @property
    def closed(self) -> bool:
        return self.logged_end is not None

    @property
    def empty(self) -> bool:
        """Its term had ended before the holder knew it held: it never held validly."""
        return self.end <= self.start

    def describe(self) -> str:
        return (
            f"{self.member} (pid {self.pid}) unit {self.unit} token {self.token}: "
            f"{self.start:.6f} .. {self.end:.6f} ({self.end - self.start:.3f} s, "
            f"{self.ended_by})"
        )


class _Open:
    __slots__ = ("deadline", "hold_until", "start")

    def __init__(self, start: float, deadline: float, hold_until: float | None) -> None:
        self.start, self.deadline, self.hold_until = start, deadline, hold_until


class HoldLog:
    """The holds of many members' records, built incrementally (records in each member's
    log order; members may interleave)."""

    def __init__(self) -> None:
        self.closed: list[Hold] = []
        self.open: dict[tuple[str, int, int, int], _Open] = {}
        self.problems: list[str] = []
        self.records = 0
        self.events: Counter[str] = Counter()

    def feed(self, record: Mapping[str, Any]) -> None:
        self.records += 1
        try:
            event, t = str(record["event"]), float(record["t"])
            who, pid = str(record["member"]), int(record["pid"])
        except (KeyError, TypeError, ValueError):
            self.problems.append(f"not a record: {dict(record)!r}")
            return
        self.events[event] += 1
        if event not in ("begin", "renew", "end"):
            return
        try:
            key = (who, pid, int(record["unit"]), int(record["token"]))
            if event == "begin":
                if key in self.open:
                    self.problems.append(f"{key}: begun twice")
                hold_until = record.get("hold_until")
                self.open[key] = _Open(
                    t,
                    float(record["deadline"]),
                    None if hold_until is None else float(hold_until),
                )
                return
            current = self.open.get(key)
            if current is None:
                self.problems.append(f"{event} of a hold never begun: {dict(record)!r}")
                return
            if event == "renew":
                current.deadline = max(current.deadline, float(record["deadline"]))
                return
            del self.open[key]
            valid_until = float(record["valid_until"])
            self.closed.append(
                Hold(
                    member=who,
                    pid=pid,
                    unit=key[2],
                    token=key[3],
                    start=current.start,
                    end=min(t, valid_until),
                    ended_by=str(record.get("reason", "end")),
                    deadline=current.deadline,
                    logged_end=t,
                    valid_until=valid_until,
                    hold_until=current.hold_until,
                )
            )
        except (KeyError, TypeError, ValueError):
            self.problems.append(f"malformed {event}: {dict(record)!r}")

    def feed_all(self, records: Iterable[Mapping[str, Any]]) -> HoldLog:
        for record in records:
            self.feed(record)
        return self

    def open_holds(self) -> list[Hold]:
        """The holds without an ``end`` yet, each ending at its last logged deadline."""
        return [
            Hold(
                member=who,
                pid=pid,
                unit=unit,
                token=token,
                start=o.start,
                end=o.deadline,
                ended_by="deadline",
                deadline=o.deadline,
                hold_until=o.hold_until,
            )
            for (who, pid, unit, token), o in self.open.items()
        ]

    def holds(self) -> list[Hold]:
        return [*self.closed, *self.open_holds()]


def parse_lines(data: bytes) -> tuple[list[dict[str, Any]], list[bytes], int]:
    """The complete lines of *data*: (records, lines that are not records, bytes used).

    A last line without its newline is left for the next read (its writer may be mid-line).
    """
    end = data.rfind(b"\n") + 1
    records, bad = [], []
    for line in data[:end].splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad.append(line)
            continue
        if isinstance(record, dict) and "t" in record:
            records.append(record)
        else:
            bad.append(line)
    return records, bad, end


@attrs.frozen
class HoldReport:
    """What `check_holds` found."""

    holds: tuple[Hold, ...]
    #: Two holds of one unit that overlap (the later one began at or before the other ended).
    overlaps: tuple[tuple[Hold, Hold], ...]
    #: Instants with more holds than the semaphore's limit: (when, the holds open then).
    excess: tuple[tuple[float, tuple[Hold, ...]], ...]
    problems: tuple[str, ...]
    #: Per unit, from each hold's end to the next hold's start (negative: an overlap).
    gaps: tuple[float, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.overlaps and not self.excess and not self.problems

    @property
    def violations(self) -> int:
        return len(self.overlaps) + len(self.excess) + len(self.problems)

    def describe(self, limit: int = 20) -> str:
        lines = []
        for a, b in self.overlaps[:limit]:
            lines.append(
                f"OVERLAP of {(min(a.end, b.end) - b.start) * 1000:.1f} ms on unit {a.unit}:\n"
                f"  {a.describe()}\n  {b.describe()}"
            )
        for when, holds in self.excess[:limit]:
            lines.append(
                f"MORE THAN THE LIMIT at {when:.6f}: {len(holds)} holds\n"
                + "\n".join(f"  {h.describe()}" for h in holds)
            )
        lines += [f"PROBLEM: {p}" for p in self.problems[:limit]]
        more = self.violations - min(len(self.overlaps), limit) - min(len(self.excess), limit)
        more -= min(len(self.problems), limit)
        if more > 0:
            lines.append(f"... and {more} more")
        return "\n".join(lines) if lines else f"{len(self.holds)} holds, no violation"


def check_holds(
    holds: Iterable[Hold],
    scenario: str,
    size: int,
    problems: Iterable[str] = (),
) -> HoldReport:
    """Judge *holds* of *scenario* (``semaphore`` of limit *size*, or *size* ``shards``).

    An empty hold (its term ended before its holder knew it held) is not judged: its
    holder never held validly.
    """
    everything = sorted(holds, key=lambda h: (h.start, h.end, h.member, h.pid))
    found = list(problems)
    found += [f"unit out of range: {h.describe()}" for h in everything if not 0 <= h.unit < size]
    judged = [h for h in everything if not h.empty]

    by_unit: dict[int, list[Hold]] = {}
    for hold in judged:
        by_unit.setdefault(hold.unit, []).append(hold)
    overlaps: list[tuple[Hold, Hold]] = []
    gaps: list[float] = []
    for unit_holds in by_unit.values():
        overlaps += _overlapping(unit_holds, same_owner_too=True)
        gaps += [b.start - a.end for a, b in itertools.pairwise(unit_holds)]
        found += [
            f"unit {b.unit}: token {b.token} ({b.member}) began after token {a.token} "
            f"({a.member}): tokens must rise"
            for a, b in itertools.pairwise(unit_holds)
            if b.token <= a.token
        ]
    excess: list[tuple[float, tuple[Hold, ...]]] = []
    if scenario == "semaphore":
        excess = _excess(judged, size)
        by_pid: dict[tuple[str, int], list[Hold]] = {}
        for hold in judged:
            by_pid.setdefault((hold.member, hold.pid), []).append(hold)
        for (member, pid), mine in by_pid.items():
            found += [
                f"{member} (pid {pid}) held two slots at once: {a.describe()} / {b.describe()}"
                for a, b in _overlapping(mine, same_owner_too=True)
            ]
    return HoldReport(tuple(everything), tuple(overlaps), tuple(excess), tuple(found), tuple(gaps))


def _overlapping(holds: Sequence[Hold], *, same_owner_too: bool) -> list[tuple[Hold, Hold]]:
    """Pairs of *holds* (sorted by start) where the later began at or before the earlier
    ended: every pair, not only neighbours (a long hold may outlive several later ones)."""
    pairs = []
    active: list[Hold] = []
    for hold in holds:
        active = [a for a in active if a.end >= hold.start]
        pairs += [(a, hold) for a in active if same_owner_too or a.member != hold.member]
        active.append(hold)
    return pairs


def _excess(holds: Sequence[Hold], limit: int) -> list[tuple[float, tuple[Hold, ...]]]:
    """Each instant at which a hold begins while *limit* others are open (ties count)."""
    found = []
    active: list[Hold] = []
    for hold in holds:  # sorted by start: the count only rises at a start
        active = [a for a in active if a.end >= hold.start]
        active.append(hold)
        if len(active) > limit:
            found.append((hold.start, tuple(active)))
    return found


# -- the processes -------------------------------------------------------------------------


class _Member:
    """One member, ``m0``, ``m1``...: its process (relaunched in place), proxies, log."""

    def __init__(self, name: str, workdir: Path, url: str, proxies: list[TcpProxy]) -> None:
        self.name, self.url, self.proxies = name, url, proxies
        self.log = workdir / f"{name}.jsonl"
        self.err = workdir / f"{name}.err"
        self.proc: subprocess.Popen[bytes] | None = None
        self.frozen = False
        self.offset = 0
        self.started: dict[int, float] = {}

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def running(self) -> bool:
        """Alive, not stopped, and its current process logged ``started``."""
        return self.alive and not self.frozen and self.pid in self.started

    def err_tail(self, chars: int = 1500) -> str:
        try:
            return self.err.read_bytes()[-chars:].decode(errors="replace")
        except FileNotFoundError:
            return ""


@attrs.frozen
class Outcome:
    """One fault and what followed it (seconds from the fault unless named otherwise)."""

    kind: str
    #: When the fault hit (monotonic seconds: the logs' clock).
    at: float
    victim: str
    pid: int
    #: The victim's holds at the fault: (unit, token).
    units: tuple[tuple[int, int], ...]
    #: How long the freeze or the cut lasted (0 for a kill).
    hold: float
    #: When the last of the victim's units had a newer term (its takeover).
    takeover: float
    #: From then on, when every unit was held again (all shards owned, all slots in use).
    covered: float
    #: The takeover came after `HoldersRun.takeover_bound`.
    late: bool
    #: When the run was whole again.
    whole: float
    #: The latest end of the victim's holds, after the fault (at most a lease).
    victim_end: float
    #: For a cut victim: the most its ``end`` lines came after their ``valid_until``.
    step_down_lag: float | None = None
    #: Victims picked while no member could be hit (waits for a fit holder), in seconds.
    waited: float = 0.0


class HoldersRun:
    """The *scenario* on *backend*: ``with HoldersRun(...) as run: run.run(plan(...))``.

    *stop* (set by another thread) makes every wait give up. *ignore_loss* starts the
    members with ``--ignore-loss`` (the negative control).
    """

    def __init__(
        self,
        backend: Backend,
        scenario: str,
        workdir: Path,
        rng: random.Random,
        *,
        stop: threading.Event | None = None,
        ignore_loss: bool = False,
    ) -> None:
        self.backend, self.spec, self.workdir, self.rng = backend, SCENARIOS[scenario], workdir, rng
        self.lease = backend.lease
        self.retry = min(2.0, self.lease)  # the election's default retry_interval
        self.name = f"holders-{uuid.uuid4().hex[:12]}"
        self.stop = stop or threading.Event()
        self.ignore_loss = ignore_loss
        self.holds = HoldLog()
        self.malformed: list[str] = []
        self.members: list[_Member] = []
        self.kills: list[tuple[str, int, float]] = []
        self.outcomes: list[Outcome] = []
        self.late: list[str] = []
        self.balance: dict[str, Any] = {}
        self.started = self.finished = 0.0
        self._stack = contextlib.ExitStack()

    @property
    def scenario(self) -> str:
        return self.spec.name

    @property
    def failover(self) -> float:
        """A dead holder's unit has a new term within this long (as the fault campaign)."""
        return failover_bound(self.backend)

    def takeover_bound(self, kind: str) -> float:
        """The victim's units have newer terms within this long of a fault of *kind*.

        A shard waits for the members' count (one more retry interval) before the others
        campaign for it; a cut member's store calls may hang a while longer (one lease
        more, as the fault campaign allows).
        """
        bound = self.failover
        if self.scenario == "shards":
            bound += self.retry
        if kind.startswith("cut"):
            bound += self.lease
        return bound

    @property
    def balance_bound(self) -> float:
        """From a stable membership to a balanced one (two leases, two counts, slack)."""
        return 2 * self.lease + 2 * self.retry + SLACK

    # -- life cycle ----------------------------------------------------------------------------

    def __enter__(self) -> HoldersRun:
        try:
            proxies, urls = proxied_urls(self.backend, self.spec.members, self._stack)
            self.members = [
                _Member(f"m{i}", self.workdir, urls[i], proxies[i])
                for i in range(self.spec.members)
            ]
            for member in self.members:
                self._launch(member)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _launch(self, member: _Member) -> None:
        command = [
            sys.executable, str(MEMBER_PROGRAM), "--mode", self.scenario, "--name", self.name,
            "--size", str(self.spec.size), "--lease", f"{self.lease:g}",
            "--member", member.name, "--log", str(member.log),
            *(["--ignore-loss"] if self.ignore_loss else []),
        ]  # fmt: skip
        env = {**os.environ, URL_VAR: member.url}  # not in argv: no password in `ps`
        with member.err.open("ab") as err:
            member.proc = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err
            )
        member.frozen = False

    def finish(self) -> None:
        """Stop every member gracefully (each releases and logs its ends); heal first."""
        for member in self.members:
            for proxy in member.proxies:
                proxy.heal()
            if member.alive:
                with contextlib.suppress(ProcessLookupError):
                    member.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
                    member.frozen = False
                    member.proc.terminate()  # type: ignore[union-attr]
        for member in self.members:
            if member.proc is None:
                continue
            try:
                member.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.late.append(f"{member.name} still ran {STOP_TIMEOUT} s after SIGTERM")
                self._kill(member)
        self.poll()

    def close(self) -> None:
        for member in self.members:
            if member.alive:
                with contextlib.suppress(ProcessLookupError):
                    member.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
                self._kill(member)
        self._stack.close()

    def _kill(self, member: _Member) -> float:
        assert member.proc is not None
        pid = member.pid
        member.proc.kill()
        member.proc.wait()
        at = time.monotonic()
        self.kills.append((member.name, pid, at))
        return at

    # -- observation ---------------------------------------------------------------------------

    def poll(self) -> None:
        """Read what each member appended since the last poll."""
        batch = []
        for member in self.members:
            try:
                with member.log.open("rb") as log:
                    log.seek(member.offset)
                    data = log.read()
            except FileNotFoundError:
                continue
            records, bad, used = parse_lines(data)
            member.offset += used
            self.malformed += [f"{member.name}: not a record: {line!r}" for line in bad]
            for record in records:
                if record.get("event") == "started":
                    member.started[int(record["pid"])] = float(record["t"])
            batch += records
        for record in batch:
            self.holds.feed(record)

    def report(self) -> HoldReport:
        """Judge every record logged so far."""
        self.poll()
        return check_holds(
            self.holds.holds(), self.scenario, self.spec.size,
            [*self.malformed, *self.holds.problems],
        )  # fmt: skip

    def in_use(self, now: float | None = None) -> list[Hold]:
        """The holds in use now: no ``end`` yet, deadline ahead, process running."""
        now = time.monotonic() if now is None else now
        running = {(m.name, m.pid) for m in self.members if m.running}
        return [
            h for h in self.holds.open_holds() if (h.member, h.pid) in running and h.deadline > now
        ]

    def tail(self, records: int = 40) -> str:
        """The last records (renews left out) and each member's stderr, for a message."""
        lines: list[tuple[float, str]] = []
        for member in self.members:
            try:
                data = member.log.read_bytes()
            except FileNotFoundError:
                continue
            for line in data[-40_000:].splitlines()[1 if len(data) > 40_000 else 0 :]:
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("event") != "renew":
                        lines.append((float(record["t"]), line.decode()))
        lines.sort()
        parts = [text for _, text in lines[-records:]]
        for member in self.members:
            state = "dead" if not member.alive else "stopped" if member.frozen else "running"
            err = member.err_tail().strip()
            parts.append(f"--- {member.name} ({state}) stderr: {err[-800:] if err else '(empty)'}")
        return "\n".join(parts)

    def _wait(self, what: str, until: float, check: Callable[[], Any]) -> Any:
        """Poll until *check* returns something truthy; fail at monotonic time *until*."""
        while True:
            self.poll()
            killed = {pid for _, pid, _ in self.kills}
            for member in self.members:
                if member.proc is not None and not member.alive and member.pid not in killed:
                    raise AssertionError(
                        f"{member.name} exited with {member.proc.returncode}\n{self.tail()}"
                    )
            found = check()
            if found:
                return found
            if time.monotonic() >= until or self.stop.is_set():
                raise AssertionError(f"no {what} by the deadline\n{self.tail()}")
            time.sleep(POLL)

    def _whole(self) -> bool:
        if not all(m.running for m in self.members):
            return False
        holds = self.in_use()
        if self.scenario == "semaphore":
            return len(holds) == self.spec.size
        owners = {h.unit: h.member for h in holds}
        return len(owners) == self.spec.size and len(set(owners.values())) == len(self.members)

    # -- the run -------------------------------------------------------------------------------

    def run(self, kinds: Sequence[str]) -> None:
        """Throw *kinds* one after the other, then check the quiet end; stop at the first
        violation or stuck wait."""
        self._wait("start of every member", time.monotonic() + STARTUP, self._whole)
        self.started = time.monotonic()
        try:
            for number, kind in enumerate(kinds, 1):
                try:
                    outcome = self._throw(kind)
                except AssertionError as exc:
                    report = self.report()
                    raise AssertionError(
                        f"{self._label}: fault {number} of {len(kinds)} ({kind}): {exc}\n"
                        f"the checker so far: {report.describe()}"
                    ) from None
                self.outcomes.append(outcome)
                report = self.report()
                if not report.ok:
                    raise AssertionError(
                        f"{self._label}: after fault {number} ({outcome}), the checker found:\n"
                        f"{report.describe()}\n{self.tail()}"
                    )
            if self.scenario == "shards":
                self._check_balance()
        finally:
            self.finished = time.monotonic()

    @property
    def _label(self) -> str:
        return f"{self.backend.name} {self.scenario}"

    def _pick(self) -> tuple[_Member, list[Hold], float]:
        """A random member that holds something now (a slot holder: for a lease more yet)."""
        since = time.monotonic()

        def fit() -> list[tuple[_Member, list[Hold]]]:
            now = time.monotonic()
            holds = self.in_use(now)
            found = []
            for member in self.members:
                mine = [h for h in holds if h.member == member.name]
                if self.scenario == "semaphore":
                    mine = [h for h in mine if (h.hold_until or 0) - now >= MARGIN * self.lease]
                if mine:
                    found.append((member, mine))
            return found

        candidates = self._wait("holder to hit", since + SETTLE, fit)
        member, mine = self.rng.choice(candidates)
        return member, mine, time.monotonic() - since

    def _throw(self, kind: str) -> Outcome:
        time.sleep(self.rng.uniform(0.1, 0.5) * self.lease)  # the pace: anywhere in a renew
        victim, held, waited = self._pick()
        units = tuple(sorted((h.unit, h.token) for h in held))
        pid = victim.pid
        bound = self.takeover_bound(kind)
        hold = 0.0
        lag: float | None = None
        at = time.monotonic()
        if kind == "kill":
            at = self._kill(victim)
            taken = self._wait_taken(units, at, bound)
            self._launch(victim)
        elif kind in ("stop", CONTROL_KIND):
            low, high = (3.0, 3.5) if kind == CONTROL_KIND else (1.1, 1.6)
            hold = self.lease * self.rng.uniform(low, high)
            assert victim.proc is not None
            victim.proc.send_signal(signal.SIGSTOP)
            victim.frozen = True
            at = time.monotonic()
            self._sleep_until(at + hold)
            victim.proc.send_signal(signal.SIGCONT)
            victim.frozen = False
            taken = self._wait_taken(units, at, bound)
            self._wait_ended(victim, pid, units, at)
        elif kind in ("cut-drop", "cut-blackhole"):
            hold = self.lease * self.rng.uniform(1.1, 1.6)
            for proxy in victim.proxies:
                if kind == "cut-drop":
                    proxy.drop()
                else:
                    proxy.blackhole("both")
            at = time.monotonic()
            taken = self._wait_taken(units, at, bound)
            ends = self._wait_ended(victim, pid, units, at)
            lag = max(h.logged_end - h.valid_until for h in ends)  # type: ignore[operator]
            assert lag <= STEP_DOWN_LAG, (
                f"cut {victim.name} logged the end of a hold {lag:.3f} s after its "
                f"valid_until: holds must end at their deadline whatever the store does\n"
                f"{self.tail()}"
            )
            self._sleep_until(at + hold)
            hold = time.monotonic() - at
            for proxy in victim.proxies:
                proxy.heal()
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        # Every hold of the victim ended within a lease of the fault (its local deadline).
        ended = self._victim_holds(victim.name, pid, units)
        latest = max(h.end for h in ended)
        assert latest <= at + self.lease, (
            f"{victim.name}'s holds ran until {latest - at:.3f} s after the fault, more than "
            f"a lease ({self.lease:g} s):\n" + "\n".join(h.describe() for h in ended)
        )
        takeover = taken - at
        covered: float = self._wait(
            f"every {'slot' if self.scenario == 'semaphore' else 'shard'} held again",
            at + bound + SETTLE,
            lambda: self._covered(taken),
        )
        covered -= at
        late = max(takeover, covered) > bound
        if late:
            self.late.append(
                f"{kind} of {victim.name}: units {units} taken over after {takeover:.3f} s, "
                f"all held again after {covered:.3f} s: over the bound of {bound:.2f} s"
            )
        self._wait("run whole again", time.monotonic() + REJOIN, self._whole)
        return Outcome(
            kind=kind,
            at=round(at, 6),
            victim=victim.name,
            pid=pid,
            units=units,
            hold=round(hold, 3),
            takeover=round(takeover, 3),
            covered=round(covered, 3),
            late=late,
            whole=round(time.monotonic() - at, 3),
            victim_end=round(latest - at, 3),
            step_down_lag=None if lag is None else round(lag, 4),
            waited=round(waited, 3),
        )

    def _wait_taken(self, units: Sequence[tuple[int, int]], at: float, bound: float) -> float:
        """Wait until each of *units* has a term with a newer token; return when the last
        of them began. Past *bound* the wait goes on `SETTLE` more (a late takeover is
        recorded by the caller)."""

        def taken() -> float | None:
            firsts = []
            holds = self.holds.holds()
            for unit, token in units:
                starts = [h.start for h in holds if h.unit == unit and h.token > token]
                if not starts:
                    return None
                firsts.append(min(starts))
            return max(firsts)

        found: float = self._wait(
            f"newer term on each of {list(units)} (bound {bound:.2f} s)",
            at + bound + SETTLE,
            taken,
        )
        return found

    def _covered(self, since: float) -> float | None:
        """The first instant from *since* on at which the logs show every unit held (every
        shard owned, every slot in use), or None so far."""
        holds = [h for h in self.holds.holds() if h.end > since and not h.empty]
        for x in sorted({since, *(h.start for h in holds if h.start >= since)}):
            if len({h.unit for h in holds if h.start <= x < h.end}) == self.spec.size:
                return x
        return None

    def _victim_holds(self, member: str, pid: int, units: Sequence[tuple[int, int]]) -> list[Hold]:
        wanted = set(units)
        return [
            h
            for h in self.holds.holds()
            if h.member == member and h.pid == pid and (h.unit, h.token) in wanted
        ]

    def _wait_ended(
        self, victim: _Member, pid: int, units: Sequence[tuple[int, int]], at: float
    ) -> list[Hold]:
        """Wait for the victim to log the end of each of its holds *units*."""

        def ended() -> list[Hold] | None:
            mine = self._victim_holds(victim.name, pid, units)
            return mine if len(mine) == len(units) and all(h.closed for h in mine) else None

        found: list[Hold] = self._wait(
            f"end of {victim.name}'s holds {list(units)}",
            at + self.lease + STEP_DOWN_LAG + SETTLE,
            ended,
        )
        return found

    def _check_balance(self) -> None:
        """The quiet end: every shard owned, none by a member over ``ceil(count / live)``,
        within `balance_bound`, and still so a lease later."""
        share = math.ceil(self.spec.size / len(self.members))
        since = time.monotonic()

        def balanced() -> bool:
            holds = self.in_use()
            owned = Counter(h.member for h in holds)
            return len({h.unit for h in holds}) == self.spec.size and max(owned.values()) <= share

        self._wait(
            f"balance (every shard owned, at most {share} per member)",
            since + self.balance_bound + SETTLE,
            balanced,
        )
        took = time.monotonic() - since
        if took > self.balance_bound:
            self.late.append(f"balanced after {took:.3f} s, over {self.balance_bound:.2f} s")
        self._sleep_until(time.monotonic() + self.lease)
        self.poll()
        owned = Counter(h.member for h in self.in_use())
        self.balance = {
            "seconds": round(took, 3),
            "share": share,
            "owned": {m.name: owned[m.name] for m in self.members},
        }
        assert max(owned.values(), default=0) <= share, (
            f"a lease after balancing, a member owns more than {share}: {dict(owned)}\n"
            f"{self.tail()}"
        )

    def _sleep_until(self, when: float) -> None:
        """A fault's own duration, not a wait (cut short when the run is stopped)."""
        self.stop.wait(max(0.0, when - time.monotonic()))


# -- the summary ---------------------------------------------------------------------------


def _stats(values: Sequence[float], digits: int = 3) -> dict[str, float | int | None]:
    return {
        "count": len(values),
        "p50": round(statistics.median(values), digits) if values else None,
        "max": round(max(values), digits) if values else None,
    }


def summarize(run: HoldersRun, report: HoldReport, seed: str) -> dict[str, Any]:
    """What *run* did and measured; *report* judged all its logs."""
    outcomes = run.outcomes
    by_kind = Counter(o.kind for o in outcomes)
    lags = [o.step_down_lag for o in outcomes if o.step_down_lag is not None]
    return {
        "backend": run.backend.name,
        "scenario": run.scenario,
        "lease": run.lease,
        "seed": seed,
        "members": run.spec.members,
        "size": run.spec.size,
        "faults": len(outcomes),
        "by_kind": {kind: by_kind[kind] for kind in (*KINDS, CONTROL_KIND) if by_kind[kind]},
        "holds": len(report.holds),
        "violations": report.violations,
        "overlaps": len(report.overlaps),
        "excess": len(report.excess),
        "problems": list(report.problems[:20]),
        "least_gap_s": round(min(report.gaps), 6) if report.gaps else None,
        "takeover_s": _stats([o.takeover for o in outcomes]),
        "takeover_by_kind_s": {
            kind: _stats([o.takeover for o in outcomes if o.kind == kind]) for kind in by_kind
        },
        "takeover_bound_s": {kind: round(run.takeover_bound(kind), 2) for kind in KINDS},
        "covered_s": _stats([o.covered for o in outcomes]),
        "late": list(run.late),
        "whole_s": _stats([o.whole for o in outcomes]),
        "victim_end_max_s": max((o.victim_end for o in outcomes), default=None),
        "cut_step_down_lag_s": _stats(lags, 4),
        "balance": run.balance,
        "events": dict(run.holds.events),
        "seconds": round(run.finished - run.started, 1),
        "outcomes": [attrs.asdict(o) for o in outcomes],
    }


def _span(stats: Mapping[str, Any], unit: str = "s", digits: int = 2) -> str:
    if not stats.get("count"):
        return "n/a"
    return f"{stats['p50']:.{digits}f} / {stats['max']:.{digits}f} {unit}"


def markdown_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """One row per backend and scenario, for FAULTS.md."""
    lines = [
        "| backend | scenario | lease | faults by kind | holds | violations | takeover p50 / max "
        "| kill | stop | cut | least handover gap | cut step-down lag max | balanced after "
        "| run time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        if "error" in s and not s.get("faults"):
            first = s["error"].splitlines()[0] if s["error"] else "?"
            lines.append(f"| {s['backend']} | {s.get('scenario', '')} | | failed: {first} "
                         "| | | | | | | | | |")  # fmt: skip
            continue
        kinds = ", ".join(f"{k} {n}" for k, n in s["by_kind"].items())
        per = s["takeover_by_kind_s"]
        cut = _stats([o["takeover"] for o in s["outcomes"] if o["kind"].startswith("cut")])
        lag = s["cut_step_down_lag_s"]
        balance = s["balance"].get("seconds")
        lines.append(
            f"| {s['backend']} | {s['scenario']} | {s['lease']:g} s | {kinds} | {s['holds']} | "
            f"{s['violations']} | {_span(s['takeover_s'])} | {_span(per.get('kill', {}))} | "
            f"{_span(per.get('stop', {}))} | {_span(cut)} | {_ms(s.get('least_gap_s'))} | "
            f"{_ms(lag['max'] if lag['count'] else None)} | "
            f"{'n/a' if balance is None else format(balance, '.2f') + ' s'} | "
            f"{s['seconds']:.0f} s |"
        )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def format_summaries(summaries: Sequence[Mapping[str, Any]]) -> str:
    """The summary printed at the end of the test module."""
    lines = ["", "semaphore and shards under faults: per backend and scenario"]
    for s in summaries:
        label = f"{s['backend']} {s.get('scenario', '')}"
        if "error" in s and not s.get("faults"):
            lines.append(f"  {label}: FAILED: {s['error'].splitlines()[0] if s['error'] else ''}")
            continue
        kinds = ", ".join(f"{k} {n}" for k, n in s["by_kind"].items())
        verdict = "no violation" if not s["violations"] else f"{s['violations']} VIOLATIONS"
        per = ", ".join(f"{k} {_span(v)}" for k, v in s["takeover_by_kind_s"].items())
        lines += [
            f"  {label} (lease {s['lease']:g} s, {s['members']} members, size {s['size']}, seed "
            f"{s['seed']}): {s['faults']} faults in {s['seconds']} s, {s['holds']} holds, "
            f"{verdict}",
            f"    by kind: {kinds}",
            f"    takeover (p50 / max): {_span(s['takeover_s'])}; {per}; every unit held again "
            f"{_span(s['covered_s'])}",
            f"    whole again (p50 / max): {_span(s['whole_s'])}; victim's holds ended by "
            f"{s['victim_end_max_s']} s after the fault at most; cut step-down lag "
            f"{_span(s['cut_step_down_lag_s'], 's', 4)}; least handover gap "
            f"{_ms(s.get('least_gap_s'))}",
        ]
        if s["balance"]:
            lines.append(
                f"    balanced {s['balance']['seconds']} s after the last fault settled: "
                f"{s['balance']['owned']} (share {s['balance']['share']})"
            )
        if s["late"]:
            lines.append(f"    LATE: {s['late']}")
        if "error" in s:
            lines.append(f"    FAILED: {s['error'].splitlines()[0] if s['error'] else ''}")
    return "\n".join(lines)
