"""Lock acquire and release on one Redis: multilock's `Lock` beside python-redis-lock and pottery.

Every client is a process of its own (this module run as a program, ``--worker``), with
its own connections, so the asyncio and the threaded libraries are measured alike and
none shares a GIL or an event loop with another client or with the parent. Each library
is used the way its documentation shows, with the same lease (the lock's time to live):

- multilock: ``async with Lock(provider, name, lease_duration=lease) as held:``, one
  provider (``from_url``) per process; the lock renews itself in the background, and a
  waiter is woken by the store's notification (pub/sub);
- multilock's blocking facade, ``with multilock.core.sync.Lock(...)``, when it exists;
- python-redis-lock: ``with redis_lock.Lock(conn, name, expire=lease, auto_renewal=True):``
  (SET NX EX; a waiter blocks in BLPOP on a signal list that the release pushes to; the
  renewal is a thread per hold, every 2/3 of ``expire``, which takes whole seconds);
- pottery: ``with Redlock(key=name, masters={conn}, auto_release_time=lease):`` on the one
  Redis (the Redlock algorithm over a single master; no renewal; a waiter retries after a
  random sleep of up to 0.2 s, ``Redlock._RETRY_DELAY``).

Two measurements per library:

1. uncontended: *rounds* times in one process, construct the lock and enter its
   ``with`` block (acquire), then leave it (release), each timed with
   ``time.perf_counter``; after a warm-up. The server's ``INFO commandstats`` around each
   chunk gives the Redis commands per round (INFO itself excluded; commands run by a
   script count too), its ``INFO stats`` the new connections.
2. contended handoff: two processes; one holds the lock, the other starts waiting for it
   and is given 0.1 to 0.2 s (random) to settle into its wait; then the holder leaves its
   block. The sample is from just before the holder leaves to just after the waiter's
   acquire returns, both on the system-wide ``time.monotonic()``. The roles alternate.

The libraries take turns in chunks (`CHUNKS`), so that the drifting load of a shared
machine falls on all of them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from common import fmt, say, summary

PROGRAM = Path(__file__).resolve()
#: The systems compared, in report order. The "multilock sync" rows run only where
#: `multilock.core.sync.Lock` exists: with one provider per process, as the other rows
#: hold one connection (pool), and with the URL as its docstring shows, which builds a
#: provider for each block.
SYNC = ("multilock sync", "multilock sync, URL")
SYSTEMS = ["multilock", *SYNC, "python-redis-lock", "pottery"]
WARMUP = 20
#: The systems take turns in this many chunks of rounds (and of handoffs) each.
CHUNKS = 10
#: The waiter's time to settle into its wait before the holder releases: plus up to as
#: much again at random, so that pottery's retry sleeps are met at random phases.
SETTLE = 0.1


def sync_lock_available() -> bool:
    try:
        from multilock.core import sync
    except ImportError:
        return False
    return hasattr(sync, "Lock")


# --------------------------------------------------------------------------- the worker
# One client process. Commands on stdin, one per line; answers on stdout:
#   rounds N  -> "rounds {json}": N uncontended rounds, acquire/release/round in ms
#   hold      -> "waiting", then "acquired <monotonic>" once the lock is held; the next
#                line read ends the block ("release"), and "released <t0> <t1>" gives
#                the instants just before the block was left and just after
#   quit      -> the process ends


def _say(*words: object) -> None:
    print(*words, flush=True)


def _timings(acquire: list[float], release: list[float]) -> str:
    return json.dumps({"acquire": acquire, "release": release})


def _sync_worker(make: Callable[[], Any], lines: IO[str]) -> None:
    """A blocking library: *make()* builds the lock object that a ``with`` block enters."""
    for line in lines:
        command = line.split()
        if not command or command[0] == "quit":
            return
        if command[0] == "rounds":
            acquire, release = [], []
            for _ in range(int(command[1])):
                t0 = time.perf_counter()
                with make():
                    t1 = time.perf_counter()
                t2 = time.perf_counter()
                acquire.append((t1 - t0) * 1000)
                release.append((t2 - t1) * 1000)
            _say("rounds", _timings(acquire, release))
        elif command[0] == "hold":
            _say("waiting")
            with make():
                _say("acquired", time.monotonic())
                lines.readline()  # "release"
                released = time.monotonic()
            _say("released", released, time.monotonic())


async def _multilock_worker(url: str, name: str, lease: float) -> None:
    from multilock.core import Lock, from_url

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with from_url(url) as provider:
        while command := (await reader.readline()).decode().split():
            if command[0] == "quit":
                return
            if command[0] == "rounds":
                acquire, release = [], []
                for _ in range(int(command[1])):
                    t0 = time.perf_counter()
                    async with Lock(provider, name, lease_duration=lease):
                        t1 = time.perf_counter()
                    t2 = time.perf_counter()
                    acquire.append((t1 - t0) * 1000)
                    release.append((t2 - t1) * 1000)
                _say("rounds", _timings(acquire, release))
            elif command[0] == "hold":
                _say("waiting")
                async with Lock(provider, name, lease_duration=lease):
                    _say("acquired", time.monotonic())
                    await reader.readline()  # "release"
                    released = time.monotonic()
                _say("released", released, time.monotonic())


def worker(system: str, url: str, name: str, lease: float) -> None:
    if system == "multilock":
        asyncio.run(_multilock_worker(url, name, lease))
        return
    if system in SYNC:
        from multilock.core import from_url, sync

        if system == "multilock sync, URL":
            _sync_worker(lambda: sync.Lock(url, name, lease_duration=lease), sys.stdin)
            return
        # One provider for the process, never closed by the locks (the facade's loop
        # thread makes its connections: providers with connections belong to one loop).
        provider = from_url(url)
        _sync_worker(lambda: sync.Lock(provider, name, lease_duration=lease), sys.stdin)
        return
    import redis

    conn = redis.Redis.from_url(url)
    if system == "python-redis-lock":
        import redis_lock

        expire = max(1, round(lease))  # whole seconds
        _sync_worker(
            lambda: redis_lock.Lock(conn, name, expire=expire, auto_renewal=True), sys.stdin
        )
    elif system == "pottery":
        from pottery import Redlock

        _sync_worker(lambda: Redlock(key=name, masters={conn}, auto_release_time=lease), sys.stdin)
    else:
        raise SystemExit(f"unknown system {system!r}")
    conn.close()


# --------------------------------------------------------------------------- the parent
class Client:
    """One worker process, driven line by line."""

    def __init__(self, system: str, url: str, name: str, lease: float) -> None:
        self.system = system
        self.proc = subprocess.Popen(
            [sys.executable, str(PROGRAM), "--worker", system, url, name, str(lease)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.errors: list[str] = []
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        threading.Thread(target=self._drain, args=(self.proc.stderr,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line.strip())
        self.lines.put(None)

    def _drain(self, stream: IO[str]) -> None:
        for line in stream:
            self.errors.append(line.rstrip())
            del self.errors[:-20]

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def expect(self, word: str, timeout: float) -> str:
        """The next line, which must start with *word*: the rest of it."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.system}: no {word!r} within {timeout:g} s") from None
        if line is None:
            tail = "\n".join(self.errors[-5:])
            raise RuntimeError(f"{self.system}: the worker ended before {word!r}:\n{tail}")
        head, _, rest = line.partition(" ")
        if head != word:
            raise RuntimeError(f"{self.system}: expected {word!r}, got {line[:200]!r}")
        return rest

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send("quit")
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def measure_rounds(
    systems: list[str], url: str, rounds: int, lease: float, chunks: int = CHUNKS
) -> dict[str, dict[str, Any]]:
    """*rounds* uncontended acquire+release rounds per system, one process each, and the
    Redis commands and new connections per round.

    The systems take turns, *chunks* chunks each in a shuffled order per turn, so that
    the load of a shared machine, which drifts, falls on all of them alike.
    """
    from peers import RedisCounter

    rng = random.Random(11)
    counter = RedisCounter(url)
    clients: dict[str, Client] = {}
    timings: dict[str, dict[str, list[float]]] = {
        s: {"acquire": [], "release": []} for s in systems
    }
    commands: dict[str, Counter[str]] = {s: Counter() for s in systems}
    connections: dict[str, int] = dict.fromkeys(systems, 0)
    try:
        for system in systems:
            clients[system] = Client(system, url, f"bench-lock-{_slug(system)}-rounds", lease)
        for system in systems:  # started, connected, scripts loaded: outside the counts
            clients[system].send(f"rounds {WARMUP}")
            clients[system].expect("rounds", 60 + WARMUP)
        sizes = [rounds // chunks + (1 if i < rounds % chunks else 0) for i in range(chunks)]
        for size in (n for n in sizes if n):
            for system in rng.sample(systems, len(systems)):
                # The connection count's own connection (a HELLO) outside the command count.
                connected = _connections(url)
                before = counter.snapshot()
                clients[system].send(f"rounds {size}")
                done = json.loads(clients[system].expect("rounds", 60 + size))
                commands[system] += counter.snapshot() - before
                connections[system] += _connections(url) - connected - 1  # less our own
                for key in ("acquire", "release"):
                    timings[system][key] += done[key]
    finally:
        counter.close()
        for client in clients.values():
            client.close()
    out = {}
    for system in systems:
        acquire, release = timings[system]["acquire"], timings[system]["release"]
        both = [a + r for a, r in zip(acquire, release, strict=True)]
        out[system] = {
            "acquire": summary(acquire, 0),
            "release": summary(release, 0),
            "round": summary(both, 0),
            "commands": {k: v / rounds for k, v in commands[system].items() if v > 0},
            "connections": connections[system] / rounds,
        }
    return out


def _slug(system: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", system.lower()).strip("-")


def _connections(url: str) -> int:
    """Connections the Redis server has accepted since it started (``INFO stats``; this
    query's own connection is counted in every sample alike)."""
    import redis

    with redis.Redis.from_url(url, socket_timeout=5) as client:
        return int(client.info("stats")["total_connections_received"])


def measure_handoffs(
    systems: list[str], url: str, count: int, lease: float, chunks: int = CHUNKS
) -> dict[str, dict[str, Any]]:
    """*count* releases by a holder to a waiting process per system: from just before the
    holder leaves its block to the waiter's acquire (ms), and the holder's own exit time.

    Two processes per system; the systems take turns in chunks, as in `measure_rounds`.
    Each chunk begins with a fresh hold and ends with a release, so nothing is held (and
    no lease runs out) while the other systems take their turns.
    """
    rng = random.Random(7)
    pairs: dict[str, list[Client]] = {}
    latencies: dict[str, list[float]] = {s: [] for s in systems}
    exits: dict[str, list[float]] = {s: [] for s in systems}
    wait = lease * 3 + 10
    try:
        for system in systems:
            name = f"bench-lock-{_slug(system)}-handoff"
            pairs[system] = [Client(system, url, name, lease) for _ in range(2)]
        sizes = [count // chunks + (1 if i < count % chunks else 0) for i in range(chunks)]
        for size in (n for n in sizes if n):
            for system in rng.sample(systems, len(systems)):
                holder, waiter = pairs[system]
                holder.send("hold")
                holder.expect("waiting", 60)
                holder.expect("acquired", 60)
                for _ in range(size):
                    waiter.send("hold")
                    waiter.expect("waiting", 30)
                    time.sleep(SETTLE + rng.uniform(0, SETTLE))
                    holder.send("release")
                    released, left = map(float, holder.expect("released", wait).split())
                    acquired = float(waiter.expect("acquired", wait))
                    latencies[system].append((acquired - released) * 1000)
                    exits[system].append((left - released) * 1000)
                    holder, waiter = waiter, holder
                holder.send("release")
                holder.expect("released", wait)
    finally:
        for pair in pairs.values():
            for client in pair:
                client.close()
    return {s: {**summary(latencies[s], 0), "exit": summary(exits[s], 0)} for s in systems}


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for system, dist in (
        ("multilock", "multilock-core"),
        ("python-redis-lock", "python-redis-lock"),
        ("pottery", "pottery"),
        ("redis-py", "redis"),
    ):
        with contextlib.suppress(PackageNotFoundError):
            out[system] = version(dist)
    return out


def run(url: str, rounds: int, handoffs: int, lease: float) -> dict[str, Any]:
    """Every system on the Redis at *url*: a row each (or why it was not run)."""
    out: dict[str, Any] = {"lease": lease, "rounds": rounds, "handoffs": handoffs}
    out["versions"] = versions()
    rows: dict[str, Any] = {}
    for system in SYSTEMS:
        if system in SYNC and not sync_lock_available():
            rows[system] = {"skipped": "`multilock.core.sync.Lock` does not exist in this tree"}
        elif system in ("python-redis-lock", "pottery"):
            try:
                __import__("redis_lock" if system == "python-redis-lock" else "pottery")
            except ImportError:
                rows[system] = {"skipped": f"not installed (pip install {system})"}
    systems = [s for s in SYSTEMS if s not in rows]
    say(f"locks: {rounds} uncontended rounds of each of {', '.join(systems)}, interleaved")
    try:
        for system, row in measure_rounds(systems, url, rounds, lease).items():
            rows[system] = row
        if handoffs:
            say(f"locks: {handoffs} handoffs of each, interleaved")
            for system, h in measure_handoffs(systems, url, handoffs, lease).items():
                rows[system]["handoff"] = h
    except Exception as exc:
        for system in systems:
            rows.setdefault(system, {})["error"] = repr(exc)[:300]
    for system in systems:
        say(f"locks: {system}: {_brief(rows[system])}")
    out["rows"] = {s: rows[s] for s in SYSTEMS if s in rows}
    return out


def _brief(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"error {row['error']}"
    parts = [f"round p50 {fmt(row['round']['p50'], 3)} ms p99 {fmt(row['round']['p99'], 3)} ms"]
    if "handoff" in row:
        h = row["handoff"]
        parts.append(f"handoff p50 {fmt(h['p50'], 2)} ms p99 {fmt(h['p99'], 2)} ms")
    return ", ".join(parts)


# --------------------------------------------------------------------------- the report
#: The section's number in the report (`report.merge_sections` finds it by its title).
NUMBER = 8
TITLE = "Lock acquire and release"
#: How its line in the report's Targets begins.
TARGET = "- Lock acquire+release on redis"


def report_section(result: dict[str, Any], note: str = "") -> list[str]:
    if not result:
        return []
    lease, rows = result["lease"], result["rows"]
    vers = result.get("versions", {})
    expire = max(1, round(lease))
    lines = [
        "",
        f"## {NUMBER}. {TITLE}: multilock, python-redis-lock, pottery (one Redis)",
        "",
        *([note, ""] if note else []),
        "Every client is a process of its own with its own connections, on the Redis server "
        f"of sections 1 to 3, lease {lease:g} s for all, each library used as its "
        "documentation shows, the lock object built for each block: multilock "
        f"`async with Lock(provider, name, lease_duration={lease:g})` with one provider "
        "(`from_url`) per process (renewed in the background; waiters woken by pub/sub); "
        f"multilock's blocking facade `with multilock.core.sync.Lock(provider, name, "
        f"lease_duration={lease:g})` likewise (the lock runs on the facade's loop thread), "
        "and in the form of its docstring, `with multilock.core.sync.Lock(url, name, ...)`, "
        "which builds a provider for each block and closes it after (the 'URL' row); "
        f"python-redis-lock `with redis_lock.Lock(conn, name, expire={expire}, "
        "auto_renewal=True)` (SET NX; waiters block in BLPOP on a list the release pushes "
        "to; renewal by a thread per hold; `expire` takes whole seconds); pottery "
        f"`with Redlock(key=name, masters={{conn}}, auto_release_time={lease:g})` on the one "
        "Redis (no renewal; a waiter retries after a random sleep of up to 0.2 s). One "
        "redis-py client per process for the last two. Versions: "
        + ", ".join(f"{k} {v}" for k, v in vers.items())
        + ".",
        "",
        f"Uncontended: {result['rounds']} rounds per library in one process (after "
        f"{WARMUP} to warm up): build the lock and enter its block (acquire), leave it "
        "(release), on `time.perf_counter`. The libraries take turns, "
        f"{CHUNKS} chunks each in a shuffled order, so that the drifting load of the shared "
        "machine falls on all of them alike. Redis commands per round: the server's `INFO "
        "commandstats` around each chunk (the commands a script runs count too); "
        "connections per round: the server's `INFO stats` total_connections_received "
        "around each chunk.",
        "",
        "| system | acquire p50 ms | acquire p99 ms | release p50 ms | release p99 ms "
        "| round p50 ms | round p99 ms | round max ms | new connections per round "
        "| Redis commands per round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system, r in rows.items():
        if "skipped" in r:
            lines.append(f"| {system} | not run: {r['skipped']} |||||||||")
            continue
        if "error" in r and "round" not in r:
            lines.append(f"| {system} | error: {r['error']} |||||||||")
            continue
        a, rel, rnd = r["acquire"], r["release"], r["round"]
        lines.append(
            f"| {system} | {fmt(a['p50'], 3)} | {fmt(a['p99'], 3)} | {fmt(rel['p50'], 3)} "
            f"| {fmt(rel['p99'], 3)} | {fmt(rnd['p50'], 3)} | {fmt(rnd['p99'], 3)} "
            f"| {fmt(rnd['max'], 3)} | {fmt(r.get('connections'), 2)} "
            f"| {_commands(r['commands'])} |"
        )
    lines += [
        "",
        f"Contended handoff: two processes per library, {result['handoffs']} handoffs, "
        f"taken in turns as above ({CHUNKS} chunks, each from a fresh hold to a final "
        f"release); the waiter has waited {SETTLE * 1000:g} to {SETTLE * 2000:g} ms "
        "(random) when the holder leaves its block; from just before the holder leaves to "
        "just after the waiter's acquire returns (`time.monotonic`, one clock for both "
        "processes). The last columns: the holder's own time to leave its block (its "
        "release), in the same handoffs.",
        "",
        "| system | handoffs | p50 ms | p95 ms | p99 ms | mean ms | max ms "
        "| holder's exit p50 ms | holder's exit p99 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for system, r in rows.items():
        h = r.get("handoff")
        if "skipped" in r:
            lines.append(f"| {system} | not run: {r['skipped']} ||||||||")
        elif h is None:
            lines.append(f"| {system} | error: {r.get('error', 'not measured')} ||||||||")
        else:
            lines.append(
                f"| {system} | {h['count']} | {fmt(h['p50'], 2)} | {fmt(h['p95'], 2)} "
                f"| {fmt(h['p99'], 2)} | {fmt(h['mean'], 2)} | {fmt(h['max'], 2)} "
                f"| {fmt(h['exit']['p50'], 2)} | {fmt(h['exit']['p99'], 2)} |"
            )
    lines += ["", *NOTES]
    return lines


NOTES = [
    "- What a round is: a multilock `Lock` is an election held for the length of the "
    "block; entering starts it and waits for its first term, leaving stops it (cancel its "
    "tasks, then release). Its Redis commands per round are in the table: the acquire "
    "and release scripts (EVALSHA, with the HMGET, TIME, SET, HSET, PEXPIRE, GET, DEL "
    "and PUBLISH they run), and a HELLO and a PSUBSCRIBE: the provider's pub/sub "
    "connection ends with the block's watch and is opened again by the next block (the "
    "connections column). python-redis-lock's round is a SET NX and a release script, "
    "plus a renewal thread started and joined; pottery's, a SET NX and a release script, "
    "each sent from a thread pool the lock starts for the call. None of them renews "
    "within a round this short.",
    "- What a handoff is made of: multilock's waiter is woken by the release's pub/sub "
    "message and runs one acquire; python-redis-lock's waiter returns from BLPOP when the "
    "release pushes to the signal list and retries its SET NX; pottery's waiter is not "
    "told: it finds the lock free at its next retry, after a random sleep of up to "
    "0.2 s, so about 0.1 s on average. A waiter cannot acquire before the holder's "
    "release reaches the server, so the holder's exit time bounds the handoff.",
    "- Only multilock gives the holder a fencing token (`held.token`) and ends the block "
    "(async) or sets `held.lost` (sync) when the lease is lost; python-redis-lock's and "
    "pottery's holders are not told.",
]


def _commands(per_round: dict[str, float]) -> str:
    total = sum(per_round.values())
    shown = sorted(((v, k) for k, v in per_round.items() if v >= 0.05), reverse=True)
    detail = ", ".join(f"{k} {v:.1f}" for v, k in shown)
    return f"{total:.1f} ({detail})" if detail else f"{total:.1f}"


def targets(result: dict[str, Any]) -> list[str]:
    """The issue asks for the comparison itself: stated as measured, not judged."""
    rows = (result or {}).get("rows") or {}
    ours = rows.get("multilock") or {}
    what = f"{TARGET[2:]}, beside python-redis-lock and pottery (measured)"
    if "round" not in ours:
        return [f"- {what}: not measured"]
    parts = [
        f"multilock round p50 {fmt(ours['round']['p50'], 2)} ms, p99 "
        f"{fmt(ours['round']['p99'], 2)} ms"
    ]
    for system in (*SYNC, "python-redis-lock", "pottery"):
        r = rows.get(system) or {}
        if "round" in r:
            parts.append(
                f"{system} p50 {fmt(r['round']['p50'], 2)} ms, p99 {fmt(r['round']['p99'], 2)} ms"
            )
    handoffs = [
        f"{system} p50 {fmt(r['handoff']['p50'], 2)} ms, p99 {fmt(r['handoff']['p99'], 2)} ms"
        for system, r in rows.items()
        if r.get("handoff")
    ]
    line = f"- {what}: {'; '.join(parts)}"
    if handoffs:
        line += f". Contended handoff (release to the waiter's acquire): {'; '.join(handoffs)}"
    return [line]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one lock client (run by locks.run)")
    parser.add_argument("--worker", nargs=4, metavar=("SYSTEM", "URL", "NAME", "LEASE"))
    args = parser.parse_args(argv)
    if not args.worker:
        parser.error("run benchmarks/run.py --locks N; this program is its worker")
    system, url, name, lease = args.worker
    worker(system, url, name, float(lease))
    return 0


if __name__ == "__main__":
    sys.exit(main())
