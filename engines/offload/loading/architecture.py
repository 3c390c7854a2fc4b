"""What a transformers MoE model is, asked of transformers itself: its generative class, its text decoder's
layers, and which experts modules the offload executor serves.

    config --generative class (config.architectures, else the auto mappings)--> model (meta or real)
      --> text path: the module whose forward returns next-token logits (the model, or e.g. an omni model's thinker)
      --> decoder layers: the longest ModuleList under text_path.get_decoder()
      --> experts modules: per decoder layer, the one its text tokens route to (layer index = position in the list)

Experts elsewhere (a vision tower's MoE, an omni model's speech talker, a layer's image-token experts) are not
offloaded: they stay ordinary parameters and run with transformers' own implementation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from moe_offload.errors import ModelError

# Auto classes that generate text, in the order a config is tried: the multimodal class first, because a
# published multimodal checkpoint is saved from it (its text-only class would drop the other towers' weights).
GENERATIVE_AUTO = ("AutoModelForImageTextToText", "AutoModelForCausalLM", "AutoModelForMultimodalLM")
_MAPPINGS = {
    "AutoModelForImageTextToText": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "AutoModelForCausalLM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "AutoModelForMultimodalLM": "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
}
# Names of modules that run only for non-text inputs.
_NON_TEXT = re.compile(r"vision|visual|image|audio|speech|talker")


@dataclass(frozen=True)
class ExpertsModule:
    """An experts module the executor serves: its dotted name and its decoder layer index."""

    name: str
    layer: int
    module: torch.nn.Module


def generative_class_name(model_type: str) -> str | None:
    """Name of the transformers class that generates text for ``model_type``, or None."""
    from transformers.models.auto import modeling_auto

    for auto in GENERATIVE_AUTO:
        name = getattr(modeling_auto, _MAPPINGS[auto]).get(model_type)
        if name:
            return name
    return None


def model_class(config):
    """The transformers class to build ``config`` with: the class its ``architectures`` names when transformers
    has it and it generates, else the first generative auto mapping that knows the model type."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, str(name), None)
        if cls is not None and getattr(cls, "can_generate", lambda: False)():
            return cls
    name = generative_class_name(config.model_type)
    if name is None:
        raise ModelError(
            f"model_type {config.model_type!r}: transformers has no text-generating class for it "
            f"(looked in {', '.join(GENERATIVE_AUTO)})"
        )
    return getattr(transformers, name)


def text_only(config) -> dict:
    """from_pretrained overrides that leave out what the text path never runs: an omni model's speech talker
    (``enable_audio_output``), so its weights are not loaded at all."""
    return {"enable_audio_output": False} if getattr(config, "enable_audio_output", False) else {}


def text_path(model):
    """The module whose forward takes input_ids and returns next-token logits: the model itself, or (a model
    with no forward of its own, e.g. an omni model) the generative sub-model that has one."""
    if _has_forward(model):
        return model
    for _name, child in model.named_children():
        if hasattr(child, "can_generate") and child.can_generate() and _has_forward(child):
            return child
    raise ModelError(f"{type(model).__name__}: no sub-model with a forward that returns logits")


def meta_model(config, dtype: torch.dtype):
    """The text path of the model ``config`` describes, on the meta device (no memory)."""
    cls = model_class(config)
    with torch.device("meta"):
        return text_path(cls._from_config(config, dtype=dtype))


def _has_forward(module) -> bool:
    return type(module).forward is not torch.nn.Module.forward


def decoder_layers(model) -> torch.nn.ModuleList:
    """The text decoder's layers: the ModuleList under ``get_decoder()`` of the text path as long as the text
    config's num_hidden_layers (else the longest one there)."""
    path = text_path(model)
    decoder = path.get_decoder()
    lists = [m for m in decoder.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ModelError(f"{type(model).__name__}: its decoder has no layer list")
    n = getattr(path.config.get_text_config(), "num_hidden_layers", None)
    return next((m for m in lists if len(m) == n), None) or max(lists, key=len)


def is_experts_module(m: torch.nn.Module) -> bool:
    """A module decorated by transformers' ``use_experts_implementation`` (fused [E, ...] expert tensors)."""
    return hasattr(m, "is_transposed") and hasattr(m, "has_gate") and hasattr(m, "_is_expert_parallel")


def experts_modules(model) -> tuple[list[ExpertsModule], list[str]]:
    """(experts modules the executor serves, names of the other experts modules of ``model``).

    A decoder layer with several experts modules (text and image-token experts) is served through the one whose
    name does not say it is for another modality."""
    names = {id(m): n for n, m in model.named_modules()}
    served: list[ExpertsModule] = []
    for i, layer in enumerate(decoder_layers(model)):
        found = [(n, m) for n, m in layer.named_modules() if is_experts_module(m)]
        text = [(n, m) for n, m in found if not _NON_TEXT.search(n)] or found[:1]
        if len(text) > 1:
            raise ModelError(
                f"decoder layer {i} holds {len(text)} experts modules for text ({', '.join(n for n, _ in text)}), "
                "expected one"
            )
        if text:
            served.append(ExpertsModule(names[id(text[0][1])], i, text[0][1]))
    taken = {e.name for e in served}
    others = [n for n, m in model.named_modules() if is_experts_module(m) and n not in taken]
    return served, others
