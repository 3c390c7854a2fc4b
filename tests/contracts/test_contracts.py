"""rm-core contracts: validation, round-trips, and agreement between the dataclasses and the JSON Schemas."""

import dataclasses
import json

import pytest

from rm_core import (
    ACCELERATOR_ID_PATTERN,
    TIER_KINDS,
    WORKLOAD_KINDS,
    ContractError,
    LayerPlacement,
    Measurement,
    MemoryTier,
    Placement,
    Workload,
)
from rm_core.schema import SCHEMA_OF, load_schema, validate

NPU = MemoryTier("npu0", "device-hbm", 48 * 2**30, accelerator="node-1/furiosa:0", reserved_bytes=2**30)
HOST = MemoryTier("host", "host-dram", 512 * 2**30, labels={"numa": "0"})


def placement() -> Placement:
    layers = (
        LayerPlacement(1, ("npu0", "host", "npu0", "host"), {"npu0": 3}),
        LayerPlacement(0, ("host", "host", "npu0", "host"), {"npu0": 1}),
    )
    return Placement("qwen3-moe", (NPU, HOST), layers, "mix:1", {"npu0": 0.8, "host": 0.2}, "routes.safetensors")


INSTANCES = [
    Workload("serve", "model-dir", {"port": 8000, "nested": {"a": [1, 2]}}),
    Workload("decode"),
    NPU,
    HOST,
    placement(),
    placement().layers[0],
    Measurement("airm_tok_s", 42.5, "tok/s", {"model": "m"}, timestamp=1_700_000_000.0),
]


@pytest.mark.parametrize("obj", INSTANCES, ids=lambda o: type(o).__name__)
def test_round_trip_through_json_and_schema(obj):
    text = obj.to_json()
    again = type(obj).from_json(text)
    assert again == obj
    validate(SCHEMA_OF[type(obj).__name__], json.loads(text))


@pytest.mark.parametrize("cls", [Workload, MemoryTier, LayerPlacement, Placement, Measurement])
def test_schema_fields_match_dataclass(cls):
    # Fails when a field is added, removed or made optional on one side only.
    schema = load_schema(SCHEMA_OF[cls.__name__])
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert set(schema["properties"]) == set(fields)
    required = {
        n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    assert set(schema["required"]) == required
    assert schema["additionalProperties"] is False


def test_schema_enums_match_code():
    assert load_schema("workload")["properties"]["kind"]["enum"] == list(WORKLOAD_KINDS)
    tier = load_schema("memory_tier")["properties"]
    assert tier["kind"]["enum"] == list(TIER_KINDS)
    assert tier["accelerator"]["pattern"] == ACCELERATOR_ID_PATTERN


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: MemoryTier("t", "device-hbm", -1, accelerator="n/v:0"), "MemoryTier.capacity_bytes"),
        (lambda: MemoryTier("t", "ssd", 1), "MemoryTier.kind"),
        (lambda: MemoryTier("t", "device-hbm", 10), "MemoryTier.accelerator"),
        (lambda: MemoryTier("t", "device-hbm", 10, accelerator="gpu0"), "MemoryTier.accelerator"),
        (lambda: MemoryTier("t", "host-dram", 10, reserved_bytes=11), "MemoryTier.reserved_bytes"),
        (lambda: Workload("train"), "Workload.kind"),
        (lambda: Workload("serve", options=[1]), "Workload.options"),
        (lambda: Measurement("x", float("nan"), "ms"), "Measurement.value"),
        (lambda: Measurement("x", 10**400, "ms"), "Measurement.value"),  # math.isfinite raised OverflowError
        (lambda: Measurement("x", 1.0, ""), "Measurement.unit"),
        (lambda: LayerPlacement(0, ("a", "a"), {"a": 1}), "LayerPlacement.slots[a]"),
        (lambda: LayerPlacement(0, ("a",), {"a": 2}), "LayerPlacement.slots[a]"),
        (lambda: Placement("m", (HOST,), (LayerPlacement(0, ("npu9",)),), "top"), "Placement.layers[0].home"),
        (lambda: Placement("m", (HOST,), (), "top", {"host": 1.5}), "Placement.predicted_hit_rate[host]"),
    ],
)
def test_invalid_values_name_the_field(make, field):
    with pytest.raises(ContractError) as err:
        make()
    assert err.value.field == field
    assert "expected" in str(err.value) and "got" in str(err.value)


def test_from_dict_rejects_unknown_and_missing_fields():
    with pytest.raises(ContractError, match="Workload.colour"):
        Workload.from_dict({"kind": "serve", "colour": "red"})
    with pytest.raises(ContractError, match="required"):
        MemoryTier.from_dict({"name": "x"})
    with pytest.raises(ContractError, match="valid JSON"):
        Placement.from_json("{not json")
    with pytest.raises(ContractError, match="valid JSON"):  # json.loads raises RecursionError, not a ValueError
        Placement.from_json("[" * 100_000)


def test_schema_rejects_what_the_code_rejects():
    bad = NPU.to_dict() | {"capacity_bytes": -5}
    with pytest.raises(ContractError, match="capacity_bytes"):
        validate("memory_tier", bad)


def test_placement_helpers():
    p = placement()
    assert [lp.layer for lp in p.layers] == [0, 1]  # sorted by layer
    assert p.host_tier == "host"
    # An emulated accelerator in host DRAM (the cpu backend's tier) is not the host tier.
    emulated = MemoryTier("cpu:0", "host-dram", 2**30, accelerator="n/cpu:0")
    assert Placement("m", (emulated, HOST), (), "top").host_tier == "host"
    lp = p.layer(1)
    assert lp.pinned("npu0") == [0, 2] and lp.dynamic("npu0") == 1
    with pytest.raises(ContractError):
        p.layer(7)
