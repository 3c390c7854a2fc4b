"""Pure pieces: classification, reasoning split, detokenisation with stop strings, pool scoring."""

import random

import pytest

from moe_offload.engines.mock import ByteTokenizer
from moe_offload.serving.classify import CLASSES, classify, request_text
from moe_offload.serving.detok import TextStream
from moe_offload.serving.pool import WorkerPool
from moe_offload.serving.reasoning import ReasoningSplitter, split


@pytest.mark.parametrize(
    "text, cls",
    [
        ("안녕하세요, 오늘 날씨가 좋네요.", "hangul-prose"),
        ("今日はいい天気ですね。", "cjk-prose"),
        ("我们今天去公园散步吧", "cjk-prose"),
        ("The quick brown fox jumps over the lazy dog.", "latin-prose"),
        ("def add(a, b):\n    return a + b\n", "latin-code"),
        ("```\nx = 1\n```", "latin-code"),
        ("이 코드를 한국어로 자세히 설명해 주세요: x = f(y); z = g(x);", "hangul-code"),
        ("", "latin-prose"),
    ],
)
def test_classify(text, cls):
    assert classify(text) == cls
    assert cls in CLASSES


def test_request_text_reads_prompts_and_messages():
    assert request_text({"prompt": ["a", "b"]}) == "a\nb"
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "user", "content": "there"}]}
    assert request_text(body) == "hi\nthere"
    assert request_text({"prompt": [1, 2, 3]}) == "" and request_text("junk") == ""


@pytest.mark.parametrize("prompt", ["", "<|im_start|>assistant\n<think>\n"])
def test_reasoning_stream_matches_whole(prompt):
    reply = "<think>step one, then two</think>\n\nThe answer." if not prompt else "step one</think>\n\nThe answer."
    whole = split(reply, prompt)
    assert whole == ("step one, then two" if not prompt else "step one", "The answer.")
    # Any split into pieces (tags cut in the middle) gives the same result.
    for cut in range(1, 6):
        s = ReasoningSplitter(prompt)
        r = c = ""
        for i in range(0, len(reply), cut):
            dr, dc = s.push(reply[i:i + cut])
            r, c = r + dr, c + dc
        dr, dc = s.finish()
        assert (r + dr, c + dc) == whole


def test_reasoning_absent_is_all_content():
    assert split("plain answer") == ("", "plain answer")
    assert split("<thin") == ("", "<thin")  # not a tag after all


def test_textstream_holds_multibyte_and_cuts_stop():
    tok = ByteTokenizer()
    ts = TextStream(tok)
    out = "".join(ts.push(b) for b in "한글".encode()) + ts.finish()
    assert out == "한글"
    ts = TextStream(tok, stop=["END"])
    pieces = [ts.push(b) for b in b"abc EN"]
    assert "".join(pieces) == "abc "  # "EN" is held: it may start the stop string
    ts.push(ord("D"))
    assert ts.stopped and ts.finish() == "" and ts.text == "abc "


def test_pool_prefers_affinity_minus_load_and_learns():
    pool = WorkerPool(lam=0.1, alpha=0.5, rng=random.Random(0))
    a, b = pool.add("http://a", seed={"all": 0.9}), pool.add("http://b", seed={"all": 0.5})
    assert pool.rank("latin-prose")[0] is a
    a.inflight = 5  # 0.9 - 0.5 < 0.5
    assert pool.rank("latin-prose")[0] is b
    a.inflight = 0
    for _ in range(10):
        pool.feedback(a, "latin-prose", 0.2)
    assert pool.rank("latin-prose")[0] is b and pool.rank("cjk-prose")[0] is a
    for _ in range(3):
        pool.failed(b, "down")
    assert not b.healthy and pool.rank("latin-prose")[-1] is b


def test_pool_breaks_ties_at_random():
    pool = WorkerPool(rng=random.Random(1))
    for u in "abc":
        pool.add(f"http://{u}", seed={"all": 0.7})
    firsts = {pool.rank("latin-prose")[0].url for _ in range(60)}
    assert len(firsts) == 3


def _gauge(text: str, name: str) -> float:
    return float(next(l for l in text.splitlines() if l.startswith(name + "{")).rsplit(" ", 1)[1])


def test_tpot_gauges_are_per_token_percentiles_as_in_the_airm_decode_run():
    # airm_tpot_* means "time per output token" (rm_core METRICS): percentiles over decode steps, the same
    # estimator as the ai-rm decode run -- not over per-request averages, which weigh a 2-token request
    # like a 1000-token one.
    from moe_offload.engines.base import GenerationStats
    from moe_offload.serving.metrics import WorkerMetrics
    from rm_core.metrics import percentile

    m = WorkerMetrics("m", max_model_len=4096)
    long = GenerationStats(token_ms=[10.0] * 98, decode_ms=980.0, hits=1, misses=1)
    short = GenerationStats(token_ms=[100.0, 100.0], decode_ms=200.0, hits=1, misses=1)
    for s in (long, short, short):
        m.observe("latin-prose", s, finish_reason="length", ttft_s=0.01, itl_s=[], e2e_s=1.0)
    steps = long.token_ms + short.token_ms * 2
    text = m.render().decode()
    assert _gauge(text, "airm_tpot_p50_ms") == pytest.approx(percentile(steps, 0.5)) == pytest.approx(10.0)
    assert _gauge(text, "airm_tpot_p90_ms") == pytest.approx(percentile(steps, 0.9))
    assert _gauge(text, "airm_tok_s") == pytest.approx(1000 * len(steps) / sum(steps))


