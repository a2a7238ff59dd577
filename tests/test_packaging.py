"""Every distribution under packages/ builds a clean wheel that shares the namespace.

Packages are discovered from ``packages/*/pyproject.toml``, so a new backend is checked
without touching this file. The wheels are built once per session, in parallel, with the
build backend (hatchling) called directly in this interpreter's environment: no network
and no isolated build env, so it stays fast.
"""

from __future__ import annotations

import ast
import concurrent.futures
import configparser
import importlib
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The public repository: every Project-URL of every distribution lives under it.
REPOSITORY = "https://github.com/multilock/multilock"
LICENSE = (ROOT / "LICENSE").read_bytes()
PACKAGE_DIRS = sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))
CORE = "multilock-core"
#: Distributions that register no provider: core (built in) and the command line.
#: Integrations with frameworks and metrics systems: they use providers, register none.
INTEGRATIONS = {
    "multilock-apscheduler",
    "multilock-celery",
    "multilock-django",
    "multilock-opentelemetry",
    "multilock-prometheus",
    "multilock-starlette",
}
NO_PROVIDER = {CORE, "multilock-cli", *INTEGRATIONS}
CLI = "multilock-cli"
#: The only file a distribution may put at the namespace level: ``python -m multilock``
#: (a namespace portion may hold a ``__main__.py``, never an ``__init__.py``).
NAMESPACE_FILES = {CLI: ["__main__.py"]}

_BUILD = "import sys; from hatchling.build import build_wheel; print(build_wheel(sys.argv[1]))"


@attrs.frozen
class Package:
    path: Path
    pyproject: dict[str, Any]

    @property
    def dist(self) -> str:
        return str(self.pyproject["project"]["name"])

    @property
    def version(self) -> str:
        return str(self.pyproject["project"]["version"])

    @property
    def import_name(self) -> str:
        """``multilock-azure-blob`` ships ``multilock.azure_blob``."""
        return self.dist.removeprefix("multilock-").replace("-", "_")


def _load(path: Path) -> Package:
    return Package(path, tomllib.loads((path / "pyproject.toml").read_text(encoding="utf-8")))


PACKAGES = [_load(p) for p in PACKAGE_DIRS]
IDS = [p.path.name for p in PACKAGES]
BY_NAME = {p.dist: p for p in PACKAGES}


@attrs.frozen
class Built:
    package: Package
    wheel: Path | None
    error: str

    def open(self) -> zipfile.ZipFile:
        if self.wheel is None:
            pytest.fail(f"building the wheel of {self.package.dist} failed:\n{self.error}")
        return zipfile.ZipFile(self.wheel)


