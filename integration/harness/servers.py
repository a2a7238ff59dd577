"""Throwaway servers for the integration suite, started from locally installed binaries.

Every server runs on 127.0.0.1, on a port picked here (re-picked when another process takes
it first), in its own temp dir, with its output in a log file in that dir. ``stop()``
signals only the PID this process started; ``restart()`` keeps the port and the data dir.

To add a backend, subclass `Server`: set ``kind`` (and ``stop_signal``/``run_as`` when the
defaults do not fit), write ``command()``, ``url`` and ``probe()`` (one real round trip),
and ``prepare()`` when the data dir needs files before the first start. Extra ports
(etcd's peer port) come from ``self.port_for("peer")`` and survive restarts too. For the
other two paths, add a URL probe to `PROBES` (servers named by environment variables) and
a `containers.ContainerSpec` (the Docker fallback), then a `resolve.Recipe` in conftest.

`ExternalServer` wraps a server given by URL (``MULTILOCK_TEST_*_URL``): same surface, but
``restart()``/``stop()`` raise `ControlUnavailable` saying why.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Self
from urllib.parse import urlsplit

from .install import postgres_bindir, redis_server_binary

__all__ = [
    "PROBES",
    "BaseServer",
    "ControlUnavailable",
    "ExternalServer",
    "NotInstalled",
    "PostgresServer",
    "RedisServer",
    "Server",
    "ServerError",
    "argv",
    "free_port",
    "log_sections",
    "probe_postgres",
    "probe_redis",
    "running_servers",
]

HOST = "127.0.0.1"
START_TIMEOUT = 30.0
_BIND_ATTEMPTS = 5


class ServerError(RuntimeError):
    """A server could not be found, started, or made ready."""


class NotInstalled(ServerError):
    """The server's binaries are not installed here."""


class ControlUnavailable(RuntimeError):
    """``restart()``/``stop()`` on a server this process did not start; the message says why."""


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on right now (another process may still take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _redis_client(url: str, timeout: float) -> Any:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No retries: redis-py's default (10, with backoff) turns one probe into 25 s.
    return redis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
    )


def probe_redis(url: str, timeout: float = 2.0) -> None:
    """PING the Redis server at *url*; raise if it does not answer PONG."""
    client = _redis_client(url, timeout)
    try:
        if client.ping() is not True:
            raise ServerError("PING did not answer PONG")
    finally:
        client.close()


def probe_postgres(url: str, timeout: float = 2.0) -> None:
    """Connect to the PostgreSQL server at *url* and run ``SELECT 1``."""
    import psycopg

    with psycopg.connect(url, connect_timeout=max(1, round(timeout)), autocommit=True) as conn:
        row = conn.execute("SELECT 1").fetchone()
        if row != (1,):
            raise ServerError(f"SELECT 1 returned {row!r}")


#: One real round trip per backend kind, for servers known only by URL.
PROBES: dict[str, Callable[[str], None]] = {"redis": probe_redis, "postgres": probe_postgres}


class BaseServer(ABC):
    """What every test server offers, whoever started it."""

    #: The backend: "redis", "postgres", ...
    kind: str

    @property
    @abstractmethod
    def url(self) -> str:
        """The URL a client (of this or another process) connects with."""

    @property
    @abstractmethod
    def host(self) -> str: ...

    @property
    @abstractmethod
    def port(self) -> int: ...

    @property
    def pid(self) -> int | None:
        """The server's PID while this process runs it, else None."""
        return None

    @property
    def log_path(self) -> Path | None:
        """The file the server's output goes to, when there is one."""
        return None

    @property
    def control_unavailable(self) -> str | None:
        """Why ``restart()``/``stop()`` cannot work here, or None when they can."""
        return None

    @abstractmethod
    def probe(self) -> None:
        """One real round trip to the server; raise when it does not answer."""

    def wait_ready(self, deadline: float) -> None:
        """Probe until the server answers; *deadline* is a `time.monotonic()` value."""
        delay = 0.01
        while True:
            gone = self._gone()
            if gone is not None:
                raise ServerError(gone)
            try:
                self.probe()
            except Exception as exc:
                if time.monotonic() >= deadline:
                    raise ServerError(
                        f"{self!r} not ready before the deadline: {exc}\n{self.log_tail()}"
                    ) from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
            else:
                return

    def _gone(self) -> str | None:
        """Why the server is known to be gone (a local process that exited), else None."""
        return None

    def log_tail(self, lines: int = 40) -> str:
        """The last *lines* lines of the server's log, or a note saying there is none."""
        path = self.log_path
        if path is None:
            return f"(no log: {self!r} was not started by this process)"
        try:
            text = path.read_text(errors="replace")
        except OSError as exc:
            return f"(cannot read {path}: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def require_control(self) -> None:
        """Raise `ControlUnavailable` when this server cannot be restarted or stopped."""
        reason = self.control_unavailable
        if reason is not None:
            raise ControlUnavailable(reason)

    @abstractmethod
    def start(self, timeout: float = START_TIMEOUT) -> Self:
        """Start the server (or check that it answers) and return it once ready."""

    def stop(self, timeout: float = 10.0) -> int | None:
        """Shut the server down cleanly; return its exit status when known."""
        self.require_control()
        raise NotImplementedError

    def restart(self, timeout: float = START_TIMEOUT) -> None:
        """Stop, then start again on the same port with the same data."""
        self.require_control()
        self.stop()
        self.start(timeout)

    @abstractmethod
    def close(self) -> None:
        """Release everything this object holds; stop the server if this process runs it."""


