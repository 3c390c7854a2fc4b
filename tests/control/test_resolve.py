"""control.resolve: the placement an engine loads with, from a placement, a JSON file or a fraction (no torch)."""

import pytest

from moe_offload.control import placement as P
from moe_offload.control.resolve import resolve_placement
from moe_offload.errors import ConfigError


def _never():
    raise AssertionError("a given placement must not read the checkpoint or the backend")


def test_a_fraction_gives_slots_per_layer_on_the_first_accelerator(spec, one_tier):
    # spec: 8 MoE layers x 32 experts, top-4
    p = resolve_placement(None, 0.25, "static", spec=lambda: spec, tiers=lambda: one_tier)
    assert [lp.layer for lp in p.layers] == list(spec.moe_layers)
    assert all(lp.slots["gpu0"] == 8 and lp.pinned("gpu0") == list(range(8)) for lp in p.layers)  # static pins
    lru = resolve_placement(None, 0.25, "lru", spec=lambda: spec, tiers=lambda: one_tier)
    assert lru.layers[0].dynamic("gpu0") == 8 and lru.layers[0].pinned("gpu0") == []
    hybrid = resolve_placement(None, 0.25, "hybrid", spec=lambda: spec, tiers=lambda: one_tier)
    assert len(hybrid.layers[0].pinned("gpu0")) == 4 and hybrid.layers[0].dynamic("gpu0") == 4  # half pinned


def test_no_fraction_means_every_expert_resident(spec, one_tier):
    p = resolve_placement(None, None, "lru", spec=lambda: spec, tiers=lambda: one_tier)
    assert p.layers[0].slots["gpu0"] == 32 and p.layers[0].dynamic("gpu0") == 0  # nothing can miss: all pinned


def test_a_placement_or_its_file_is_taken_as_given(spec, one_tier, tmp_path):
    given = P.from_fraction(spec, one_tier, 0.5)
    assert resolve_placement(given, None, "static", spec=_never, tiers=_never) is given
    file = tmp_path / "p.json"
    file.write_text(given.to_json())
    assert resolve_placement(str(file), None, "static", spec=_never, tiers=_never) == given
    assert resolve_placement(file, None, "static", spec=_never, tiers=_never) == given


@pytest.mark.parametrize(("placement", "fraction", "match"), [
    ("p.json", 0.5, "give either a placement or a fraction, not both"),
    (None, 1.5, r"fraction: expected a number in 0\.\.1, got 1\.5"),
    (None, True, r"fraction: expected a number in 0\.\.1, got True"),
    (None, "half", r"fraction: expected a number in 0\.\.1, got 'half'"),
    ("missing.json", None, "placement: expected a placement JSON file, got .*missing.json.* \\(not found\\)"),
    (42, None, "placement: expected an rm_core.Placement or a JSON file path, got int"),
])
def test_bad_input_is_refused_before_anything_is_read(placement, fraction, match):
    with pytest.raises(ConfigError, match=match):
        resolve_placement(placement, fraction, "static", spec=_never, tiers=_never)


def test_a_file_that_is_not_a_placement(tmp_path):
    file = tmp_path / "p.json"
    file.write_text("{not json")
    with pytest.raises(ConfigError, match=r"placement .*p\.json: not a valid placement JSON"):
        resolve_placement(str(file), None, "static", spec=_never, tiers=_never)