def _build(package: Package, outdir: Path) -> Built:
    out = outdir / package.path.name
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD, str(out)],
        cwd=package.path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    wheels = list(out.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        return Built(package, None, proc.stdout + proc.stderr)
    return Built(package, wheels[0], "")


@pytest.fixture(scope="session")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    pytest.importorskip("hatchling.build", reason="hatchling (the build backend) is needed")
    outdir = tmp_path_factory.mktemp("wheels")
    workers = max(1, min(len(PACKAGES), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        built = list(pool.map(lambda p: _build(p, outdir), PACKAGES))
    return {b.package.dist: b for b in built}


def _dist_info(zf: zipfile.ZipFile) -> str:
    roots = {n.split("/", 1)[0] for n in zf.namelist() if ".dist-info/" in n}
    assert len(roots) == 1, f"expected one .dist-info folder, found {sorted(roots)}"
    return roots.pop()


def _metadata(zf: zipfile.ZipFile) -> dict[str, str]:
    text = zf.read(f"{_dist_info(zf)}/METADATA").decode()
    headers = text.split("\n\n", 1)[0]
    return dict(line.split(": ", 1) for line in headers.splitlines() if ": " in line)


def _project_urls(zf: zipfile.ZipFile) -> dict[str, str]:
    """The ``Project-URL: Label, url`` headers (a header that repeats, so not in `_metadata`)."""
    text = zf.read(f"{_dist_info(zf)}/METADATA").decode()
    headers = text.split("\n\n", 1)[0]
    urls = {}
    for line in headers.splitlines():
        if line.startswith("Project-URL: "):
            label, _, url = line.removeprefix("Project-URL: ").partition(", ")
            urls[label] = url
    return urls


def _long_description(zf: zipfile.ZipFile) -> str:
    """The body of METADATA: the README, as PyPI shows it."""
    text = zf.read(f"{_dist_info(zf)}/METADATA").decode()
    return text.split("\n\n", 1)[1] if "\n\n" in text else ""


def _entry_points(zf: zipfile.ZipFile) -> dict[str, dict[str, str]]:
    name = f"{_dist_info(zf)}/entry_points.txt"
    if name not in zf.namelist():
        return {}
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keep case
    parser.read_string(zf.read(name).decode())
    return {s: dict(parser[s]) for s in parser.sections()}


def _top_level_names(source: str) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return names


def _static_version(source: str) -> str | None:
    """The literal ``__version__ = "..."`` of a module, if it has one."""
    for node in ast.parse(source).body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    return None


def test_packages_found() -> None:
    assert CORE in BY_NAME, f"no {CORE} among {sorted(BY_NAME)}"
    for package in PACKAGES:
        assert package.path.name == package.dist, (
            f"folder {package.path.name} holds the distribution {package.dist}"
        )


# ---------------------------------------------------------------- source tree checks
@pytest.mark.parametrize("package", PACKAGES, ids=IDS)
def test_license_copy_matches_root(package: Package) -> None:
    copy = package.path / "LICENSE"
    assert copy.is_file(), f"{package.dist} has no LICENSE copy"
    assert copy.read_bytes() == LICENSE, f"{copy} differs from the root LICENSE"


@pytest.mark.parametrize("package", PACKAGES, ids=IDS)
def test_namespace_has_no_init_or_marker(package: Package) -> None:
    namespace = package.path / "src" / "multilock"
    for stray in ("__init__.py", "py.typed"):
        assert not (namespace / stray).exists(), (
            f"{namespace / stray} breaks the PEP 420 namespace multilock: delete it"
        )
    files = sorted(p.name for p in namespace.iterdir() if p.is_file())
    assert files == NAMESPACE_FILES.get(package.dist, []), (
        f"{package.dist} ships {files} at the namespace level src/multilock/: only "
        f"multilock-cli's __main__.py belongs there"
    )
    subpackages = sorted(
        p.name for p in namespace.iterdir() if p.is_dir() and p.name != "__pycache__"
    )
    assert subpackages == [package.import_name], (
        f"{package.dist} should hold only src/multilock/{package.import_name}, found {subpackages}"
    )
    assert (namespace / package.import_name / "py.typed").is_file()


@pytest.mark.parametrize("package", PACKAGES, ids=IDS)
def test_pyproject_shape(package: Package) -> None:
    project = package.pyproject["project"]
    wheel_target = package.pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert wheel_target["packages"] == ["src/multilock"]
    assert project.get("license-files") == ["LICENSE"], "ship the package's own LICENSE copy"
    assert project.get("requires-python") == ">=3.11"
    tools = set(package.pyproject.get("tool", {}))
    assert not tools & {"pytest", "ruff", "mypy"}, (
        f"{package.dist} has its own {sorted(tools & {'pytest', 'ruff', 'mypy'})} settings: "
        "they silently replace the root pyproject's; keep them only at the root"
    )


@pytest.mark.parametrize(
    "package", [p for p in PACKAGES if p.dist != CORE], ids=[i for i in IDS if i != CORE]
)
def test_backend_pins_compatible_core(package: Package) -> None:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    major, minor = (int(x) for x in BY_NAME[CORE].version.split(".")[:2])
    assert major == 0, "update this test's pin rule for core 1.x"
    expected = SpecifierSet(f">={major}.{minor},<{major}.{minor + 1}")
    pins = [
        Requirement(dep)
        for dep in package.pyproject["project"].get("dependencies", [])
        if Requirement(dep).name == CORE
    ]
    assert len(pins) == 1, f"{package.dist} must depend on {CORE} exactly once"
    assert pins[0].specifier == expected, (
        f"{package.dist} pins {CORE}{pins[0].specifier}; expected {CORE}{expected}"
    )


# ---------------------------------------------------------------- wheel checks
@pytest.mark.parametrize("package", PACKAGES, ids=IDS)
def test_wheel_contents(package: Package, wheels: dict[str, Built]) -> None:
    with wheels[package.dist].open() as zf:
        names = zf.namelist()
        info = _dist_info(zf)
        prefix = f"multilock/{package.import_name}/"
        assert "multilock/__init__.py" not in names
        assert "multilock/py.typed" not in names
        allowed = [f"multilock/{name}" for name in NAMESPACE_FILES.get(package.dist, [])]
        strays = [n for n in names if not n.startswith((prefix, f"{info}/")) and n not in allowed]
        assert not strays, f"files outside {prefix} and {info}/: {strays}"
        assert f"{prefix}__init__.py" in names
        assert f"{prefix}py.typed" in names
        assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
        licenses = [n for n in names if n.startswith(f"{info}/") and "LICENSE" in n.split("/")[-1]]
        assert licenses, f"no LICENSE in {info}"
        for name in licenses:
            assert zf.read(name) == LICENSE, f"{name} differs from the root LICENSE"


@pytest.mark.parametrize("package", PACKAGES, ids=IDS)
def test_wheel_versions_agree(package: Package, wheels: dict[str, Built]) -> None:
    built = wheels[package.dist]
    with built.open() as zf:
        metadata = _metadata(zf)
        assert metadata["Name"] == package.dist
        assert metadata["Version"] == package.version
        assert built.wheel is not None
        normalized = re.sub(r"[-_.]+", "_", package.dist).lower()
        assert built.wheel.name.startswith(f"{normalized}-{package.version}-")
        init = zf.read(f"multilock/{package.import_name}/__init__.py").decode()
        version = _static_version(init)
        if version is not None:
            assert version == package.version, (
                f"multilock.{package.import_name}.__version__ is {version}, "
                f"pyproject says {package.version}"
            )


@pytest.mark.parametrize("package", PACKAGES, ids=IDS)
def test_provider_entry_points_resolve(package: Package, wheels: dict[str, Built]) -> None:
    with wheels[package.dist].open() as zf:
        providers = _entry_points(zf).get("multilock.providers", {})
        if package.dist not in NO_PROVIDER:
            assert providers, f"{package.dist} registers no multilock.providers entry point"
        for scheme, target in providers.items():
            assert re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme), f"bad URL scheme {scheme!r}"
            module, _, attr = target.strip().partition(":")
            assert attr, f"{scheme} = {target}: want module:Class"
            assert "." not in attr, f"{scheme} = {target}: want module:Class"
            assert module.startswith(f"multilock.{package.import_name}"), (
                f"{scheme} = {target} points outside multilock.{package.import_name}"
            )
            # Statically, in the wheel: the module is shipped and defines the name.
            candidates = [
                module.replace(".", "/") + ".py",
                module.replace(".", "/") + "/__init__.py",
            ]
            source = next((zf.read(c).decode() for c in candidates if c in zf.namelist()), None)
            assert source is not None, f"{scheme} = {target}: {module} is not in the wheel"
            assert attr in _top_level_names(source), f"{module} defines no {attr}"


PROVIDER_PACKAGES = [p for p in PACKAGES if p.dist == CORE or p.dist not in NO_PROVIDER]


@pytest.mark.parametrize("package", PROVIDER_PACKAGES, ids=[p.path.name for p in PROVIDER_PACKAGES])
def test_provider_entry_points_import(package: Package, wheels: dict[str, Built]) -> None:
    """Import each entry point's target here, where the packages are installed editable."""
    from multilock.core import Provider

    with wheels[package.dist].open() as zf:
        providers = _entry_points(zf).get("multilock.providers", {})
    assert providers, f"{package.dist} registers no provider"
    try:
        importlib.metadata.distribution(package.dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{package.dist} is not installed in this environment")
    for scheme, target in providers.items():
        module_name, _, attr = target.strip().partition(":")
        module = importlib.import_module(module_name)
        obj = getattr(module, attr, None)
        assert isinstance(obj, type), f"{scheme} = {target} is not a class"
        assert issubclass(obj, Provider), f"{scheme} = {target} is not a Provider"
        assert callable(getattr(obj, "from_url", None)), f"{target} has no from_url"


def test_cli_console_script(wheels: dict[str, Built]) -> None:
    """multilock-cli installs the ``multilock`` command and nothing under the provider group."""
    with wheels["multilock-cli"].open() as zf:
        points = _entry_points(zf)
    assert points.get("console_scripts", {}).get("multilock", "").startswith("multilock.cli")
    assert "multilock.providers" not in points


def test_cli_wheel_ships_python_dash_m_multilock(wheels: dict[str, Built]) -> None:
    """``multilock/__main__.py`` is in the multilock-cli wheel, next to (not in) the namespace."""
    with wheels[CLI].open() as zf:
        names = zf.namelist()
        assert "multilock/__main__.py" in names
        assert "multilock/__init__.py" not in names
        source = zf.read("multilock/__main__.py").decode()
    assert "main" in _top_level_names(source), source
    assert "multilock.cli" in source, source


def test_python_dash_m_multilock_runs_the_command(tmp_path: Path) -> None:
    """``python -m multilock`` is the ``multilock`` command, and multilock stays a namespace."""
    namespace = importlib.util.find_spec("multilock")
    assert namespace is not None
    assert namespace.origin in (None, "namespace"), f"multilock is not a namespace: {namespace}"
    result = subprocess.run(
        [sys.executable, "-m", "multilock", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: multilock "), result.stdout
    for command in ("demo", "run", "status", "watch"):
        assert re.search(rf"^  {command} ", result.stdout, re.M), result.stdout


# ---------------------------------------------------------------- what PyPI shows
#: Summaries that tools write when nobody wrote one.
PLACEHOLDERS = ("add your description here", "todo", "tbd", "placeholder", "lorem ipsum")


@pytest.mark.parametrize("package", PACKAGES, ids=IDS)
def test_wheel_project_urls(package: Package, wheels: dict[str, Built]) -> None:
    with wheels[package.dist].open() as zf:
        urls = _project_urls(zf)
    assert {"Homepage", "Source"} <= set(urls), f"{package.dist} has Project-URLs {urls}"
    for label, url in urls.items():
        assert url.startswith(REPOSITORY), f"{package.dist} {label} {url} is not under {REPOSITORY}"
    # Source and Documentation lead to this distribution's folder, not just to the repository.
    folder = f"/packages/{package.dist}"
    assert folder in urls["Source"], f"{package.dist} Source {urls['Source']}"
    if "Documentation" in urls:
        assert folder in urls["Documentation"], f"{package.dist} Documentation"


@pytest.mark.parametrize("package", PACKAGES, ids=IDS)
def test_wheel_summary_says_what_it_does(package: Package, wheels: dict[str, Built]) -> None:
    with wheels[package.dist].open() as zf:
        summary = _metadata(zf).get("Summary", "").strip()
    assert 40 <= len(summary) <= 200, f"{package.dist} Summary {summary!r}: one real sentence"
    assert summary.casefold() not in {package.dist, package.import_name, "multilock"}
    assert not any(p in summary.casefold() for p in PLACEHOLDERS), summary
    assert summary.endswith("."), f"{package.dist} Summary {summary!r}: one sentence"


@pytest.mark.parametrize("package", PACKAGES, ids=IDS)
def test_wheel_long_description(package: Package, wheels: dict[str, Built]) -> None:
    with wheels[package.dist].open() as zf:
        content_type = _metadata(zf).get("Description-Content-Type", "")
        description = _long_description(zf)
    assert content_type.startswith("text/markdown"), content_type
    lines = [line for line in description.splitlines() if line.strip()]
    assert len(lines) > 10, f"{package.dist}'s PyPI description has {len(lines)} lines"
    assert description.lstrip().startswith(f"# {package.dist}"), description[:80]
    assert re.search(r"\]\(https://[^)\s]+\)", description), (
        f"{package.dist}'s PyPI description links nowhere"
    )
    if package.dist == CORE:  # core's page is where pip users land: lead them to the guide
        assert f"]({REPOSITORY}#readme)" in description, (
            f"{CORE}'s description must link to the project README, {REPOSITORY}#readme"
        )
