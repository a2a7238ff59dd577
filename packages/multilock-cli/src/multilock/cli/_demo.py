"""``multilock demo``: see leader election survive a crash and a graceful handoff.

1. Participant processes campaign for the group ``demo``; one leads. The status line
   shows who leads and with which fencing token.
2. The leader is killed with SIGKILL: it cannot release anything. A survivor takes over
   once the dead leader's lease runs out; the failover time is measured from the kill to
   the new leader's ``acquired`` log line (every process logs on one monotonic clock).
3. The new leader resigns gracefully (SIGUSR1): it releases at once and another
   participant takes over; that handoff time is measured the same way.
4. Every participant's log is checked: no two leadership terms overlap and every new term
   has a larger token than the last.

The participants are ``python -m multilock.core.testing.participant`` processes driven by
`multilock.core.testing.Cluster`. Every process is killed on exit, on errors and on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from multilock.core import ElectionOptions, redact_url
from multilock.core.testing import Cluster, Member

__all__ = ["GROUP", "run_demo"]

GROUP = "demo"
POLL = 0.05


class DemoFailed(Exception):
    """The cluster did not do what the demo expected (the message says what)."""


class _Board:
    """Who leads, read from the participants' logs, printed as one status line.

    On a terminal the line is redrawn in place; otherwise a line is printed on each change.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.started = time.monotonic()
        self._tty = sys.stdout.isatty()
        self._last = ""
        self._open_line = False

    def states(self) -> dict[str, tuple[str, int | None]]:
        """Each member's state ("starting", "follower", "LEADER", "killed", ...) and token."""
        states: dict[str, tuple[str, int | None]] = {
            m.name: ("starting", None) for m in self.cluster.members
        }
        for record in self.cluster.records():
            who, event = record["participant"], record["event"]
            if event in ("started", "lost"):
                states[who] = ("follower", None)
            elif event == "acquired":
                states[who] = ("LEADER", int(record["token"]))
            elif event == "stopped":
                states[who] = ("stopped", None)
        for member in self.cluster.members:
            gone = states[member.name][0] != "stopped"
            if gone and not member.alive and member.process is not None:
                killed = member.name in self.cluster.kills
                states[member.name] = ("killed" if killed else "exited", None)
        return states

    def leader(self) -> tuple[Member, int] | None:
        states = self.states()
        for member in self.cluster.members:
            state, token = states[member.name]
            if state == "LEADER" and token is not None and member.alive:
                return member, token
        return None

    def show(self) -> None:
        states = self.states()
        leaders = [(n, t) for n, (s, t) in states.items() if s == "LEADER"]
        head = "leader: " + (", ".join(f"{n} (token {t})" for n, t in leaders) or "none")
        rest = "  ".join(
            f"{n}: {s}" + (f" {t}" if t is not None else "") for n, (s, t) in states.items()
        )
        line = f"{head:<32} | {rest}"
        stamp = f"[{time.monotonic() - self.started:5.1f}s] "
        if self._tty:
            sys.stdout.write("\r\x1b[K" + stamp + line)
            sys.stdout.flush()
            self._open_line = True
        elif line != self._last:
            print(stamp + line, flush=True)
        self._last = line

    def say(self, text: str) -> None:
        if self._open_line:
            sys.stdout.write("\n")
            self._open_line = False
        print(text, flush=True)

    def watch(self, seconds: float) -> None:
        """Keep the status line fresh for *seconds*."""
        deadline = time.monotonic() + seconds
        before = self.leader()
        while time.monotonic() < deadline:
            self.show()
            self._check_alive()
            now = self.leader()
            if before is not None and now is not None and now[1] != before[1]:
                self.say(
                    f"warning: leadership moved from {before[0].name} (token {before[1]}) to "
                    f"{now[0].name} (token {now[1]}) although nothing failed"
                )
            before = now if now is not None else before
            time.sleep(POLL)

    def wait_for_leader(self, timeout: float, *, newer_than: int = 0) -> tuple[Member, int, float]:
        """Wait for a live leader with a token above *newer_than*.

        Return it, its token and when it logged ``acquired`` (on the shared monotonic clock).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.show()
            self._check_alive()
            found = self.leader()
            if found is not None and found[1] > newer_than:
                member, token = found
                return member, token, self._acquired_at(member, token)
            time.sleep(POLL)
        raise DemoFailed(
            f"no new leader (token above {newer_than}) within {timeout:.1f} s; "
            f"the participants' logs end with:\n{self.cluster.tail()}"
        )

    def _acquired_at(self, member: Member, token: int) -> float:
        for record in self.cluster.records():
            if (
                record["participant"] == member.name
                and record["event"] == "acquired"
                and record["token"] == token
            ):
                return float(record["t"])
        raise DemoFailed(f"{member.name} leads with token {token} but never logged it")

    def _check_alive(self) -> None:
        for member in self.cluster.members:
            process = member.process
            if (
                process is not None
                and process.poll() is not None
                and member.name not in self.cluster.kills
            ):
                raise DemoFailed(
                    f"participant {member.name} exited on its own with code {process.returncode}; "
                    f"its logs end with:\n{self.cluster.tail()}"
                )


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C, so the participants are killed either way."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM back while cleaning up; they act once it is done."""
    held = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def _run(cluster: Cluster, options: ElectionOptions) -> None:
    board = _Board(cluster)
    worst = options.worst_case_failover
    cluster.start()
    pids = ", ".join(f"{m.name} (pid {m.process.pid})" for m in cluster.members if m.process)
    board.say(f"started {len(cluster.members)} participants: {pids}")

    board.wait_for_leader(15 + 3 * options.lease_duration)
    board.watch(1.5)

    leader, token, _ = board.wait_for_leader(worst + 10)  # whoever leads now
    board.say(f"--> SIGKILL {leader.name}, the leader (token {token}): it cannot release")
    killed_at = cluster.kill(leader)
    leader, token, acquired_at = board.wait_for_leader(
        worst + options.lease_duration + 10, newer_than=token
    )
    board.say(
        f"failover: {leader.name} leads with token {token}, "
        f"{acquired_at - killed_at:.2f} s after the kill "
        f"(the dead leader's lease had to run out; at most lease + retry = {worst:g} s)"
    )
    board.watch(1.5)

    leader, token, _ = board.wait_for_leader(worst + 10)
    board.say(f"--> {leader.name} resigns gracefully (token {token}): it releases at once")
    resigned_at = cluster.resign(leader)
    resigned = leader
    leader, token, acquired_at = board.wait_for_leader(worst + 10, newer_than=token)
    board.say(
        f"handoff: {leader.name} leads with token {token}, "
        f"{acquired_at - resigned_at:.2f} s after the resign"
        + (" (no other candidate was left, so it led again)" if leader is resigned else "")
    )
    board.watch(1.0)

    board.say("stopping the participants gracefully (the leader last)")
    for member in sorted(cluster.members, key=lambda m: m is leader):
        if member.alive:
            cluster.terminate(member)
    board.show()

    report = cluster.check()
    if not report.ok:
        raise DemoFailed("UNSAFE: " + "; ".join(report.problems) + "\nterms:\n" + report.describe())
    terms = " -> ".join(f"{i.token} ({i.participant})" for i in report.intervals)
    board.say(f"checked {len(report.intervals)} terms in the logs")
    board.say(f"no overlap, tokens rising: {terms}")


def run_demo(url: str | None, options: ElectionOptions, participants: int) -> int:
    """Run the demo; return the exit code (0: everything as expected, 1: it failed).

    *url* None: file-system leases in a fresh temp dir (needs ``multilock-filesystem``).
    """
    with tempfile.TemporaryDirectory(prefix="multilock-demo-") as tmp:
        if url is None:
            leases = Path(tmp, "leases")
            leases.mkdir()
            url = leases.as_uri()
        logs = Path(tmp, "logs")
        logs.mkdir()
        print(
            f"backend: {redact_url(url)}   group: {GROUP}   lease: {options.lease_duration:g} s",
            flush=True,
        )
        cluster = Cluster(url, GROUP, size=participants, lease=options.lease_duration, log_dir=logs)
        try:
            with _sigterm_as_interrupt():
                try:
                    _run(cluster, options)
                finally:
                    with _signals_held():
                        cluster.close()
        except KeyboardInterrupt:
            print("\ninterrupted: every participant was killed", file=sys.stderr, flush=True)
            return 130
        except DemoFailed as exc:
            print(f"\ndemo FAILED: {exc}", file=sys.stderr, flush=True)
            return 1
    return 0
