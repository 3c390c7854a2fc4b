"""The OpenAI request bodies as pydantic models, with vLLM's field names and defaults; /openapi.json is built from them.

    raw bytes --validate(Model)--> a typed request (strict JSON types: "10" is not an integer)
        bad JSON / a bad field  --> APIError 400, ``param`` naming the field (``messages[0].role``), never a 422
        unknown fields          --> accepted and ignored, as vLLM does (logged)
        known, not honoured     --> APIError 400 naming the field (REFUSED below), never silently ignored

requests.py turns a validated request into engine inputs; responses.py holds the response shapes.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moe_offload.log import get_logger
from moe_offload.serving.errors import APIError

log = get_logger("serving.protocol")
INT64 = dict(ge=-(2**63), le=2**64 - 1)  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # as vLLM's default --max-logprobs
MAX_CHOICES = 64  # prompts x (best_of or n) per request: they run one after another on one engine


class OpenAIModel(BaseModel):
    """Strict JSON types, unknown fields kept aside (``model_extra``) and ignored."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, populate_by_name=True)


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(OpenAIModel):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(OpenAIModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# Sampling fields shared by both endpoints, vLLM's names and defaults (None: the model's generation_config.json,
# else OpenAI's default).
class SamplingFields(OpenAIModel):
    model: str | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = 1
    seed: Annotated[int, Field(**INT64)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    speculative: bool = True  # ours: false turns the worker's speculative decoding off for this request
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None  # vLLM's: prefix caching per salt
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None
    request_id: str | None = None
    # vLLM fields this worker does not honour: accepted in their neutral value only (REFUSED).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    logprob_token_ids: list[int] | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    structural_tag: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(SamplingFields):
    prompt: list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]] | str | list[str] | None = None
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="The prompt as token ids (instead of `prompt`), as the NPU design's worker accepts.")
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True


class FunctionCall(OpenAIModel):
    name: str
    arguments: str


class ToolCall(OpenAIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(OpenAIModel):
    """A text part of a message. Images, audio and files are refused: this worker serves text models."""

    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(OpenAIModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    include_reasoning: bool = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class TokenizeCompletionRequest(OpenAIModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIModel):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    documents: list[dict[str, str]] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# field -> (is it at its neutral value?, why it is refused). A request that sets one of these gets a 400.
REFUSED: dict[str, tuple] = {
    "suffix": (lambda v: v in (None, ""), "insertion (suffix) is not supported"),
    "use_beam_search": (lambda v: not v, "beam search is not supported"),
    "length_penalty": (lambda v: v == 1.0, "length_penalty needs beam search, which is not supported"),
    "allowed_token_ids": (lambda v: v is None, "not supported (use logit_bias or structured_outputs)"),
    "bad_words": (lambda v: not v, "not supported"),
    "truncate_prompt_tokens": (lambda v: v is None, "prompt truncation is not supported"),
    "logprob_token_ids": (lambda v: v is None, "not supported (use logprobs)"),
    "priority": (lambda v: v == 0, "priority scheduling is not supported"),
    "kv_transfer_params": (lambda v: not v, "KV transfer is not supported (experts move, never KV cache)"),
    "vllm_xargs": (lambda v: not v, "no extension reads vllm_xargs here"),
    "structural_tag": (lambda v: v is None, "structural tags are not supported"),
    "guided_whitespace_pattern": (lambda v: v is None, "not supported (JSON output is compact)"),
    "spaces_between_special_tokens": (lambda v: v, "only true is supported"),
    "mm_processor_kwargs": (lambda v: not v, "this worker serves text models"),
    "echo": (lambda v: not v, "echo on chat completions is not supported"),  # chat only: completions honour echo
    "stream_options.continuous_usage_stats": (lambda v: not v, "not supported (use include_usage)"),
}


def parse_json(raw: bytes) -> dict:
    """A JSON object from a request body, or APIError 400 (used by the gateway, which forwards bodies as they are)."""
    try:
        text = raw.decode("utf-8")  # JSON on the wire is UTF-8 (RFC 8259); json.loads would also guess UTF-16/32
        body = json.loads(text)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, f"invalid JSON body: {e}"[:500], code="invalid_json") from None
    except RecursionError:  # a body of nested brackets within the size limit: a client error, not a 500
        raise APIError(400, "invalid JSON body: nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body: expected a JSON object, got {type(body).__name__}")
    # JSON may escape a lone UTF-16 surrogate ("\\ud800"), which no UTF-8 text can hold. Raw bytes cannot carry
    # one, so only an escape needs the check. (validate() gets the same from pydantic's parser.)
    if "\\ud" in text.lower():
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "invalid JSON body: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff)",
                           code="invalid_json") from None
    return body


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json_or_python"}


def param_of(loc: tuple) -> str | None:
    """pydantic's error location -> the field as a client names it: ("messages", 0, "role") -> "messages[0].role".
    Union member tags that pydantic puts in the path ("list[str]", "function-after[...]") are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            out += ("." if out else "") + part
    return out or None


def validate(model: type[OpenAIModel], raw: bytes) -> OpenAIModel:
    """Validate a request body; every failure is an APIError 400 naming the field."""
    try:
        req = model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"invalid JSON body: {err['msg']}"[:500], code="invalid_json") from None
        if err["type"] in ("model_type", "model_attributes_type") and not err["loc"]:
            raise APIError(400, "request body: expected a JSON object") from None
        param = param_of(err["loc"])
        got = err.get("input")
        got_text = "nothing" if err["type"] == "missing" else repr(got)
        raise APIError(400, f"{param or 'request body'}: {err['msg']}, got {got_text}"[:500], param=param) from None
    refuse_unhonoured(req, chat=isinstance(req, ChatCompletionRequest))
    extra = sorted(req.model_extra or {})
    if extra:
        log.debug("ignored unknown request fields", fields=",".join(extra)[:200])
    return req


def refuse_unhonoured(req: OpenAIModel, chat: bool) -> None:
    for name, (neutral, why) in REFUSED.items():
        if name == "echo" and not chat:
            continue
        obj, attr = req, name
        if "." in name:
            head, attr = name.split(".", 1)
            obj = getattr(req, head, None)
        if obj is None or attr not in type(obj).model_fields:
            continue
        value = getattr(obj, attr)
        if not neutral(value):
            raise APIError(400, f"{name}: {why}; got {value!r}"[:500], param=name)


__all__ = ["CompletionRequest", "ChatCompletionRequest", "TokenizeCompletionRequest", "TokenizeChatRequest",
           "DetokenizeRequest", "ChatMessage", "Tool", "APIError", "parse_json", "validate", "param_of", "REFUSED"]
