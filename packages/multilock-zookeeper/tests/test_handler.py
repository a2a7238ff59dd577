"""kazoo's callbacks run on the thread that queues them, for the clients the provider builds."""

from __future__ import annotations

import logging
import threading

import pytest

from multilock.zookeeper._watch import Handler


def test_a_callback_runs_on_the_thread_that_queues_it() -> None:
    handler = Handler()
    handler.start()
    try:
        ran: list[int] = []
        handler.completion_queue.put(lambda: ran.append(threading.get_ident()))
        handler.callback_queue.put(lambda: ran.append(threading.get_ident()))
        assert ran == [threading.get_ident()] * 2  # at once, no worker thread involved
    finally:
        handler.stop()


def test_stop_still_reaches_the_workers() -> None:
    before = set(threading.enumerate())
    handler = Handler()
    handler.start()
    workers = set(threading.enumerate()) - before
    handler.stop()
    assert len(workers) == 2
    assert not any(worker.is_alive() for worker in workers)


def test_a_raising_callback_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    handler = Handler()

    def broken() -> None:
        raise ValueError("boom")

    with caplog.at_level(logging.ERROR, logger="multilock.zookeeper._watch"):
        handler.callback_queue.put(broken)
    assert "a kazoo callback raised" in caplog.text
