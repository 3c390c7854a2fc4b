"""Routing profiles: captured routes (which experts each token used) and their counts.

A routes file is safetensors or JSON, never pickle: loading an untrusted
pickle (``torch.load``) executes code. Layout, T tokens, L MoE layers, K top-k:

* safetensors: tensor ``routes`` int32 [T, L, K], ``layers`` int32 [L] (decoder
  layer indices), optional ``class_ids`` int32 [T]; metadata ``model``,
  ``num_experts``, ``classes`` (a JSON list).
* JSON: ``{"model", "num_experts", "layers", "routes": [[[...]]], "class_ids"?, "classes"?}``.

A ``Profile`` holds routed-token counts [L][E] (and the same per request class).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from moe_offload.control.hf_config import read_json
from moe_offload.errors import ConfigError, PlacementError


def _np():
    import numpy as np  # lazily: `import moe_offload` stays light

    return np


@dataclass(frozen=True)
class Routes:
    """Routed expert ids of T tokens over L MoE layers: ``ids`` [T, L, K]; optional ``class_ids`` [T]."""

    model: str
    num_experts: int
    layers: tuple[int, ...]
    ids: Any  # numpy int array [T, L, K] (nested lists are converted)
    class_ids: Any = None  # numpy int array [T] or None
    classes: tuple[str, ...] = ()

    def __post_init__(self):
        np = _np()
        ids = np.asarray(self.ids)
        if ids.size == 0:
            ids = ids.reshape(0, len(self.layers), ids.shape[-1] if ids.ndim == 3 else 1)
        if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer):
            raise ConfigError(f"routes: expected an integer array [tokens, layers, top_k], got shape {ids.shape} {ids.dtype}")
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ConfigError(f"routes: num_experts must be a positive integer, got {self.num_experts!r}")
        layers = tuple(int(i) for i in self.layers)
        if ids.shape[1] != len(layers):
            raise ConfigError(f"routes: {ids.shape[1]} layers of ids but {len(layers)} layer indices {layers}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_experts):
            raise ConfigError(f"routes: expert ids must be in 0..{self.num_experts - 1}, got {int(ids.min())}..{int(ids.max())}")
        object.__setattr__(self, "ids", ids.astype(np.int32, copy=False))
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "classes", tuple(str(c) for c in self.classes))
        if self.class_ids is not None:
            cids = np.asarray(self.class_ids)
            if cids.shape != (ids.shape[0],):
                raise ConfigError(f"routes: class_ids must have one entry per token ({ids.shape[0]}), got shape {cids.shape}")
            if cids.size and (cids.min() < 0 or cids.max() >= max(len(self.classes), 1)):
                raise ConfigError(f"routes: class ids must index classes {list(self.classes)}")
            object.__setattr__(self, "class_ids", cids.astype(np.int32, copy=False))

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[2])


def save_routes(path: str | os.PathLike, routes: Routes) -> None:
    """Write ``routes`` as ``.safetensors`` or ``.json`` (by extension)."""
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        from safetensors.numpy import save_file

        np = _np()
        tensors = {"routes": np.ascontiguousarray(routes.ids, dtype=np.int32),
                   "layers": np.asarray(routes.layers, dtype=np.int32)}
        if routes.class_ids is not None:
            tensors["class_ids"] = np.ascontiguousarray(routes.class_ids, dtype=np.int32)
        meta = {"model": routes.model, "num_experts": str(routes.num_experts), "classes": json.dumps(list(routes.classes)),
                "format": "moe-offload-routes/1"}
        save_file(tensors, path, metadata=meta)
    elif path.endswith(".json"):
        data = {"format": "moe-offload-routes/1", "model": routes.model, "num_experts": routes.num_experts,
                "layers": list(routes.layers), "routes": routes.ids.tolist()}
        if routes.class_ids is not None:
            data.update(class_ids=routes.class_ids.tolist(), classes=list(routes.classes))
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, separators=(",", ":"))
    else:
        raise ConfigError(f"routes file must end in .safetensors or .json, got {path!r}")


def load_routes(path: str | os.PathLike) -> Routes:
    """Read a routes file written by :func:`save_routes` (safetensors or JSON; never pickle)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ConfigError(f"no routes file at {path}")
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(path, framework="numpy") as f:
                meta = f.metadata() or {}
                keys = set(f.keys())
                if not {"routes", "layers"} <= keys:
                    raise ConfigError(f"{path}: expected tensors 'routes' and 'layers', found {sorted(keys)}")
                ids, layers = f.get_tensor("routes"), f.get_tensor("layers")
                cids = f.get_tensor("class_ids") if "class_ids" in keys else None
        except SafetensorError as e:
            raise ConfigError(f"{path}: not a readable safetensors file ({e})") from None
        try:
            return Routes(model=meta.get("model", ""), num_experts=int(meta.get("num_experts", "0")),
                          layers=tuple(layers.tolist()), ids=ids, class_ids=cids,
                          classes=tuple(json.loads(meta.get("classes", "[]"))))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{path}: bad routes metadata ({e})") from None
    if path.endswith(".json"):
        data = read_json(path)
        missing = [k for k in ("num_experts", "layers", "routes") if k not in data]
        if missing:
            raise ConfigError(f"{path}: routes JSON lacks {missing[0]!r}")
        return Routes(model=str(data.get("model", "")), num_experts=data["num_experts"], layers=tuple(data["layers"]),
                      ids=_np().asarray(data["routes"], dtype=_np().int64).reshape(-1, len(data["layers"]),
                                                                                   _k(data["routes"])),
                      class_ids=data.get("class_ids"), classes=tuple(data.get("classes", ())))
    raise ConfigError(f"routes file must end in .safetensors or .json, got {path!r}")


