"""`predict --hardware` against published results (issue 12, 4): what the cost model explains, and what it cannot.

The models are test data (tests/control/data/*/config.json); the machines are the built-in hardware profiles,
whose numbers are datasheet peaks times efficiency factors stated in control/data/hardware/*.json. Nothing here is
fitted to the figures: where a figure is not explained, the test says which assumption breaks and holds that.

(a) the NPU design: a 100B routed MoE (bf16, 205 GB) on 2x Xeon Silver 4410Y + two 47.5 GiB RNGD cards:
    28.7 ms/token with 82-89 % of routed tokens on resident experts (44 % of experts resident), static misses
    (cold experts computed on the host); 435 ms/token with every expert on the host.
(b) the GPU design: Qwen1.5-MoE-A2.7B (14.3B, bf16) on an RTX 3060 12 GB, PCIe 3.0 x16, LRU slot cache:
    ~15 % of experts resident, ~1.4 GB of misses per token, 7.9 tok/s; experts in int8 (q8_0), ~40 % resident,
    18.0 tok/s.
"""

import json
from pathlib import Path

import pytest

from moe_offload.cli import main
from moe_offload.control import placement as P
from moe_offload.control.costmodel import predict
from moe_offload.control.hardware import BUILTIN
from moe_offload.control.spec import ModelSpec

DATA = Path(__file__).parent / "data"
MOE_100B = DATA / "moe-100b-npu"
QWEN15 = DATA / "qwen1.5-moe-a2.7b"
WITHIN = 0.25


