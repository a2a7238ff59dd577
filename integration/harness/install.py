"""Find and install the server binaries the integration suite starts.

Run as ``python integration/harness/install.py``: installs what is missing, when possible.
Idempotent: prints one line and does nothing when everything is there. Installs with
apt-get (as root, or through passwordless sudo). Never fails hard: when it cannot install,
it says why and exits 0, and the test fixtures then skip (or fail in CI) with their own
reason. The finders (``redis_server_binary()`` ...) return a path, or None when the
program is not installed; `servers` uses them too.

Standard library only, so it runs before anything else is installed.
"""

from __future__ import annotations

import ctypes.util
import glob
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "etcd_binary",
    "etcdctl_binary",
    "install_apt",
    "azurite_dir",
    "install_azurite",
    "missing_apt_packages",
    "postgres_bindir",
    "redis_server_binary",
    "zookeeper_classpath",
]


def _which(name: str, *known: str) -> Path | None:
    found = shutil.which(name)
    if found:
        return Path(found)
    for candidate in known:
        if os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def redis_server_binary() -> Path | None:
    """``redis-server``, from PATH or the usual install locations."""
    return _which("redis-server", "/usr/bin/redis-server", "/usr/local/bin/redis-server")


def _has_postgres(bindir: Path) -> bool:
    return all(os.access(bindir / name, os.X_OK) for name in ("postgres", "initdb"))


def postgres_bindir() -> Path | None:
    """The folder holding ``postgres`` and ``initdb`` (newest major version wins).

    Debian keeps them in ``/usr/lib/postgresql/<major>/bin``, off PATH; ``pg_config
    --bindir`` names it when the dev package is there.
    """
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out and _has_postgres(Path(out)):
            return Path(out)
    candidates = glob.glob("/usr/lib/postgresql/*/bin")

    def major(path: str) -> float:
        try:
            return float(Path(path).parent.name)
        except ValueError:
            return 0.0

    for candidate in sorted(candidates, key=major, reverse=True):
        if _has_postgres(Path(candidate)):
            return Path(candidate)
    on_path = shutil.which("postgres")
    if on_path and _has_postgres(Path(on_path).resolve().parent):
        return Path(on_path).resolve().parent
    return None


def zookeeper_classpath() -> str | None:
    """The Java class path that runs a ZooKeeper server (Debian's ``zookeeper`` package)."""
    jar = Path("/usr/share/java/zookeeper.jar")
    logger = Path("/usr/share/java/slf4j-simple.jar")
    if jar.is_file() and logger.is_file() and shutil.which("java"):
        return f"{jar}:{logger}"
    return None


def etcd_binary() -> Path | None:
    """``etcd``, the server."""
    return _which("etcd", "/usr/bin/etcd", "/usr/local/bin/etcd")


def etcdctl_binary() -> Path | None:
    """``etcdctl``, the command-line client."""
    return _which("etcdctl", "/usr/bin/etcdctl", "/usr/local/bin/etcdctl")


def odbc_manager() -> str | None:
    """unixODBC's driver manager, which pyodbc loads (multilock-sqlserver's driver tests)."""
    return ctypes.util.find_library("odbc")


def freetds_driver() -> Path | None:
    """FreeTDS's ODBC driver, one SQL Server driver the sqlserver tests can load."""
    return next(iter(sorted(Path("/usr/lib").glob("*/odbc/libtdsodbc.so"))), None)


#: apt package -> how to tell it is installed.
APT_PACKAGES: dict[str, Callable[[], object]] = {
    "redis-server": redis_server_binary,
    "postgresql": postgres_bindir,
    "zookeeper": zookeeper_classpath,
    "etcd-server": etcd_binary,
    "etcd-client": etcdctl_binary,
    "unixodbc": odbc_manager,
    "tdsodbc": freetds_driver,
}
AZURITE_VERSION = "3.35.0"  # 3.37 needs Node 22
APT_TIMEOUT = 900


def missing_apt_packages() -> list[str]:
    """The apt packages whose programs are not found."""
    return [name for name, found in APT_PACKAGES.items() if not found()]


def _privilege_prefix() -> list[str] | None:
    """``[]`` as root, ``["sudo", "-n"]`` with passwordless sudo, None when neither."""
    if os.geteuid() == 0:
        return []
    sudo = shutil.which("sudo")
    if sudo is None:
        return None
    try:
        done = subprocess.run([sudo, "-n", "true"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return [sudo, "-n"] if done.returncode == 0 else None


def _run(argv: list[str], env: dict[str, str] | None = None) -> tuple[bool, str]:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=APT_TIMEOUT, check=False, env=env
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return False, str(exc)
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
    return done.returncode == 0, tail


def install_apt(packages: list[str]) -> bool:
    """``apt-get update`` once, then install *packages*; print what happened."""
    if not packages:
        return True
    apt = shutil.which("apt-get")
    if apt is None:
        print(f"install: cannot install {', '.join(packages)}: apt-get is not available here")
        return False
    prefix = _privilege_prefix()
    if prefix is None:
        print(f"install: cannot install {', '.join(packages)}: not root and no passwordless sudo")
        return False
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if prefix:
        prefix = [*prefix, "env", "DEBIAN_FRONTEND=noninteractive"]
    print(f"install: apt-get install {' '.join(packages)}", flush=True)
    ok, output = _run([*prefix, apt, "update"], env)
    if not ok:
        print(f"install: apt-get update failed:\n{output}")
        return False
    ok, output = _run([*prefix, apt, "install", "-y", *packages], env)
    if not ok:
        print(f"install: apt-get install failed:\n{output}")
        return False
    still = [name for name in packages if not APT_PACKAGES[name]()]
    if still:
        print(f"install: installed, but still not found: {', '.join(still)}")
        return False
    print(f"install: installed {', '.join(packages)}")
    return True


def azurite_dir() -> Path:
    """Where Azurite is (or is to be) installed with npm: $MULTILOCK_AZURITE_DIR or a cache."""
    configured = os.environ.get("MULTILOCK_AZURITE_DIR", "").strip()
    return Path(configured) if configured else Path.home() / ".cache" / "multilock" / "azurite"


def azurite_binary(cache_dir: Path) -> Path:
    """Where `install_azurite` puts ``azurite-blob``."""
    return cache_dir / "node_modules" / ".bin" / "azurite-blob"


def install_azurite(cache_dir: Path) -> Path | None:
    """``npm install azurite`` into *cache_dir*; return ``azurite-blob``, or None (printed why)."""
    binary = azurite_binary(cache_dir)
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None:
        print("install: cannot install Azurite: npm is not available here")
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    print(f"install: npm install azurite@{AZURITE_VERSION} into {cache_dir}", flush=True)
    ok, output = _run(
        [
            npm,
            "install",
            "--prefix",
            str(cache_dir),
            "--no-audit",
            "--no-fund",
            f"azurite@{AZURITE_VERSION}",
        ]
    )
    if not ok or not binary.exists():
        print(f"install: npm install azurite failed:\n{output}")
        return None
    print(f"install: installed Azurite {AZURITE_VERSION}")
    return binary


def main() -> int:
    missing = missing_apt_packages()
    if missing:
        install_apt(missing)
    else:
        print("install: all server binaries are present")
    if shutil.which("azurite-blob") is None:
        install_azurite(azurite_dir())
    return 0


if __name__ == "__main__":
    sys.exit(main())
