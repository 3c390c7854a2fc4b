"""A validated request -> what the engine runs: token-id prompts, SamplingParams, and how to shape the answer.

    CompletionRequest --prompts (text | ids | prompt_token_ids)-------------------------+
    ChatCompletionRequest --messages, tools --chat template--> prompt                 +--> GenRequest
        sampling fields (request, else generation_config.json, else OpenAI's default) -+     .params per choice
        response_format | structured_outputs | guided_* | tool_choice --> one StructuredOutput

Every problem is an APIError 400 naming the request field; so is a feature the engine does not honour.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from moe_offload.engines.base import EngineInfo
from moe_offload.engines.params import SamplingParams, StructuredOutput
from moe_offload.errors import ConfigError
from moe_offload.serving import tools as toolcalls
from moe_offload.serving.errors import APIError
from moe_offload.serving.protocol import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, SamplingFields

# OpenAI's defaults for the fields a model's generation_config.json may override (vLLM's list).
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0}


@dataclass
class GenRequest:
    """One API request, ready for the engine: one token-id prompt per prompt, ``best_of`` runs of each."""

    prompts: list[list[int]]
    params: SamplingParams
    n: int = 1
    best_of: int = 1
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    skip_special: bool = True
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    text: str = ""  # what classification reads
    prompt_texts: list[str] = field(default_factory=list)  # the prompts as text (echo; the reasoning splitter)
    echo: bool = False
    generate: bool = True  # False: echo with max_tokens 0 (the engine still makes one token, which is dropped)
    logprobs: int | None = None  # top-N alternatives reported per generated token; None: no logprobs
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field
    tokens_as_ids: bool = False
    return_token_ids: bool = False
    tool_mode: str = "none"  # none | auto | required | named
    tools: list[dict] = field(default_factory=list)
    named_tool: str | None = None
    include_reasoning: bool = True
    request_id: str | None = None

    def choice_params(self, j: int) -> SamplingParams:
        """Run j of a prompt: with a seed, seed + j, so that n > 1 choices differ and each is reproducible."""
        if j == 0 or self.params.seed is None:
            return self.params
        seed = self.params.seed + j
        return dataclasses.replace(self.params, seed=seed if seed <= 2**64 - 1 else seed - 2**64)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}"[:500], param=param)


# Caps on what a request makes the worker hold or scan per token (each a 400 naming the limit): stop strings are
# matched against the text after every token, logit_bias is applied to every step's logits, tools are rendered into
# the prompt. OpenAI's own limits where it has them (128 tools); far above what real requests send otherwise.
MAX_STOP, MAX_STOP_CHARS, MAX_LOGIT_BIAS, MAX_TOOLS = 16, 4096, 2048, 128


def _stop(v) -> tuple[str, ...]:
    if v is None:
        return ()
    v = [v] if isinstance(v, str) else v
    if len(v) > MAX_STOP:
        raise _bad("stop", f"expected at most {MAX_STOP} strings, got {len(v)}")
    long = max((len(s) for s in v), default=0)
    if long > MAX_STOP_CHARS:
        raise _bad("stop", f"expected strings of at most {MAX_STOP_CHARS} characters, got one of {long}")
    return tuple(s for s in v if s)


def _structured(req: SamplingFields) -> tuple[StructuredOutput | None, str | None]:
    """The one output constraint of a request, and the field that set it."""
    found: list[tuple[StructuredOutput, str]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append((StructuredOutput("json_object"), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise _bad("response_format.json_schema", "expected {'name': ..., 'schema': {...}} for type json_schema")
        found.append((StructuredOutput("json", json.dumps(rf.json_schema.json_schema)), "response_format"))
    so = req.structured_outputs
    pairs = [("structured_outputs", so.json_ if so else None, so.regex if so else None, so.choice if so else None,
              so.grammar if so else None, so.json_object if so else None),
             ("guided", req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar, None)]
    for where, js, regex, choice, grammar, json_object in pairs:
        if js is not None:
            found.append((StructuredOutput("json", js if isinstance(js, str) else json.dumps(js)),
                          "structured_outputs.json" if where == "structured_outputs" else "guided_json"))
        if regex is not None:
            found.append((StructuredOutput("regex", regex), f"{where}.regex" if where != "guided" else "guided_regex"))
        if choice is not None:
            found.append((StructuredOutput("choice", json.dumps(choice)), f"{where}.choice" if where != "guided" else "guided_choice"))
        if grammar is not None:
            found.append((StructuredOutput("grammar", grammar), f"{where}.grammar" if where != "guided" else "guided_grammar"))
        if json_object:
            found.append((StructuredOutput("json_object"), "structured_outputs.json_object"))
    if len(found) > 1:
        raise _bad(found[1][1], f"only one output constraint per request; {found[0][1]} already sets one")
    return found[0] if found else (None, None)


def _sampling(req: SamplingFields, defaults: Mapping) -> dict:
    """Request value, else the model's generation_config.json, else OpenAI's default (vLLM's order)."""
    values = {}
    for name, neutral in NEUTRAL.items():
        v = getattr(req, name)
        values[name] = v if v is not None else defaults.get(name, neutral)
    values["top_k"] = max(int(values["top_k"]), 0)  # vLLM: -1 means "off", like 0
    values["logit_bias"] = {}
    if len(req.logit_bias or {}) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"expected at most {MAX_LOGIT_BIAS} token ids, got {len(req.logit_bias)}")
    for k, b in (req.logit_bias or {}).items():
        if not k.lstrip("-").isdigit():
            raise _bad("logit_bias", f"expected token ids as keys, got {k!r}")
        values["logit_bias"][int(k)] = b
    return values