def test_percentile_interpolates():
    from rm_core.metrics import percentile

    assert percentile([], 0.5) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([float(i) for i in range(1, 11)], 0.9) == pytest.approx(9.1)


def test_hit_rate_gauge_has_no_host_tier_series():
    # The engine reports the share of routed pairs per tier, the host's included; on a gauge named hit rate,
    # "host 0.41" reads as a 41 % hit rate when it is the miss share.
    from moe_offload.engines.base import GenerationStats
    from moe_offload.serving.metrics import WorkerMetrics
    from rm_core import MemoryTier

    tiers = [MemoryTier("cpu:0", "host-dram", 2**30, accelerator="vm/cpu:0"), MemoryTier("host", "host-dram", 2**30)]
    m = WorkerMetrics("m", max_model_len=64, tiers=tiers, predicted={"cpu:0": 0.7, "host": 0.3})
    stats = GenerationStats(hits=6, misses=4, hit_rate_by_tier={"cpu:0": 0.6, "host": 0.4})
    m.observe("latin-prose", stats, finish_reason="length", ttft_s=None, itl_s=[], e2e_s=0.1)
    text = m.render().decode()
    assert 'moe_offload_expert_hit_rate{class="all",model_name="m",tier="cpu:0"} 0.6' in text
    assert 'moe_offload_expert_hit_rate_predicted{model_name="m",tier="cpu:0"} 0.7' in text
    assert 'tier="host"' not in "\n".join(l for l in text.splitlines() if l.startswith("moe_offload_expert_hit_rate"))


def test_metrics_show_the_host_memory_plan():
    from moe_offload.hostmem import HostMemory, plan_host
    from moe_offload.serving.metrics import WorkerMetrics

    GiB = 2**30
    plan = plan_host(5 * GiB, GiB, kv_floor=GiB // 4, limit=HostMemory(8 * GiB, "cgroup v2 memory.max of /w"), reserve=GiB)
    text = WorkerMetrics("m", max_model_len=64, cache_info={"memory_plan": plan.split()}).render().decode()
    for part, v in (("limit", 8 * GiB), ("reserve", GiB), ("dense", GiB), ("experts", 5 * GiB), ("kv", GiB)):
        line = f'moe_offload_host_memory_plan_bytes{{experts_tier="host",model_name="m",part="{part}"}} '
        assert float(text.split(line, 1)[1].split()[0]) == v, part
    assert "moe_offload_host_memory_plan_bytes" not in WorkerMetrics("m", max_model_len=64).render().decode()


def test_metrics_say_whether_the_cpu_kernels_run():
    from moe_offload.serving.metrics import WorkerMetrics

    on = {"ok": True, "variant": "avx2", "source": "prebuilt", "error": ""}
    off = {"ok": False, "variant": "avx2", "source": "", "error": "RuntimeError: no compiler"}
    for info, want in ((on, "1.0"), (off, "0.0")):
        text = WorkerMetrics("m", max_model_len=64, cache_info={"kernels": info}).render().decode()
        line = next(x for x in text.splitlines() if x.startswith("moe_offload_cpu_kernels{"))
        assert line.endswith(" " + want) and f'source="{info["source"]}"' in line and 'variant="avx2"' in line
    assert 'reason="RuntimeError: no compiler"' in text


def test_closing_the_runner_aborts_the_running_generation():
    # Shutdown waits for the engine thread; a long generation must not hold it for its whole length.
    import asyncio
    import time

    from moe_offload.engines.mock import MockConfig, MockEngine
    from moe_offload.engines.params import SamplingParams
    from moe_offload.serving.events import StartedEvent
    from moe_offload.serving.queue import EngineRunner

    async def main():
        runner = EngineRunner(MockEngine(MockConfig(ms_per_token=20)))
        job = runner.submit([1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True))  # 20 s if left alone
        assert isinstance(await job.next(asyncio.get_running_loop().time() + 10), StartedEvent)
        t0 = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, runner.close)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 5


@pytest.mark.parametrize("kw", [{"request_timeout": 0}, {"max_queue": -1}, {"max_body_bytes": 0}])
def test_worker_settings_are_config_errors(kw):
    # The CLI prints a ConfigError as one clean line; these used to be ValueErrors ("error: ValueError: ...").
    from moe_offload.engines.mock import MockEngine
    from moe_offload.errors import ConfigError
    from moe_offload.serving.worker import create_app

    with pytest.raises(ConfigError, match=next(iter(kw))):
        create_app(MockEngine(), **kw)


@pytest.mark.parametrize("kw", [{"health_interval": 0}, {"alpha": 5}, {"lam": -1}, {"request_timeout": -1}])
def test_gateway_settings_are_config_errors(kw):
    from moe_offload.errors import ConfigError
    from moe_offload.serving.gateway import create_app

    with pytest.raises(ConfigError):
        create_app([], **kw)
