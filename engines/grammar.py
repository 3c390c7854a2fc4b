"""Structured output through llguidance: a StructuredOutput becomes a grammar, the grammar a token mask per step.

    StructuredOutput(kind, spec) --grammar_text--> llguidance grammar     (check(): a bad schema is a ConfigError)
    grammar + LLTokenizer(engine's tokenizer) --Matcher--> bitmask of allowed ids --sampler--> token --consume-->

No grammar engine is written here: llguidance (Rust, no dependencies) compiles JSON Schema, regular
expressions, Lark/GBNF grammars and choices, and computes the masks. Pure Python here (no torch): the worker
checks a request's constraint before queueing it, the torch sampler applies the masks.

JSON is compact (no free whitespace between tokens): a model that could emit whitespace forever inside
a JSON value would never finish, and with random weights it does.
"""

from __future__ import annotations

import json
from functools import lru_cache

from moe_offload.engines.params import StructuredOutput
from moe_offload.errors import ConfigError

JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar of ``so`` (not yet checked)."""
    import llguidance

    if so.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if so.kind == "json":
        try:
            schema = json.loads(so.spec)
        except ValueError as e:
            raise ConfigError(f"json schema: expected JSON, got {so.spec[:80]!r} ({e})") from None
        if isinstance(schema, bool):  # JSON Schema allows true/false; llguidance wants an object
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise ConfigError(f"json schema: expected a JSON object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if so.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.spec)
    if so.kind == "choice":
        try:
            choices = json.loads(so.spec)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ConfigError(f"choice: expected a non-empty list of strings, got {so.spec[:80]!r}")
        return llguidance.grammar_from("choice", choices)
    try:
        return llguidance.grammar_from("grammar", so.spec)  # Lark, or GBNF (converted to Lark)
    except ValueError as e:
        raise ConfigError(f"grammar: {e}") from None


@lru_cache(maxsize=64)
def _checked(so: StructuredOutput) -> str:
    import llguidance

    try:
        grammar = grammar_text(so)
    except ValueError as e:  # llguidance's own argument errors
        raise ConfigError(f"{so.kind}: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConfigError(f"{so.kind}: the constraint does not compile: {messages[0] if messages else 'invalid'}"[:500])
    return grammar


def check(so: StructuredOutput) -> str:
    """The grammar of ``so``, or ConfigError saying why it cannot be used. Cached: the worker and the engine
    both call it for the same request."""
    return _checked(so)


def llg_tokenizer(tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    """llguidance's view of a transformers fast tokenizer (about 1 s for large vocabularies: build once per engine).

    ``vocab_size`` is the model's logit width (it may exceed the tokenizer's: padding rows are never allowed)."""
    try:
        import llguidance.hf
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:  # pragma: no cover - llguidance is a dependency
        raise ConfigError(f"structured output needs llguidance and transformers ({e})") from None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ConfigError(f"structured output: expected a fast (Rust) tokenizer, got {type(tokenizer).__name__}")
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids) or None)


class Matcher:
    """One sequence's position in its grammar: ``bitmask()`` before sampling, ``consume(token)`` after."""

    def __init__(self, so: StructuredOutput, llg_tok):
        import llguidance

        self._m = llguidance.LLMatcher(llg_tok, check(so), log_level=0)
        if self._m.is_error():
            raise ConfigError(f"{so.kind}: {self._m.get_error()}"[:500])

    def bitmask(self) -> bytes:
        """One bit per token id (little-endian 32-bit words, as llguidance packs them): 1 = allowed next."""
        return self._m.compute_bitmask()

    def consume(self, token: int) -> None:
        if not self._m.consume_token(token):  # the sampler only picks allowed tokens: this is a bug, not the client's
            raise RuntimeError(f"grammar refused token {token}: {self._m.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar admits nothing more: the output is complete (only EOS could follow)."""
        return self._m.is_stopped()
