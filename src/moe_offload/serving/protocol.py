"""Parse and validate OpenAI request bodies into engine inputs. Every bad field is a 400 naming the field.

Unknown fields are ignored (as vLLM does), so newer clients keep working;
fields we cannot honour (``n`` > 1, ``logprobs``, ``echo``, ``best_of`` > 1, ``suffix``, a non-text
``response_format``, tool calling) are refused, not ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from moe_offload.engines.base import SamplingParams
from moe_offload.errors import ConfigError
from moe_offload.serving.errors import APIError

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class GenRequest:
    """One API request, ready for the engine: one token-id prompt per choice."""

    prompts: list[list[int]]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    text: str = ""  # what classification reads
    prompt_texts: list[str] = field(default_factory=list)  # rendered chat prompt (for the reasoning splitter)


def parse_json(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")  # JSON on the wire is UTF-8 (RFC 8259); json.loads would also guess UTF-16/32
        body = json.loads(text)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, f"invalid JSON body: {e}"[:500], code="invalid_json") from None
    except RecursionError:  # a body of nested brackets within the size limit: a client error, not a 500
        raise APIError(400, "invalid JSON body: nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body: expected a JSON object, got {type(body).__name__}")
    # JSON may escape a lone UTF-16 surrogate ("\ud800"), which no UTF-8 text can hold: the tokenizer and every
    # response that echoes the string would fail on it. Raw bytes cannot carry one, so only an escape needs the check.
    if "\\ud" in text.lower():
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "invalid JSON body: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff)",
                           code="invalid_json") from None
    return body


def _bad(param: str, expected: str, got) -> APIError:
    return APIError(400, f"{param}: expected {expected}, got {got!r}"[:500], param=param)


def _int(body: dict, key: str, default, minimum: int | None = None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(key, "an integer", v)
    if minimum is not None and v < minimum:
        raise _bad(key, f"an integer >= {minimum}", v)
    return v


def _num(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not lo <= v <= hi:
        raise _bad(key, f"a number in {lo}..{hi}", v)
    return float(v)


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(key, "true or false", v)
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,) if v else ()
    if isinstance(v, list) and len(v) <= 16 and all(isinstance(s, str) for s in v):
        return tuple(s for s in v if s)
    raise _bad("stop", "a string or a list of up to 16 strings", v)


def _common(body: dict, max_tokens_default: int | None, key_max: tuple[str, ...]) -> tuple[dict, tuple[str, ...], bool, bool]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "a string", model)
    n = _int(body, "n", 1, 1)
    if n != 1:
        raise _bad("n", "1 (one choice per request; send several requests)", n)
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise APIError(400, "logprobs: not supported by this server", param="logprobs")
    _refuse_unhonoured(body)
    max_tokens = max_tokens_default
    for key in key_max:
        if body.get(key) is not None:
            max_tokens = _int(body, key, None)
            if max_tokens < 1:
                raise _bad(key, "an integer >= 1", max_tokens)
            break
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise _bad("stop_token_ids", "a list of integers", stop_ids)
    params = {
        "max_tokens": max_tokens,
        "temperature": _num(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _num(body, "top_p", 1.0, 0.0, 1.0),
        "top_k": _int(body, "top_k", 0, -1),
        "seed": _int(body, "seed", None),
        "stop_token_ids": tuple(stop_ids),
        "ignore_eos": _bool(body, "ignore_eos"),
    }
    if params["top_p"] == 0:
        raise _bad("top_p", "a number in (0, 1]", 0)
    params["top_k"] = max(params["top_k"], 0)  # vLLM: -1 means "off", like 0
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("stream_options", "an object", opts)
    include_usage = (opts or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise _bad("stream_options.include_usage", "true or false", include_usage)
    return params, _stop(body), stream, bool(include_usage)


def _refuse_unhonoured(body: dict) -> None:
    """Options that change what a client gets back, which this server cannot do: a 400, not a silent ignore."""
    if body.get("echo") not in (None, False):
        raise _bad("echo", "false (echoing the prompt is not supported)", body["echo"])
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of", "1 (one candidate per request)", body["best_of"])
    if body.get("suffix") not in (None, ""):
        raise _bad("suffix", "none (insertion is not supported)", body["suffix"])
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
        raise _bad("response_format", "{'type': 'text'} (structured output is not supported)", fmt)
    if body.get("tools") and body.get("tool_choice", "auto") != "none":
        raise _bad("tool_choice", "'none' when tools are given (tool calling is not supported)", body.get("tool_choice", "auto"))


def sampling(params: dict, prompt_len: int, max_model_len: int) -> SamplingParams:
    p = dict(params)
    if p["max_tokens"] is None:  # chat default, as vLLM: whatever the context leaves
        p["max_tokens"] = max(max_model_len - prompt_len, 1)
    try:
        return SamplingParams(**p)
    except ConfigError as e:
        raise APIError(400, str(e), param=str(e).split(":", 1)[0]) from None


def parse_completion(body: dict, tokenizer, max_model_len: int) -> GenRequest:
    params, stop, stream, include_usage = _common(body, 16, ("max_tokens",))
    prompt = body.get("prompt")
    texts: list[str] = []
    if isinstance(prompt, str):
        texts, prompts = [prompt], [tokenizer.encode(prompt, add_special_tokens=False)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts, prompts = list(prompt), [tokenizer.encode(p, add_special_tokens=False) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt):
        for p in prompt:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise _bad("prompt", "token ids as integers", p[:8])
        prompts = [list(p) for p in prompt]
    else:
        raise _bad("prompt", "a non-empty string, list of strings, list of token ids or list of token-id lists", prompt)
    if len(prompts) > 64:
        raise _bad("prompt", "at most 64 prompts", len(prompts))
    for i, p in enumerate(prompts):
        if not p:
            raise APIError(400, f"prompt[{i}]: expected at least one token, got an empty prompt", param="prompt")
    sp = sampling(params, max(len(p) for p in prompts), max_model_len)
    return GenRequest(prompts, sp, stop, stream, include_usage, body.get("model"), "\n".join(texts))


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of messages", messages)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "an object with role and content", m)
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", "one of " + ", ".join(ROLES), role)
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}].content", "text parts ({'type': 'text', 'text': ...})", part)
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "a string or a list of text parts", content)
        out.append({"role": role, "content": content})
    return out


def parse_chat(body: dict, tokenizer, max_model_len: int) -> GenRequest:
    params, stop, stream, include_usage = _common(body, None, ("max_completion_tokens", "max_tokens"))
    messages = _messages(body)
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "an object", kwargs)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template that rejects these messages is the client's 400
        raise APIError(400, f"messages: the chat template rejected them: {type(e).__name__}: {e}"[:500], param="messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "messages: the chat template produced an empty prompt", param="messages")
    sp = sampling(params, len(ids), max_model_len)
    text_for_class = "\n".join(m["content"] for m in messages)
    return GenRequest([ids], sp, stop, stream, include_usage, body.get("model"), text_for_class, [text])