def _params(values: dict, info: EngineInfo, params_of: dict[str, str]) -> SamplingParams:
    try:
        p = SamplingParams(**values)
    except ConfigError as e:
        name = str(e).split(":", 1)[0]
        raise APIError(400, str(e), param=params_of.get(name, name)) from None
    missing = [f for f in p.features() if f not in info.features]
    if missing:
        param = params_of.get(missing[0], missing[0])
        raise _bad(param, f"not supported by the {info.backend} engine (it supports: "
                          f"{', '.join(sorted(info.features)) or 'none of the optional sampling features'})")
    if p.structured is not None:
        from moe_offload.engines import grammar

        try:
            grammar.check(p.structured)
        except ConfigError as e:
            raise APIError(400, f"{params_of['structured']}: {e}"[:500], param=params_of["structured"]) from None
    bad_ids = [t for t, _ in p.logit_bias if t >= info.vocab_size] + [t for t in p.stop_token_ids if t >= info.vocab_size]
    if bad_ids:
        param = "logit_bias" if any(t == bad_ids[0] for t, _ in p.logit_bias) else "stop_token_ids"
        raise _bad(param, f"expected token ids in 0..{info.vocab_size - 1}, got {bad_ids[0]}")
    return p


def _max_tokens(asked: int | None, prompt_len: int, info: EngineInfo, defaults: Mapping) -> int:
    """vLLM: the request's value, else what the context leaves, capped by generation_config's max_new_tokens."""
    if asked is not None:
        return asked
    left = max(info.max_model_len - prompt_len, 1)
    return min(left, int(defaults["max_tokens"])) if defaults.get("max_tokens") else left


def _common(req: SamplingFields, defaults: Mapping) -> dict:
    values = _sampling(req, defaults)
    values.update(seed=req.seed, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                  min_tokens=req.min_tokens, speculative=req.speculative, cache_salt=req.cache_salt)
    return values


