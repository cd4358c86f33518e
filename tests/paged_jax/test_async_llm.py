"""AsyncLLM's bounds and its end: at most max_requests unfinished requests (the rest refused at
once), and an engine that dies fails every request it holds, every add still queued and every later
call, so that no caller waits forever. A recording fake engine (test_serve_distributed.Recorder)."""
import asyncio
import threading
import time

import pytest

from paged_jax.sampling_params import SamplingParams
from paged_jax.entrypoints.async_llm import AsyncLLM, EngineBusyError, EngineDeadError
from tests.paged_jax.test_serve_distributed import Recorder

PARAMS = SamplingParams(max_tokens=1)


def test_requests_past_max_requests_are_refused_at_once_and_finished_ones_free_their_places():
    recorder = Recorder()
    llm = AsyncLLM(recorder, max_requests=3)

    async def session():
        held = llm.generate_many([("h0", Recorder.HOLD), ("h1", Recorder.HOLD)], PARAMS)
        with pytest.raises(EngineBusyError, match="2 unfinished requests, its limit is 3"):
            llm.generate_many([("x0", [1]), ("x1", [2])], PARAMS)  # all or none
        done = [out.request_id async for out in llm.generate("a", [1], PARAMS)]  # the third place
        full = llm.num_unfinished
        for stream in held:
            await stream.aclose()  # never started: nothing to abort from here
        return done, full

    assert asyncio.run(session()) == (["a"], 2)
    assert [e[1] for e in recorder.log if e[0] == "add"] == ["h0", "h1", "a"]  # x0, x1 never queued
    llm.shutdown()


class DiesOnStep(Recorder):
    """A Recorder whose engine step raises once `armed` is set."""

    def __init__(self):
        super().__init__()
        self.armed = threading.Event()

    def step(self):
        if self.armed.is_set():
            raise RuntimeError("device lost")
        return super().step()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's own
def test_an_engine_that_dies_fails_held_and_later_requests_within_seconds():
    engine = DiesOnStep()
    llm = AsyncLLM(engine, max_requests=4)

    async def waiting(request_id):
        try:
            async for _ in llm.generate(request_id, Recorder.HOLD, PARAMS):
                pass
        except EngineDeadError as e:
            return str(e)

    async def session():
        clients = [asyncio.create_task(waiting(f"r{i}")) for i in range(3)]
        await asyncio.sleep(0.2)
        engine.armed.set()  # the thread steps while requests are held: its next step raises
        errors = await asyncio.wait_for(asyncio.gather(*clients), 10)
        with pytest.raises(EngineDeadError):
            llm.generate("late", [1], PARAMS)
        return errors

    assert asyncio.run(session()) == ["the engine stopped: RuntimeError('device lost')"] * 3
    assert llm.num_unfinished == 0
    llm.shutdown()  # the dead thread joined here, so its exception is reported in this test, not the next


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_add_queued_as_the_engine_dies_is_failed_not_left_waiting():
    """The add lands after the thread's last look at the queue, before its death is recorded."""
    engine = DiesOnStep()
    llm = AsyncLLM(engine, max_requests=4)

    async def session():
        llm._lock.acquire()  # the dying thread stops inside _fail_all, before `dead` is set
        engine.armed.set()
        llm._send(("abort", "nothing"))  # wakes the thread: no request, so no step...
        engine.held.add("forced")  # ...unless one is unfinished: it steps and raises
        llm._send(("abort", "nothing"))
        await asyncio.sleep(0.3)
        llm._lock.release()
        stream = None
        try:
            stream = llm.generate("raced", [1], PARAMS)
        except EngineDeadError:
            return "refused at the call"
        try:
            return [out async for out in stream]
        except EngineDeadError as e:
            return str(e)

    assert asyncio.run(asyncio.wait_for(session(), 10)) in (
        "refused at the call", "the engine stopped: RuntimeError('device lost')")
    llm.shutdown()


def test_a_duplicate_request_id_is_refused_and_the_first_request_keeps_its_stream():
    recorder = Recorder()
    llm = AsyncLLM(recorder, max_requests=4)

    async def session():
        first = llm.generate("d", Recorder.HOLD, PARAMS)
        with pytest.raises(ValueError, match="request id 'd' is already in use"):
            async for _ in llm.generate("d", [1], PARAMS):
                pass
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(first.__anext__(), 0.2)  # still held; cancelled: aborted
        return llm.num_unfinished

    asyncio.run(session())
    deadline = time.monotonic() + 10
    while llm.num_unfinished and time.monotonic() < deadline:  # the abort is queued: let the thread apply it
        time.sleep(0.01)
    llm.shutdown()
    assert [e for e in recorder.log if e != "step"] == [("add", "d", Recorder.HOLD, recorder.log[0][3], None,
                                                        None),
                                                       ("abort", "d")]
    assert llm.num_unfinished == 0