class ExternalServer(BaseServer):
    """A server named by URL, e.g. from ``MULTILOCK_TEST_REDIS_URL``: never started or stopped."""

    def __init__(self, kind: str, url: str, source: str) -> None:
        self.kind = kind
        self._url = url
        self.source = source
        parts = urlsplit(url)
        self._host = parts.hostname or HOST
        self._port = parts.port or 0

    @property
    def url(self) -> str:
        return self._url

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    @property
    def control_unavailable(self) -> str:
        return (
            f"the {self.kind} server comes from {self.source}: this suite did not start it, "
            "so it cannot restart or stop it"
        )

    def probe(self) -> None:
        PROBES[self.kind](self._url)

    def start(self, timeout: float = START_TIMEOUT) -> Self:
        """Check that the server answers; raise `ServerError` when it does not."""
        self.wait_ready(time.monotonic() + timeout)
        return self

    def close(self) -> None:
        """Nothing to release: the server is not ours."""

    def __repr__(self) -> str:
        from multilock.core import redact_url

        return f"<ExternalServer {self.kind} {redact_url(self._url)} from {self.source}>"


_live: list[Server] = []
_live_lock = threading.Lock()


def running_servers() -> list[Server]:
    """Every local server this process made and has not closed, oldest first."""
    with _live_lock:
        return list(_live)


@atexit.register
def _close_all() -> None:
    for server in reversed(running_servers()):
        with contextlib.suppress(Exception):
            server.close()