def build_completion(req: CompletionRequest, tok, info: EngineInfo, defaults: Mapping) -> GenRequest:
    if req.prompt is not None and req.prompt_token_ids is not None:
        raise _bad("prompt_token_ids", "give either prompt or prompt_token_ids, not both")
    prompt = req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt
    texts: list[str] = []
    if isinstance(prompt, str):
        texts, prompts = [prompt], [tok.encode(prompt, add_special_tokens=req.add_special_tokens)]
    elif prompt and isinstance(prompt[0], str):
        texts, prompts = list(prompt), [tok.encode(p, add_special_tokens=req.add_special_tokens) for p in prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [list(prompt)]
    elif prompt:
        prompts = [list(p) for p in prompt]
    else:
        raise _bad("prompt", f"expected a non-empty string, list of strings, list of token ids or list of token-id lists, got {prompt!r}")
    for i, p in enumerate(prompts):
        if not p:
            raise APIError(400, f"prompt[{i}]: expected at least one token, got an empty prompt", param="prompt")
    n = req.n or 1
    best_of = req.best_of or n
    if best_of < n:
        raise _bad("best_of", f"expected best_of >= n ({n}), got {best_of}")
    if req.stream and best_of > n:
        raise _bad("best_of", "cannot stream when best_of > n (the best runs are known only at the end)")
    if len(prompts) * best_of > MAX_CHOICES:
        raise _bad("n" if req.best_of is None else "best_of", f"expected prompts x {'best_of' if req.best_of else 'n'} <= {MAX_CHOICES}, got {len(prompts) * best_of}")
    generate = True
    max_tokens = _max_tokens(req.max_tokens, max(len(p) for p in prompts), info, defaults)
    if max_tokens == 0:
        if not req.echo:
            raise _bad("max_tokens", "expected an integer >= 1 (0 only with echo), got 0")
        generate, max_tokens = False, 1
    values = _common(req, defaults)
    so, so_param = _structured(req)
    # best_of ranks runs by their cumulative logprob: the engine reports it even when the client did not ask.
    lp = req.logprobs if req.logprobs is not None else (0 if best_of > n else None)
    plp = req.prompt_logprobs if req.prompt_logprobs is not None else (req.logprobs if req.echo else None)
    values.update(max_tokens=max_tokens, logprobs=lp, prompt_logprobs=plp, structured=so)
    params_of = {"structured": so_param, "prompt_logprobs": "prompt_logprobs" if req.prompt_logprobs is not None else "echo"}
    params = _params(values, info, params_of)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if not req.stream and req.stream_options is not None:
        raise _bad("stream_options", "only with stream: true")
    if req.stream and req.prompt_logprobs is not None:
        raise _bad("prompt_logprobs", "not available when streaming")
    if not texts and req.echo:
        texts = [tok.decode(p, skip_special_tokens=False) for p in prompts]
    return GenRequest(prompts, params, n=n, best_of=best_of, stop=_stop(req.stop), include_stop=req.include_stop_str_in_output,
                      skip_special=req.skip_special_tokens, stream=bool(req.stream), include_usage=include_usage,
                      model=req.model, text="\n".join(texts), prompt_texts=texts, echo=bool(req.echo), generate=generate,
                      logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs, tokens_as_ids=bool(req.return_tokens_as_token_ids),
                      return_token_ids=bool(req.return_token_ids), request_id=req.request_id)


def _messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as chat templates read them: text content, tool calls with arguments as objects, tool results."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):  # text parts only (the model refuses others)
            content = "".join(part.text for part in content)
        if content is None and not (m.role == "assistant"):
            raise _bad(f"messages[{i}].content", f"expected a string or a list of text parts for a {m.role} message, got nothing")
        msg: dict = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise _bad(f"messages[{i}].tool_calls", f"only assistant messages carry tool calls, got role {m.role!r}")
            calls = []
            for c in m.tool_calls:
                try:  # templates write arguments as JSON objects (tojson): give them the object, as vLLM does
                    args = json.loads(c.function.arguments)
                except ValueError:
                    args = c.function.arguments
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        if m.role == "tool":
            if m.tool_call_id is None:
                raise _bad(f"messages[{i}].tool_call_id", "expected the id of the call this message answers, got nothing")
            msg["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        out.append(msg)
    return out


def _tool_choice(req: ChatCompletionRequest) -> tuple[str, str | None, list[dict]]:
    if len(req.tools or []) > MAX_TOOLS:
        raise _bad("tools", f"expected at most {MAX_TOOLS} tools, got {len(req.tools)}")
    tools = [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if not isinstance(choice, str):
        names = [t["function"]["name"] for t in tools]
        if choice.function.name not in names:
            raise _bad("tool_choice", f"expected the name of one of the tools ({', '.join(names) or 'none given'}), got {choice.function.name!r}")
        return "named", choice.function.name, tools
    if choice in ("required", "auto") and not tools and req.tool_choice is not None:
        raise _bad("tool_choice", f"{choice!r} needs tools, got none")
    return choice, None, tools


def render_chat(req, tok, tools: list[dict], trust_template: bool = False) -> str:
    """The prompt text from the model's chat template (400 naming ``messages`` when the template refuses). A
    request's own ``chat_template`` only where the worker trusts it (--trust-request-chat-template, as vLLM): a
    template is a program the worker runs."""
    if req.chat_template is not None and not trust_template:
        raise _bad("chat_template", "this worker renders only the model's own chat template (start it with "
                                    "--trust-request-chat-template to accept one from requests)")
    if req.add_generation_prompt and req.continue_final_message:
        raise _bad("continue_final_message", "cannot be combined with add_generation_prompt: true")
    kwargs = dict(req.chat_template_kwargs or {})
    if getattr(req, "reasoning_effort", None) is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    if req.chat_template is not None:
        kwargs["chat_template"] = req.chat_template
    if req.documents is not None:
        kwargs["documents"] = req.documents
    try:
        return tok.apply_chat_template(_messages(req), tools=tools or None, add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message, tokenize=False, **kwargs)
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - a template that rejects these messages is the client's 400
        raise APIError(400, f"messages: the chat template rejected them: {type(e).__name__}: {e}"[:500], param="messages") from None


def build_chat(req: ChatCompletionRequest, tok, info: EngineInfo, defaults: Mapping,
               trust_template: bool = False) -> GenRequest:
    mode, named, tools = _tool_choice(req)
    text = render_chat(req, tok, tools, trust_template)
    ids = tok.encode(text, add_special_tokens=req.add_special_tokens)
    if not ids:
        raise APIError(400, "messages: the chat template produced an empty prompt", param="messages")
    if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
        raise _bad("top_logprobs", "needs logprobs: true")
    so, so_param = _structured(req)
    if mode in ("required", "named"):
        if so is not None:
            raise _bad("tool_choice", f"a forced tool call already constrains the output; {so_param} cannot be combined with it")
        schema = (toolcalls.required_schema(tools, req.parallel_tool_calls is not False) if mode == "required" else
                  next(t["function"].get("parameters") or {"type": "object"} for t in tools if t["function"]["name"] == named))
        so, so_param = StructuredOutput("json", json.dumps(schema)), "tool_choice"
    n = req.n or 1
    if n > MAX_CHOICES:
        raise _bad("n", f"expected at most {MAX_CHOICES}, got {n}")
    values = _common(req, defaults)
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    values.update(max_tokens=_max_tokens(asked, len(ids), info, defaults), logprobs=top, prompt_logprobs=req.prompt_logprobs,
                  structured=so)
    params = _params(values, info, {"structured": so_param, "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"})
    if not req.stream and req.stream_options is not None:
        raise _bad("stream_options", "only with stream: true")
    if req.stream and req.prompt_logprobs is not None:
        raise _bad("prompt_logprobs", "not available when streaming")
    classify_text = "\n".join(m.content if isinstance(m.content, str) else "" for m in req.messages)
    return GenRequest([ids], params, n=n, best_of=n, stop=_stop(req.stop), include_stop=req.include_stop_str_in_output,
                      skip_special=req.skip_special_tokens, stream=bool(req.stream),
                      include_usage=bool(req.stream_options and req.stream_options.include_usage), model=req.model,
                      text=classify_text, prompt_texts=[text], logprobs=top, prompt_logprobs=req.prompt_logprobs,
                      tokens_as_ids=bool(req.return_tokens_as_token_ids), return_token_ids=bool(req.return_token_ids),
                      tool_mode=mode if tools else "none", tools=tools, named_tool=named, include_reasoning=req.include_reasoning,
                      request_id=req.request_id)
