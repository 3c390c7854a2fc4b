"""The JSON Schemas of the contracts (shipped in ``rm_core/schemas``) and validation against them."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any

from rm_core.errors import ContractError

# contract class name -> schema file stem
SCHEMA_OF = {
    "Workload": "workload",
    "MemoryTier": "memory_tier",
    "LayerPlacement": "layer_placement",
    "Placement": "placement",
    "Measurement": "measurement",
    "ai-rm.yaml": "ai-rm",
}


@lru_cache(maxsize=None)
def load_schema(stem: str) -> dict[str, Any]:
    path = resources.files("rm_core") / "schemas" / f"{stem}.json"
    return json.loads(path.read_text())


def validate(stem: str, instance: Any) -> None:
    """Raise ContractError if ``instance`` does not match schema ``stem``."""
    import jsonschema  # imported here: only validation needs it
    from referencing import Registry, Resource

    registry = Registry().with_resources(
        (load_schema(s)["$id"], Resource.from_contents(load_schema(s))) for s in SCHEMA_OF.values()
    )
    validator = jsonschema.Draft202012Validator(load_schema(stem), registry=registry)
    error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise ContractError(f"{stem}:{where}", "a value matching the schema", error.message)


def validate_manifest(path) -> dict[str, Any]:
    """Load and validate an ``ai-rm.yaml``; returns the parsed manifest."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ContractError("ai-rm.yaml", "a readable YAML file", str(e)) from None
    validate("ai-rm", data)
    return data
