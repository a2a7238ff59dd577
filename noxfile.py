"""Developer and CI tasks. ``python3 dev.py test`` runs the ``ci`` session.

Sessions:
- ci: everything CI checks: server install, ruff, mypy --strict, unit, packaging, sample,
  integration (real servers) and fault-injection tests.
- lint, typecheck, tests (no servers), integration, faults (the long fault campaign),
  freezes (``multilock run`` with frozen supervisors, long), holders (the semaphore and
  shards campaign, long), clusters (the cluster campaign, long), demo, bench, compose
  (against docker-compose.yml), simulate (the deterministic simulator, long),
  simulate_holders (its semaphore and shards worlds, long).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml"))
IMPORTS = sorted(
    f"multilock.{d.name}" for p in PACKAGES for d in (p / "src" / "multilock").iterdir()
    if d.is_dir() and not d.name.startswith((".", "_"))
)  # fmt: skip
DEV = [
    "pytest>=8",
    "pytest-asyncio>=0.24",
    "pytest-timeout>=2.3",
    "mypy>=1.11",
    "ruff>=0.6",
    "hatchling>=1.25",
    "packaging>=24",
    "testcontainers>=4.8",
    "psycopg[binary,pool]>=3.2.4",  # multilock-postgres' optional extras, for mypy and tests
    "moto[s3]>=5",  # the S3 server of the integration tests
    "flask",
    "flask-cors",
    "tooz[redis,zookeeper]>=9.1",  # benchmark peers (tests/test_benchmarks.py, nox -s bench)
    "python-redis-lock>=4.0",  # the lock comparison's peers (benchmarks/locks.py)
    "pottery>=3.0",
    "psutil>=5.9",  # the benchmark's scale run
    # multilock-filesystem's non-Linux paths, tested here too (its Linux install needs neither).
    "watchfiles>=1.0",
    "filelock>=3.12",
    "matplotlib>=3.8",  # the benchmark's failover plot
    # The integrations' tests and samples: real servers and clients the packages only meet
    # in a user's program (each integration depends on its framework itself).
    "httpx>=0.27",
    "fastapi>=0.110",
    "uvicorn>=0.29",
    "opentelemetry-sdk>=1.20",
    "celery[redis]>=5.3",  # the Celery test's worker and broker transport
]

#: Azurite's published development key (not a secret: every Azurite accepts it).
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

nox.options.sessions = ["ci"]
nox.options.reuse_existing_virtualenvs = True


def _install_all(session: nox.Session) -> None:
    editable = [arg for p in PACKAGES for arg in ("-e", str(p))]
    session.install(*editable, *DEV)


def _servers(session: nox.Session) -> None:
    session.run("python", "integration/harness/install.py")


@nox.session
def ci(session: nox.Session) -> None:
    """The whole suite, as CI runs it (README: ``python3 dev.py test``)."""
    _servers(session)
    _install_all(session)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", *(a for name in IMPORTS for a in ("-p", name)))
    session.run("mypy", "packages/multilock-cli/src/multilock/__main__.py")
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    _install_all(session)
    session.run("mypy", *(a for name in IMPORTS for a in ("-p", name)))
    session.run("mypy", "packages/multilock-cli/src/multilock/__main__.py")


@nox.session
def tests(session: nox.Session) -> None:
    """Unit, packaging and sample tests: no servers needed."""
    _install_all(session)
    session.run("pytest", "packages", "tests", *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """Contract and fault tests against real servers started by the harness."""
    _servers(session)
    _install_all(session)
    session.run("pytest", "integration", *session.posargs)


@nox.session
def faults(session: nox.Session) -> None:
    """The fault campaign in long mode: 60 faults per backend (``-- -k redis`` narrows it).

    ``MULTILOCK_CAMPAIGN_FAULTS`` and ``MULTILOCK_CAMPAIGN_SEED`` may be set to change the
    count and the sequence; the summary is written to ``faults-report.json``.
    """
    _servers(session)
    _install_all(session)
    env = {
        "MULTILOCK_CAMPAIGN_FAULTS": os.environ.get("MULTILOCK_CAMPAIGN_FAULTS", "60"),
        "MULTILOCK_CAMPAIGN_OUT": str(ROOT / "faults-report.json"),
    }
    session.run("pytest", "integration/test_campaign.py", "-p", "no:cacheprovider",
                *session.posargs, env=env)  # fmt: skip


@nox.session
def freezes(session: nox.Session) -> None:
    """``multilock run`` with frozen supervisors, long mode: 100 supervisor freezes per backend.

    The leading supervisor is SIGSTOPped past its lease 100 times per backend (plus a tenth
    as many command freezes, supervisor-and-command freezes and supervisor kills) on
    filesystem, redis, postgres, etcd and zookeeper, all backends at once; the commands'
    tick logs must never overlap. ``MULTILOCK_FREEZES``, ``MULTILOCK_FREEZES_SEED`` and
    ``MULTILOCK_FREEZES_BACKENDS`` (comma-separated) may be set to change the count, the
    sequence and the backends; the summary is written to ``freezes-report.json`` and, as a
    Markdown table, ``freezes-report.md``.
    """
    _servers(session)
    _install_all(session)
    env = {
        "MULTILOCK_FREEZES": os.environ.get("MULTILOCK_FREEZES", "100"),
        "MULTILOCK_FREEZES_SEED": os.environ.get("MULTILOCK_FREEZES_SEED", "1"),
        "MULTILOCK_FREEZES_OUT": str(ROOT / "freezes-report.json"),
    }
    session.run("pytest", "integration/test_freezes.py", "-p", "no:cacheprovider",
                *session.posargs, env=env)  # fmt: skip


@nox.session
def holders(session: nox.Session) -> None:
    """Semaphore and shards holders under faults, long mode: 100 faults per backend and scenario.

    Four member processes per run (a Semaphore of limit 2, or Shards over 12 shards) on
    redis, postgres, etcd and zookeeper take SIGKILLs, SIGSTOPs past the lease and network
    cuts; the checker fails on more holders than allowed, two holders of one slot or shard,
    or tokens that do not rise. ``MULTILOCK_HOLDERS_FAULTS``, ``MULTILOCK_HOLDERS_SEED``,
    ``MULTILOCK_HOLDERS_BACKENDS``, ``MULTILOCK_HOLDERS_SCENARIOS`` and ``MULTILOCK_HOLDERS_JOBS``
    (runs at once, default 2 here) may be set; the summary is written to
    ``holders-report.json`` and ``holders-report.md``, the members' logs to
    ``holders-report-logs/``.
    """
    _servers(session)
    _install_all(session)
    env = {
        "MULTILOCK_HOLDERS_FAULTS": os.environ.get("MULTILOCK_HOLDERS_FAULTS", "100"),
        "MULTILOCK_HOLDERS_SEED": os.environ.get("MULTILOCK_HOLDERS_SEED", "1"),
        "MULTILOCK_HOLDERS_JOBS": os.environ.get("MULTILOCK_HOLDERS_JOBS", "2"),
        "MULTILOCK_HOLDERS_OUT": str(ROOT / "holders-report.json"),
    }
    session.run("pytest", "integration/test_holders_campaign.py", "-p", "no:cacheprovider",
                *session.posargs, env=env)  # fmt: skip


@nox.session
def clusters(session: nox.Session) -> None:
    """The cluster campaign, long: 300 faults per clustered store (``nox -s clusters``).

    etcd with three members, a three-server ZooKeeper ensemble, Redis behind Sentinel (with
    and without ``wait_replicas``), Redlock over five nodes and PostgreSQL with a standby
    (asynchronous and synchronous), each node behind proxies; the store's leader or primary
    is killed, cut off from the clients or its peers, a minority restarted, the store failed
    over, between participant faults. ``MULTILOCK_CLUSTER_FAULTS``, ``MULTILOCK_CLUSTER_SEED``
    and ``MULTILOCK_CLUSTERS`` (comma-separated names) may be set; the summary is written to
    ``clusters-report.json``.
    """
    _servers(session)
    _install_all(session)
    env = {
        "MULTILOCK_CLUSTER_FAULTS": os.environ.get("MULTILOCK_CLUSTER_FAULTS", "300"),
        "MULTILOCK_CLUSTER_SEED": os.environ.get("MULTILOCK_CLUSTER_SEED", "1"),
        "MULTILOCK_CLUSTER_OUT": str(ROOT / "clusters-report.json"),
    }
    session.run("pytest", "integration/test_cluster_campaign.py", "-p", "no:cacheprovider",
                *session.posargs, env=env)  # fmt: skip


@nox.session
def simulate(session: nox.Session) -> None:
    """The deterministic simulator's long campaign: millions of steps, one process per CPU.

    ``MULTILOCK_SIM_STEPS`` (steps in all, default 2,000,000) and ``MULTILOCK_SIM_SEEDS``
    (the first seed, a range ``A:B`` or a list ``A,B,C``; default 0) choose the run, e.g.
    ``MULTILOCK_SIM_SEEDS=5000 nox -s simulate``; ``-- --steps 5000 --jobs 2`` are passed on.
    Prints a line per seed, then the steps and seeds run; a failure prints its seed, a line
    that replays it and its trace, and the session fails.
    """
    session.install("-e", "packages/multilock-core")
    session.run(
        "python", "-c",
        "import sys; from multilock.core.testing._simulator import main; sys.exit(main())",
        *session.posargs,
    )  # fmt: skip


@nox.session
def simulate_holders(session: nox.Session) -> None:
    """The deterministic simulator's semaphore and shards worlds, long: one process per CPU.

    ``MULTILOCK_SIM_HOLDERS_STEPS`` (steps in all, default 400,000),
    ``MULTILOCK_SIM_HOLDERS_SEEDS`` (the first seed, a range ``A:B`` or a list ``A,B,C``;
    default 0) and ``MULTILOCK_SIM_HOLDERS_KIND`` (``semaphore``, ``shards`` or ``both``, the
    default) choose the run; ``-- --steps 2000 --jobs 2`` are passed on. Prints a line per
    run; a failure prints its seed, a line that replays it and its trace, and the session fails.
    """
    session.install("-e", "packages/multilock-core")
    session.run(
        "python", "-c",
        "import sys; from multilock.core.testing._simulate_holders import main; sys.exit(main())",
        *session.posargs,
    )  # fmt: skip


@nox.session
def compose(session: nox.Session) -> None:
    """The integration suite against ``docker compose up`` (needs a Docker engine).

    Every backend, Consul and SQL Server included, then runs against the compose services.
    """
    _install_all(session)
    session.run("docker", "compose", "up", "-d", "--wait", external=True)
    env = {
        "MULTILOCK_TEST_REDIS_URL": "redis://127.0.0.1:16379/0",
        "MULTILOCK_TEST_REDLOCK_URLS": ",".join(
            f"redis://127.0.0.1:{port}/0" for port in (16379, 16380, 16381)
        ),
        "MULTILOCK_TEST_POSTGRES_URL": "postgresql://postgres:multilock@127.0.0.1:15432/postgres",
        "MULTILOCK_TEST_ETCD_URL": "etcd://127.0.0.1:12379",
        "MULTILOCK_TEST_ZOOKEEPER_URL": "zookeeper://127.0.0.1:12181",
        "MULTILOCK_TEST_CONSUL_URL": "consul://127.0.0.1:18500",
        "MULTILOCK_TEST_S3_URL": (
            "s3+http://multilock:multilock-secret@127.0.0.1:19000/multilock?poll_interval=0.2"
        ),
        "MULTILOCK_TEST_AZURE_BLOB_URL": (
            f"azureblob://devstoreaccount1:{quote(AZURITE_KEY, safe='')}@127.0.0.1:10000"
            "/devstoreaccount1/multilock?secure=false"
        ),
        "MULTILOCK_TEST_SQLSERVER_URL": "mssql://sa:Multilock-Test-1@127.0.0.1:11433/master",
    }
    try:
        session.run("pytest", "integration", *session.posargs, env=env)
    finally:
        session.run("docker", "compose", "down", "-v", external=True)


@nox.session
def demo(session: nox.Session) -> None:
    """Three processes on the file-system provider: a crash failover and a handoff."""
    session.install(
        "-e", "packages/multilock-core", "-e", "packages/multilock-filesystem",
        "-e", "packages/multilock-cli",
    )  # fmt: skip
    session.run("python", "samples/demo.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Reproduce benchmarks/REPORT.md."""
    _servers(session)
    _install_all(session)
    session.run("python", "benchmarks/run.py", *session.posargs)
