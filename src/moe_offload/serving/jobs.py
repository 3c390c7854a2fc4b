"""One generation as the event loop sees it (Job), and the hand-over of the engine thread's events to it.

    engine thread: Job.push(event) / _deliver(a step's events) --loop.call_soon_threadsafe, one wake-up per loop-->
    event loop: await Job.next(deadline) --> StartedEvent, PromptLogprobsEvent?, TokenEvent ..., DoneEvent | ErrorEvent
"""

from __future__ import annotations

import asyncio
import threading

from moe_offload.engines.params import SamplingParams
from moe_offload.serving.errors import APIError
from moe_offload.serving.events import JobEvent


class Job:
    """One generation as seen from the event loop: ``await next()`` gives the events of events.py: StartedEvent,
    PromptLogprobsEvent (when the request asked), TokenEvent ..., then DoneEvent or ErrorEvent."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ids: list[int], params: SamplingParams):
        self.loop, self.ids, self.params = loop, ids, params
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.sent = 0  # tokens pushed (engine thread)
        self.prompt_sent = False
        self.started = False

    def push(self, item: JobEvent) -> None:  # engine thread
        _deliver([(self, item)])

    def cancel(self) -> None:
        self.cancelled.set()

    async def next(self, deadline: float) -> JobEvent:
        """The next event; raises 504 at ``deadline`` (loop.time()) and cancels the generation."""
        remaining = deadline - self.loop.time()
        try:
            if remaining <= 0:
                raise TimeoutError
            return await asyncio.wait_for(self.events.get(), remaining)
        except TimeoutError:
            self.cancel()
            raise APIError(504, "request timed out (the worker's --request-timeout)", code="timeout") from None


def _deliver(items: list[tuple[Job, JobEvent]]) -> None:
    """Hand a step's events to their jobs' event loops: one wake-up per loop, not one per token (engine thread)."""
    by_loop: dict = {}
    for job, item in items:
        by_loop.setdefault(job.loop, []).append((job, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            for job, _ in batch:
                job.cancelled.set()


def _put_all(batch: list[tuple[Job, JobEvent]]) -> None:
    for job, item in batch:
        job.events.put_nowait(item)