class Server(BaseServer):
    """A server process started by this process from a local binary."""

    #: The signal that shuts the server down cleanly.
    stop_signal: ClassVar[signal.Signals] = signal.SIGTERM
    #: The user to run as when this process is root (PostgreSQL refuses to run as root).
    run_as: ClassVar[str | None] = None

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"multilock-{self.kind}-"))
        self._log_path = self.dir / f"{self.kind}.log"
        self._ports: dict[str, int] = {}
        self._process: subprocess.Popen[bytes] | None = None
        self._prepared = False
        self._closed = False
        with _live_lock:
            _live.append(self)

    # -- what a subclass writes ---------------------------------------------------------

    @abstractmethod
    def command(self) -> list[str]:
        """The argv that runs the server in the foreground on ``self.port``."""

    def prepare(self) -> None:
        """Create what the first start needs in ``self.dir`` (data dir, config files)."""

    # -- the surface ---------------------------------------------------------------------

    @property
    def host(self) -> str:
        return HOST

    @property
    def port(self) -> int:
        return self.port_for("main")

    def port_for(self, name: str) -> int:
        """The port called *name*, picked on first use and kept across restarts."""
        if name not in self._ports:
            self._ports[name] = free_port()
        return self._ports[name]

    @property
    def pid(self) -> int | None:
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    @property
    def log_path(self) -> Path:
        return self._log_path

    @property
    def running(self) -> bool:
        return self.pid is not None

    def start(self, timeout: float = START_TIMEOUT) -> Self:
        """Start the server and wait until it answers; keep the port of an earlier start."""
        if self._closed:
            raise ServerError(f"{self!r} is closed")
        if self.running:
            raise ServerError(f"{self!r} is already running")
        if not self._prepared:
            self.prepare()
            self._prepared = True
        keep_ports = bool(self._ports)
        deadline = time.monotonic() + timeout
        for attempt in range(1, _BIND_ATTEMPTS + 1):
            offset = self._log_path.stat().st_size if self._log_path.exists() else 0
            self._launch(attempt)
            try:
                self.wait_ready(deadline)
            except ServerError as exc:
                self._reap()
                new_output = self._read_log_from(offset)
                if "in use" not in new_output or attempt == _BIND_ATTEMPTS:
                    raise ServerError(f"{self!r} failed to start: {exc}") from None
                if keep_ports:
                    time.sleep(0.2)  # same port: it may be freed in a moment
                else:
                    self._ports.clear()  # someone took the port between pick and bind
                continue
            return self
        raise AssertionError("unreachable")

    def stop(self, timeout: float = 10.0) -> int | None:
        """Shut down with ``stop_signal``; SIGKILL if still alive after *timeout* seconds.

        Return the exit status (negative: killed by that signal), None if not running.
        """
        process = self._process
        if process is None or process.poll() is not None:
            self._reap()
            return None
        process.send_signal(self.stop_signal)
        try:
            status = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            status = process.wait()
        self._reap()
        return status

    def kill(self) -> None:
        """SIGKILL the server and every process it forked: a crash, no clean shutdown."""
        self._reap()

    def close(self) -> None:
        """Stop the server and delete its temp dir."""
        self.stop()
        self._closed = True
        with _live_lock:
            if self in _live:
                _live.remove(self)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        port = self._ports.get("main", "?")
        return f"<{type(self).__name__} {HOST}:{port} pid={self.pid} dir={self.dir}>"

    # -- internals -----------------------------------------------------------------------

    def _user(self) -> pwd.struct_passwd | None:
        """The account to run as, or None to run as ourselves."""
        if self.run_as is None or os.geteuid() != 0:
            return None
        try:
            return pwd.getpwnam(self.run_as)
        except KeyError:
            raise ServerError(
                f"{self.kind} cannot run as root and there is no {self.run_as!r} user"
            ) from None

    def as_run_as(self, command: list[str]) -> list[str]:
        """*command*, run as ``run_as`` when we are root (through ``setpriv``).

        Not through Popen's ``user``/``group``: those make Python ``fork()`` instead of
        ``vfork()``, so the child runs every ``pthread_atfork`` handler before its
        ``exec``. gRPC's handlers (a test's etcd client) then crash about one child in ten
        (status -11) and can close the parent's own gRPC connections.
        """
        user = self._user()
        if user is None:
            return command
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise ServerError(f"{self.kind} runs as {self.run_as!r}: it needs setpriv (util-linux)")
        ids = [f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
        return [setpriv, *ids, "--", *command]

    def chown_dir(self) -> None:
        """Give ``self.dir`` to ``run_as`` when running as root."""
        user = self._user()
        if user is None:
            return
        for root, dirs, files in os.walk(self.dir):
            for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                os.lchown(name, user.pw_uid, user.pw_gid)

    def _launch(self, attempt: int) -> None:
        command = self.command()
        user = self._user()
        env = None if user is None else {**os.environ, "HOME": user.pw_dir, "USER": user.pw_name}
        with open(self._log_path, "ab") as log:
            log.write(f"--- harness: start attempt {attempt}: {' '.join(command)}\n".encode())
            log.flush()
            # Its own session: kill() can take the server's children down with it.
            self._process = subprocess.Popen(
                self.as_run_as(command),
                cwd=self.dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )

    def _gone(self) -> str | None:
        process = self._process
        if process is None:
            return f"{self!r} is not started"
        code = process.poll()
        if code is not None:
            return f"{self.kind} exited with status {code}:\n{self.log_tail()}"
        return None

    def _reap(self) -> None:
        """Kill the server's process group (its own session) unless already reaped; wait."""
        process = self._process
        if process is not None and process.returncode is None:
            # Not reaped yet, so its PID is still its group's id, and no one else's.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self._process = None

    def _read_log_from(self, offset: int) -> str:
        try:
            with open(self._log_path, "rb") as log:
                log.seek(offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""


class RedisServer(Server):
    """``redis-server``; *persistent* turns on the append-only file, fsynced on every write."""

    kind = "redis"

    def __init__(self, *, persistent: bool = False, binary: Path | None = None) -> None:
        found = binary or redis_server_binary()
        if found is None:
            raise NotInstalled("redis-server is not installed")
        self.binary = found
        self.persistent = persistent
        super().__init__()

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def command(self) -> list[str]:
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "always"]
            if self.persistent
            else ["--appendonly", "no"]
        )
        options = {"--port": self.port, "--bind": HOST, "--dir": self.dir, "--daemonize": "no"}
        return [*argv(self.binary, options), "--save", "", *persistence]

    def probe(self) -> None:
        """PING, and check that the answer comes from our process, not a stranger on the port."""
        client = _redis_client(self.url, timeout=1.0)
        try:
            client.ping()
            server_pid = client.info("server")["process_id"]
        finally:
            client.close()
        if server_pid != self.pid:
            raise ServerError(f"port {self.port} answers for PID {server_pid}, not ours")


