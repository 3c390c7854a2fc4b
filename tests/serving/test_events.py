"""The runner's typed job events: their order and what each carries (events.py), without HTTP."""

from __future__ import annotations

import asyncio

import pytest

from moe_offload.engines.base import TokenLogprob
from moe_offload.engines.mock import MockConfig, MockEngine
from moe_offload.engines.params import SamplingParams
from moe_offload.serving.errors import APIError
from moe_offload.serving.events import DoneEvent, ErrorEvent, PromptLogprobsEvent, StartedEvent, TokenEvent
from moe_offload.serving.queue import EngineRunner


def _events(params: SamplingParams, ids=(1, 2, 3)) -> list:
    async def main():
        runner = EngineRunner(MockEngine(MockConfig(ms_per_token=0)))
        try:
            job = runner.submit(list(ids), params)
            deadline = asyncio.get_running_loop().time() + 30
            out = [await job.next(deadline)]
            while not isinstance(out[-1], (DoneEvent, ErrorEvent)):
                out.append(await job.next(deadline))
            return out
        finally:
            await asyncio.get_running_loop().run_in_executor(None, runner.close)

    return asyncio.run(main())


def test_started_then_tokens_then_done_with_stats():
    evs = _events(SamplingParams(max_tokens=5, ignore_eos=True))
    assert isinstance(evs[0], StartedEvent)
    tokens = evs[1:-1]
    assert len(tokens) == 5 and all(isinstance(e, TokenEvent) and e.logprob is None for e in tokens)
    assert [e.t for e in tokens] == sorted(e.t for e in tokens)  # step times never go backwards
    done = evs[-1]
    assert isinstance(done, DoneEvent) and done.stats.completion_tokens == 5
    with pytest.raises(AttributeError):  # frozen: consumers on the event loop may share an event safely
        done.stats = None


def test_logprobs_ride_on_their_tokens_and_prompt_logprobs_come_first():
    evs = _events(SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1))
    assert isinstance(evs[0], StartedEvent)
    assert isinstance(evs[1], PromptLogprobsEvent)
    assert evs[1].logprobs[0] is None and len(evs[1].logprobs) == 3  # the first prompt token has no logprob
    tokens = [e for e in evs if isinstance(e, TokenEvent)]
    assert len(tokens) == 3
    for e in tokens:
        assert isinstance(e.logprob, TokenLogprob) and e.logprob.token == e.token_id and len(e.logprob.top) == 2


def test_an_engine_refusal_is_an_error_event_with_its_http_status():
    # A prompt id beyond the mock's vocabulary is a user error at engine.start: 400, not a crash.
    evs = _events(SamplingParams(max_tokens=2), ids=(10**9,))
    assert isinstance(evs[-1], ErrorEvent) and isinstance(evs[-1].error, APIError) and evs[-1].error.status == 400