def _k(routes: list) -> int:
    try:
        return len(routes[0][0])
    except (IndexError, TypeError):
        return 1


@dataclass(frozen=True)
class Profile:
    """Routed token-expert counts per MoE layer: ``counts`` [L][E] (numpy int64), also per request class.

    ``source`` names where the counts came from (a file path, ``synthetic``); it becomes
    ``Placement.profile``.
    """

    model: str
    layers: tuple[int, ...]
    counts: Any  # int64 [L, E]
    class_counts: Mapping[str, Any] = field(default_factory=dict)  # class -> int64 [L, E]
    source: str = "profile"
    top_k: int = 0

    def __post_init__(self):
        np = _np()
        counts = np.asarray(self.counts, dtype=np.int64)
        if counts.ndim != 2 or counts.shape[0] != len(self.layers):
            raise ConfigError(f"profile: counts must be [layers={len(self.layers)}, experts], got shape {counts.shape}")
        if (counts < 0).any():
            raise ConfigError("profile: counts must be >= 0")
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        cc = {str(k): np.asarray(v, dtype=np.int64) for k, v in dict(self.class_counts).items()}
        for k, v in cc.items():
            if v.shape != counts.shape:
                raise ConfigError(f"profile: class {k!r} counts have shape {v.shape}, expected {counts.shape}")
        object.__setattr__(self, "class_counts", cc)

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[1])

    @property
    def total(self) -> int:
        """Routed token-expert pairs counted."""
        return int(self.counts.sum())

    @classmethod
    def from_routes(cls, routes: Routes, source: str = "routes") -> "Profile":
        np = _np()
        T, L, K = routes.ids.shape
        E = routes.num_experts
        counts = _bincount(routes.ids, E)
        per_class = {}
        if routes.class_ids is not None:
            for c, name in enumerate(routes.classes):
                per_class[name] = _bincount(routes.ids[routes.class_ids == c], E)
        del np, T, K
        return cls(model=routes.model, layers=routes.layers, counts=counts.reshape(L, E), class_counts=per_class,
                   source=source, top_k=routes.top_k)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Profile":
        """Profile of a routes file (``.safetensors``/``.json``), or of a counts JSON written by :meth:`save`."""
        path = os.fspath(path)
        if path.endswith(".json"):
            data = read_json(path)
            if "counts" in data and "routes" not in data:
                try:
                    return cls(model=str(data.get("model", "")), layers=tuple(data["layers"]), counts=data["counts"],
                               class_counts=data.get("class_counts", {}), source=path, top_k=int(data.get("top_k", 0)))
                except (KeyError, TypeError, ValueError) as e:
                    raise ConfigError(f"{path}: not a profile ({e})") from None
        return cls.from_routes(load_routes(path), source=path)

    def save(self, path: str | os.PathLike) -> None:
        """Counts as JSON (small: L x E numbers, whatever the number of tokens)."""
        data = {"format": "moe-offload-profile/1", "model": self.model, "layers": list(self.layers), "top_k": self.top_k,
                "counts": self.counts.tolist(), "class_counts": {k: v.tolist() for k, v in self.class_counts.items()}}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, separators=(",", ":"))

    def merge(self, other: "Profile") -> "Profile":
        """Sum of two profiles of the same model and layers."""
        if other.layers != self.layers or other.num_experts != self.num_experts:
            raise ConfigError(f"cannot merge profiles of different shapes: layers {len(self.layers)} x {self.num_experts} "
                              f"experts vs {len(other.layers)} x {other.num_experts}")
        cc = dict(self.class_counts)
        for k, v in other.class_counts.items():
            cc[k] = cc[k] + v if k in cc else v
        return Profile(self.model or other.model, self.layers, self.counts + other.counts, cc,
                       source=f"{self.source}+{other.source}", top_k=self.top_k or other.top_k)

    def normalized(self):
        """Routing frequency per layer: counts / row sum, float64 [L, E] (rows of an unseen layer are 0)."""
        np = _np()
        rows = self.counts.sum(axis=1, keepdims=True)
        return np.divide(self.counts, rows, out=np.zeros(self.counts.shape), where=rows > 0)

    def for_class(self, name: str) -> "Profile":
        if name not in self.class_counts:
            raise ConfigError(f"profile has no class {name!r} (classes: {', '.join(sorted(self.class_counts)) or 'none'})")
        return Profile(self.model, self.layers, self.class_counts[name], {}, source=f"{self.source}#{name}", top_k=self.top_k)

    def check(self, spec) -> "Profile":
        """Raise PlacementError unless this profile fits ``spec`` (same MoE layers and experts)."""
        if self.num_experts != spec.num_experts or self.layers != tuple(spec.moe_layers):
            raise PlacementError(
                f"profile of {self.model or 'unknown model'} ({len(self.layers)} MoE layers x {self.num_experts} experts) "
                f"does not fit {spec.name} ({spec.num_moe_layers} MoE layers x {spec.num_experts} experts)")
        if self.top_k and self.top_k != spec.top_k:
            raise PlacementError(f"profile routes top-{self.top_k} but {spec.name} routes top-{spec.top_k}")
        return self