class PostgresServer(Server):
    """A PostgreSQL cluster copied from a per-session template made by ``initdb``."""

    kind = "postgres"
    stop_signal = signal.SIGINT  # fast shutdown; SIGTERM waits for clients to leave
    run_as = "postgres"

    _templates: ClassVar[dict[Path, Path]] = {}
    _template_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, *, bindir: Path | None = None) -> None:
        found = bindir or postgres_bindir()
        if found is None:
            raise NotInstalled("PostgreSQL is not installed (no postgres and initdb found)")
        self.bindir = found
        super().__init__()

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{HOST}:{self.port}/postgres"

    def prepare(self) -> None:
        shutil.copytree(self._template(), self.data_dir, symlinks=True)
        self.chown_dir()

    def command(self) -> list[str]:
        options = {"-D": self.data_dir, "-p": self.port, "-h": HOST, "-k": self.dir}
        # Fast, yet a commit survives kill(): only an OS crash could lose it. Not
        # synchronous_commit=off, which would lose the last commits to a SIGKILL too.
        fast = ["fsync=off", "full_page_writes=off"]
        settings = [arg for opt in [*fast, "max_connections=200"] for arg in ("-c", opt)]
        return [*argv(self.bindir / "postgres", options), *settings]

    def probe(self) -> None:
        """Connect and ask for the data dir: a stranger on the port has another one."""
        import psycopg

        with psycopg.connect(self.url, connect_timeout=2, autocommit=True) as conn:
            row = conn.execute("SHOW data_directory").fetchone()
        if row is None or Path(row[0]) != self.data_dir:
            raise ServerError(f"port {self.port} answers for data dir {row!r}, not ours")

    def _template(self) -> Path:
        """The session's initdb output for this bindir, made on first use."""
        with self._template_lock:
            if self.bindir not in self._templates:
                self._templates[self.bindir] = self._initdb()
            return self._templates[self.bindir]

    def _initdb(self) -> Path:
        root = Path(tempfile.mkdtemp(prefix="multilock-postgres-template-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        user = self._user()
        if user is not None:
            os.chown(root, user.pw_uid, user.pw_gid)
        options = {"-D": root / "data", "-U": "postgres", "-E": "UTF8"}
        initdb = [*argv(self.bindir / "initdb", options), "--auth=trust", "--locale=C", "--no-sync"]
        done = subprocess.run(
            self.as_run_as(initdb),
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise ServerError(f"initdb failed ({done.returncode}):\n{done.stdout}{done.stderr}")
        return root / "data"


def argv(program: Path | str, options: dict[str, object]) -> list[str]:
    """``[program, flag, value, ...]`` from *options*, every value made a string."""
    return [str(program), *(str(item) for pair in options.items() for item in pair)]


def log_sections(servers: list[BaseServer], lines: int = 40) -> list[tuple[str, str]]:
    """``(title, tail of the log)`` for each server that has a log, for a pytest report."""
    sections = []
    for server in servers:
        if isinstance(server, ExternalServer):
            continue
        where = server.log_path or repr(server)
        sections.append((f"{server.kind} server log ({where})", server.log_tail(lines)))
    return sections
