"""`Cluster`: many participant processes on one backend URL, and faults to throw at them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ._timeline import TimelineReport, check_timeline, read_event_logs

__all__ = ["Cluster", "Member"]

_URL_VAR = "MULTILOCK_PARTICIPANT_URL"


@attrs.define(eq=False)
class Member:
    name: str
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    frozen: bool = False
    #: The store URL of this member, when it differs from the cluster's (`Cluster` *urls*).
    url: str | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Cluster:
    """Run *size* participant processes (``python -m multilock.core.testing.participant``).

    The faults (`kill`, `freeze`/`thaw`, `terminate`, `resign`) are real signals to real
    processes. `check()` merges the logs and judges them with `check_timeline`, knowing
    when each process was killed. Use as a context manager: every process is killed on exit.

    *urls* gives each member a URL of its own (member ``i`` gets ``urls[i]``), e.g. through
    a proxy per member so that a network fault can cut one of them off; by default every
    member uses *url*.
    """

    def __init__(
        self,
        url: str,
        group: str,
        *,
        size: int = 5,
        lease: float = 1.0,
        renew: float | None = None,
        retry: float | None = None,
        log_dir: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        urls: Sequence[str] | None = None,
    ) -> None:
        if urls is not None and len(urls) != size:
            raise ValueError(f"urls names {len(urls)} URL(s) for {size} members")
        self.url = url
        self.group = group
        self.lease = lease
        self._extra = [
            *(["--renew", str(renew)] if renew else []),
            *(["--retry", str(retry)] if retry else []),
        ]
        self._tmp = None if log_dir is not None else tempfile.TemporaryDirectory(prefix="mlc-")
        self.log_dir = Path(log_dir if log_dir is not None else self._tmp.name)  # type: ignore[union-attr]
        # The URL travels in the environment: a password must not show in `ps`.
        self._env = {**os.environ, **(env or {}), _URL_VAR: url}
        self.members = [
            Member(f"{group}-p{i}", self.log_dir / f"p{i}.jsonl", url=urls[i] if urls else None)
            for i in range(size)
        ]
        self.kills: dict[str, list[float]] = {}

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        for member in self.members:
            self.launch(member)

    def launch(self, member: Member) -> None:
        """Start (or restart) *member*'s process."""
        if member.alive:
            raise RuntimeError(f"{member.name} is already running")
        cmd = [
            sys.executable, "-m", "multilock.core.testing.participant",
            "--group", self.group, "--id", member.name,
            "--log", str(member.log_path), "--lease", str(self.lease), *self._extra,
        ]  # fmt: skip
        stderr = open(member.log_path.with_suffix(".stderr"), "ab")  # noqa: SIM115
        env = self._env if member.url is None else {**self._env, _URL_VAR: member.url}
        member.process = subprocess.Popen(cmd, env=env, stderr=stderr)
        stderr.close()
        member.frozen = False

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def records(self) -> list[dict[str, Any]]:
        return read_event_logs(m.log_path for m in self.members)

    def current_leader(self) -> tuple[Member, int] | None:
        """The member whose latest term has not ended, per the logs (and is alive)."""
        terms: dict[str, int | None] = {}
        for record in self.records():
            who = record["participant"]
            if record["event"] == "acquired":
                # A term begun before a SIGKILL of its process ended with that kill.
                killed = any(k >= float(record["t"]) for k in self.kills.get(who, ()))
                terms[who] = None if killed else int(record["token"])
            elif record["event"] in ("lost", "stopped"):
                terms[who] = None
        for member in self.members:
            token = terms.get(member.name)
            if token is not None and member.alive and not member.frozen:
                return member, token
        return None

    def wait_for_leader(
        self, timeout: float, *, newer_than: int = 0, poll: float = 0.01
    ) -> tuple[Member, int, float]:
        """Wait for a live leader with a token above *newer_than*; return it and the time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.current_leader()
            if found is not None and found[1] > newer_than:
                return found[0], found[1], time.monotonic()
            time.sleep(poll)
        raise AssertionError(
            f"no leader with a token above {newer_than} within {timeout:.1f} s; "
            f"logs:\n{self.tail()}"
        )

    def kill(self, member: Member) -> float:
        """SIGKILL *member*; return the kill time."""
        assert member.process is not None
        member.process.kill()
        member.process.wait()
        at = time.monotonic()
        self.kills.setdefault(member.name, []).append(at)
        return at

    def freeze(self, member: Member) -> float:
        assert member.process is not None
        member.process.send_signal(signal.SIGSTOP)
        member.frozen = True
        return time.monotonic()

    def thaw(self, member: Member) -> float:
        assert member.process is not None
        member.process.send_signal(signal.SIGCONT)
        member.frozen = False
        return time.monotonic()

    def terminate(self, member: Member, timeout: float = 10.0) -> float:
        """Stop *member* gracefully (SIGTERM: it releases); wait for it to exit."""
        assert member.process is not None
        member.process.send_signal(signal.SIGTERM)
        member.process.wait(timeout)
        return time.monotonic()

    def resign(self, member: Member) -> float:
        assert member.process is not None
        member.process.send_signal(signal.SIGUSR1)
        return time.monotonic()

    def check(self) -> TimelineReport:
        return check_timeline(self.records(), kills=self.kills)

    def tail(self, lines: int = 30) -> str:
        out = [
            f"{r['t']:.3f} {r['participant']} {r['event']} {r.get('token', '')}"
            for r in self.records()
            if r["event"] != "work"
        ]
        errors = []
        for member in self.members:
            err = member.log_path.with_suffix(".stderr")
            if err.exists() and err.stat().st_size:
                errors.append(f"--- {member.name} stderr:\n{err.read_text()[-2000:]}")
        return "\n".join(out[-lines:] + errors)

    def close(self) -> None:
        for member in self.members:
            if member.process is not None and member.process.poll() is None:
                if member.frozen:
                    member.process.send_signal(signal.SIGCONT)
                member.process.kill()
                member.process.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