def _bincount(ids, num_experts: int):
    """Counts [L * E] of ids [T, L, K]: one bincount over layer-offset ids (fast for 10^8 ids)."""
    np = _np()
    T, L, K = ids.shape
    offset = (np.arange(L, dtype=np.int64) * num_experts)[None, :, None]  # [1, L, 1]
    return np.bincount((ids + offset).ravel(), minlength=L * num_experts).reshape(L, num_experts)


def synthetic_routes(num_tokens: int, layers: Sequence[int], num_experts: int, top_k: int, *, skew: float = 1.0,
                     seed: int = 0, model: str = "synthetic", layer_skews: Sequence[float] | None = None) -> Routes:
    """A routes trace with Zipf(``skew``)-distributed experts per layer (0 = uniform), each layer's
    popularity order shuffled; ``layer_skews`` gives each layer its own exponent. For tests and benches."""
    np = _np()
    rng = np.random.default_rng(seed)
    L = len(layers)
    ids = np.empty((num_tokens, L, top_k), dtype=np.int32)
    for li in range(L):
        s = layer_skews[li] if layer_skews is not None else skew
        p = 1.0 / np.arange(1, num_experts + 1) ** s
        p = p[rng.permutation(num_experts)]
        p /= p.sum()
        # Gumbel top-k: K distinct experts per token, sampled without replacement by p.
        g = np.log(p)[None, :] - np.log(-np.log(rng.random((num_tokens, num_experts))))
        ids[:, li, :] = np.argpartition(-g, top_k - 1, axis=1)[:, :top_k]
    return Routes(model=model, num_experts=num_experts, layers=tuple(layers), ids=ids)
