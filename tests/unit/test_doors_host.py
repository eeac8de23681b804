"""The front doors' host: the asyncio loop on a thread (``LoopThread``) and the mailbox into it (``Mailbox``)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from edge_agent.errors import EdgeAgentError
from edge_agent.serving.doors.host import LoopThread, Mailbox


def test_a_loop_thread_runs_setup_on_its_thread_then_shutdown_before_it_closes():
    seen: list[tuple[str, str]] = []
    host = LoopThread("door")

    async def setup() -> None:
        seen.append(("setup", threading.current_thread().name))

    async def shutdown() -> None:
        seen.append(("shutdown", threading.current_thread().name))

    host.start(setup, shutdown, "the door could not open")
    assert seen == [("setup", "door")]
    assert host.ticks >= 1  # the first tick is before start returns
    assert host.loop is not None and host.loop.is_running()
    host.stop()
    assert seen == [("setup", "door"), ("shutdown", "door")]
    assert host.loop.is_closed()
    host.stop()  # a second stop finds the loop closed and does nothing


def test_a_setup_that_fails_fails_the_start_with_the_doors_message():
    host = LoopThread("door")

    async def setup() -> None:
        raise OSError("address already in use")

    async def shutdown() -> None:
        raise AssertionError("a door that never listened has nothing to shut down")

    with pytest.raises(EdgeAgentError, match=r"^the door could not listen: address already in use$"):
        host.start(setup, shutdown, "the door could not listen")
    assert host.loop is not None and host.loop.is_closed()
    host.stop()


def test_a_loop_thread_never_started_stops_quietly():
    LoopThread("door").stop()


def test_posts_from_threads_arrive_in_each_threads_order():
    loop = asyncio.new_event_loop()
    try:
        box: Mailbox[tuple[int, int] | None] = Mailbox(loop)
        go = threading.Event()

        def producer(k: int) -> None:
            go.wait()
            for i in range(200):
                box.post((k, i))

        threads = [threading.Thread(target=producer, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        go.set()
        for t in threads:
            t.join()
        box.post(None)  # behind every post above: they all happened before it

        async def read() -> list[tuple[int, int] | None]:
            got = []
            while (item := await box.get()) is not None:
                got.append(item)
            return got

        got = loop.run_until_complete(read())
    finally:
        loop.close()
    for k in range(3):
        assert [i for kk, i in got if kk == k] == list(range(200))
    assert len(got) == 600


def test_a_put_on_the_loop_goes_ahead_of_a_post_still_on_its_way():
    loop = asyncio.new_event_loop()
    box: Mailbox[str] = Mailbox(loop)

    async def order() -> list[str]:
        box.post("posted")  # reaches the queue when the loop next runs its callbacks
        box.put("put")
        return [await box.get(), await box.get()]

    try:
        assert loop.run_until_complete(order()) == ["put", "posted"]
    finally:
        loop.close()


def test_a_post_after_the_loop_closed_is_dropped_and_clear_empties_the_queue():
    loop = asyncio.new_event_loop()
    box: Mailbox[int] = Mailbox(loop)

    async def fill_then_clear() -> bool:
        for i in range(3):
            box.put(i)
        box.clear()
        box.put(7)
        return await box.get() == 7

    assert loop.run_until_complete(fill_then_clear())
    loop.close()
    box.post(1)  # the door stopped: nobody reads, and the device thread that posts must not fail
