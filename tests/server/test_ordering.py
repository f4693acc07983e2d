"""The per-model command log and the futures store: seq_id order whatever the arrival order,
dedupe of resubmissions, a gap that never fills, errors as results, long-poll timeouts."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from furlong.errors import InputError
from furlong.server.futures import Failure, FutureStore
from furlong.server.ordering import CommandLog


def run(coro):
    return asyncio.run(coro)


def test_operations_run_in_seq_order_and_resubmissions_dedupe() -> None:
    async def main() -> None:
        store, ran = FutureStore(poll_timeout=5), []
        log = CommandLog(store, ThreadPoolExecutor(1), "me", first_seq=1)

        def op(n: int):
            return lambda: ran.append(n) or {"n": n}

        ids = {seq: log.submit(seq, op(seq)) for seq in (3, 2)}  # chunk 0 arrives last
        await asyncio.sleep(0.05)
        assert ran == []  # nothing runs before seq 1
        ids[1] = log.submit(1, op(1))
        assert log.submit(2, op(99)) == ids[2]  # a retry returns the original request id
        results = [await store.wait(ids[s]) for s in (1, 2, 3)]
        assert ran == [1, 2, 3]
        assert [r for _, r in results] == [{"n": 1}, {"n": 2}, {"n": 3}]
        assert await store.wait(ids[2]) == (True, {"n": 2})  # retrievable more than once

    run(main())


def test_errors_are_results_and_the_log_moves_on() -> None:
    async def main() -> None:
        store = FutureStore(poll_timeout=5)
        log = CommandLog(store, ThreadPoolExecutor(1), "me", first_seq=1)

        def bad_input():
            raise InputError("data[0]: nope")

        def crash():
            raise RuntimeError("boom")

        a, b, c = log.submit(1, bad_input), log.submit(2, crash), log.submit(3, lambda: {"ok": 1})
        assert (await store.wait(a))[1] == Failure("data[0]: nope", "user")
        assert (await store.wait(b))[1] == Failure("RuntimeError: boom", "server")
        assert (await store.wait(c))[1] == {"ok": 1}

    run(main())


def test_a_gap_that_never_fills_fails_what_waits_behind_it() -> None:
    async def main() -> None:
        store = FutureStore(poll_timeout=5)
        log = CommandLog(store, ThreadPoolExecutor(1), "me", first_seq=1, gap_timeout=0.1)
        waiting = log.submit(2, lambda: {"ran": True})  # seq 1 never comes
        done, result = await store.wait(waiting)
        assert done and isinstance(result, Failure)
        assert "seq_id 1 never arrived" in result.error and result.category == "user"
        assert (await store.wait(log.submit(3, lambda: {"n": 3})))[1] == {"n": 3}

    run(main())


def test_a_pending_poll_times_out_with_try_again() -> None:
    async def main() -> None:
        store = FutureStore(poll_timeout=0.05)
        request_id = store.create("me")
        assert await store.wait(request_id) == (False, None)
        store.resolve(request_id, b"proto")
        assert await store.wait(request_id) == (True, b"proto")
        assert store.owner(request_id) == "me" and store.owner("other") is None

    run(main())