def _predict_cli(capsys, *args) -> dict:
    assert main(["predict", *map(str, args), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["label"] == "predicted"
    (pred,) = out["predictions"]
    return pred


def test_the_models_are_the_published_sizes():
    big = ModelSpec.from_hf_config(MOE_100B)
    # 205 GB as published; the attention shape is assumed (see the config's _comment), the experts are as stated
    assert big.total_bytes == pytest.approx(205e9, rel=0.01)
    assert (big.num_moe_layers, big.num_experts, big.top_k, big.num_shared_experts) == (48, 128, 8, 1)
    qwen = ModelSpec.from_hf_config(QWEN15)
    assert qwen.total_params == pytest.approx(14.3e9, rel=0.01) and qwen.active_params == pytest.approx(2.7e9, rel=0.02)


def test_npu_budget_gives_the_published_resident_share(capsys):
    # Two 47.5 GiB cards hold the dense weights, a 4096-token KV cache and 57 of 128 experts per layer: 44.5 %,
    # the published 44 %. An independent check of the model's bytes against the published setup.
    assert main(["budget", "--model", str(MOE_100B), "--hardware", "rngd-2x-xeon4410y", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["resident_fraction"] == pytest.approx(0.44, abs=0.01)


@pytest.mark.parametrize("hit", [0.82, 0.855, 0.89])
def test_npu_hybrid_28_7_ms(capsys, hit):
    # Static misses: per layer max(device experts, host experts) + dense weights on the card + fixed overheads.
    # Host experts at 120 GB/s (one socket's 12 cores x 10 GB/s), cards at 0.8 x 1.5 TB/s. Predicted 34.2 / 30.7 /
    # 27.2 ms at 82 / 85.5 / 89 % against the published 28.7 ms for the range.
    p = _predict_cli(capsys, "--model", MOE_100B, "--hardware", "rngd-2x-xeon4410y", "--fraction", "0.44",
                     "--policy", "static", "--hit-rate", hit)
    assert p["ms_per_token"] == pytest.approx(28.7, rel=WITHIN), p


def test_npu_two_cards_split_per_layer(capsys):
    # The NPU design's per-layer split on two cards: card A (attention, the shared expert) ~175 us, then card B's hot
    # experts ~240 us and the CPU's cold experts ~237 us concurrently. Predicted at the 89 % end of its hit range:
    # A 175 us (the dense weights on the card), B 187 us, CPU 231 us, and B overlaps the CPU (the layer costs
    # A + max(B, CPU)), which gives the 28.7 ms total above.
    p = _predict_cli(capsys, "--model", MOE_100B, "--hardware", "rngd-2x-xeon4410y", "--fraction", "0.44",
                     "--policy", "static", "--hit-rate", 0.89)
    layers = ModelSpec.from_hf_config(MOE_100B).num_layers
    a, b, cpu = (p[k] * 1000 / layers for k in ("dense_ms", "device_experts_ms", "host_experts_ms"))
    assert a == pytest.approx(175, rel=WITHIN) and b == pytest.approx(240, rel=WITHIN), p
    assert cpu == pytest.approx(237, rel=WITHIN), p
    assert -p["overlap_ms"] == pytest.approx(min(b, cpu) * layers / 1000, rel=1e-6)
    # plan puts the hot experts on both cards: fewer slots on the card that also holds the dense weights
    assert main(["plan", "--model", str(MOE_100B), "--hardware", "rngd-2x-xeon4410y", "--json"]) == 0
    lp = json.loads(capsys.readouterr().out)["placement"]["layers"][0]
    assert 0 < lp["slots"]["rngd:0"] < lp["slots"]["rngd:1"]
    assert lp["home"].count("rngd:0") == lp["slots"]["rngd:0"] and lp["home"].count("rngd:1") == lp["slots"]["rngd:1"]


def test_npu_all_host_435_ms_is_not_explained(capsys):
    # NOT EXPLAINED. With every expert on the host the model predicts ~117 ms/token, not 435. The published pair
    # cannot both come from one host whose expert time is bytes / a sustained bandwidth (the cost model's
    # assumption): 435 ms for 48 x 8 experts of 31.5 MB is 28 GB/s of host experts, 11 % of one socket's
    # DDR5-4000 peak, while 28.7 ms with 11-18 % of those experts on the host needs at least 1.3 GB / 28.7 ms =
    # 46 GB/s even if nothing else took time. So the all-host run was bound by something the model does not
    # have (fewer threads, NUMA-remote reads, or experts not fitting in host DRAM: the publication does not
    # say). The test holds both halves: the prediction from the datasheet profile, and that no host bandwidth
    # puts both figures within 25 %.
    p = _predict_cli(capsys, "--model", MOE_100B, "--hardware", "rngd-2x-xeon4410y", "--fraction", "0",
                     "--policy", "static")
    assert p["ms_per_token"] == pytest.approx(117, rel=0.05), p
    assert p["ms_per_token"] < 435 * (1 - WITHIN)

    spec = ModelSpec.from_hf_config(MOE_100B)
    base = BUILTIN["rngd-2x-xeon4410y"].calibration()
    tiers = BUILTIN["rngd-2x-xeon4410y"].tiers()
    def ms(fraction, bw, hit=None):
        pl = P.from_fraction(spec, tiers, fraction, P.for_miss_policy("static", P.fraction_slots(spec, fraction), 128))
        return predict(spec, pl, "static", base.with_values(host_expert_bytes_per_s=bw), hit_rates=hit).ms_per_token

    both = [bw for bw in (x * 1e9 for x in range(5, 500, 5))
            if abs(ms(0.0, bw) / 435 - 1) <= WITHIN and abs(ms(0.44, bw, 0.89) / 28.7 - 1) <= WITHIN]
    assert both == []
    assert any(abs(ms(0.0, x * 1e9) / 435 - 1) <= WITHIN for x in range(5, 500, 5))  # 435 alone is reachable


def test_rtx3060_bf16_lru_7_9_tok_s(capsys):
    # 9 of 60 slots per layer, uniform routing: 15 % hits, 81.6 fetches of 17.3 MB = 1.41 GB per token over PCIe 3.0
    # at 0.8 x 15.75 GB/s = 112 ms, + experts and dense weights from GDDR6 (16.5 ms) + overheads (4.1 ms).
    p = _predict_cli(capsys, "--model", QWEN15, "--hardware", "rtx3060-pcie3", "--fraction", "0.15", "--policy", "lru")
    assert p["bytes_moved_per_token"] == pytest.approx(1.4e9, rel=WITHIN), p
    assert p["ms_per_token"] == pytest.approx(1000 / 7.9, rel=WITHIN), p


def test_rtx3060_int8_lru_18_tok_s(capsys):
    # q8_0 experts (34 bytes per 32 weights): 9.19 MB each; 24 of 60 slots, 40 % hits: 0.53 GB per token over the
    # bus (42 ms) + 14 ms on the card + overheads. The dense weights stay bf16 (only the experts are int8).
    p = _predict_cli(capsys, "--model", QWEN15, "--hardware", "rtx3060-pcie3", "--fraction", "0.4", "--policy", "lru",
                     "--expert-dtype", "q8_0")
    assert p["ms_per_token"] == pytest.approx(1000 / 18.0, rel=WITHIN), p
    assert any("q8_0" in a for a in p["assumptions"])
