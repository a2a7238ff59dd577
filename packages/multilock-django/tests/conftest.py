"""Django configured once for this folder's tests, with a probe app whose command records runs.

Django's settings can be configured once per process, so this is a session fixture, and
each test changes ``MULTILOCK`` with ``override_settings`` (a fresh ``memory://`` store
per test: the sync elections share this process, and a named in-memory store is shared
by name).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import django
import pytest
from django.conf import settings
from django.test.utils import override_settings

PROBE_APP = "multilock_django_probe"
#: ``manage.py probe``: records each run (token, thread) in ``RUNS``; options pick a behaviour.
PROBE_COMMAND = """
import threading

from django.core.management.base import BaseCommand, CommandError

from multilock.django import current_leadership

RUNS = []
#: Set by a test to be called (with the leadership) during each run.
HOOK = []


class Command(BaseCommand):
    def add_arguments(self, parser):
        parser.add_argument("--fail-at", type=int, default=0)
        parser.add_argument("--until-lost", action="store_true")
        parser.add_argument("word", nargs="?")

    def handle(self, *args, **options):
        leadership = current_leadership()
        RUNS.append((None if leadership is None else leadership.token,
                     threading.current_thread().name, options["word"]))
        for hook in HOOK:
            hook(leadership)
        if options["until_lost"]:
            leadership.lost.wait()
            leadership.check()
        if options["fail_at"] and len(RUNS) >= options["fail_at"]:
            raise CommandError(f"probe failed at run {len(RUNS)}")
"""


def _write_probe_app(root: Path) -> None:
    app = root / PROBE_APP
    commands = app / "management" / "commands"
    commands.mkdir(parents=True)
    for folder in (app, app / "management", commands):
        (folder / "__init__.py").write_text("")
    (commands / "probe.py").write_text(PROBE_COMMAND)


@pytest.fixture(scope="session", autouse=True)
def django_configured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    root = tmp_path_factory.mktemp("django-apps")
    _write_probe_app(root)
    sys.path.insert(0, str(root))
    try:
        if settings.configured:
            if PROBE_APP not in settings.INSTALLED_APPS:
                pytest.skip("Django was configured elsewhere in this process, without the probe")
        else:
            settings.configure(
                INSTALLED_APPS=["multilock.django", PROBE_APP],
                DATABASES={},
                USE_TZ=True,
                SECRET_KEY="tests-only",
                MULTILOCK={"URL": "memory://"},
            )
            django.setup()
        yield
    finally:
        sys.path.remove(str(root))


@pytest.fixture
def probe() -> Iterator[Any]:
    """The probe command's module, its records cleared."""
    module = sys.modules.get(f"{PROBE_APP}.management.commands.probe")
    if module is None:
        import importlib

        module = importlib.import_module(f"{PROBE_APP}.management.commands.probe")
    module.RUNS.clear()
    module.HOOK.clear()
    yield module
    module.HOOK.clear()


@pytest.fixture
def store_url() -> Iterator[str]:
    """A fresh in-memory store, set as ``MULTILOCK["URL"]`` for the test."""
    url = f"memory://t{uuid.uuid4().hex[:12]}"
    with override_settings(MULTILOCK={"URL": url}):
        yield url
