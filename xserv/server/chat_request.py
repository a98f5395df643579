"""A validated request -> the engine's input: the chat template's messages and prompt, the prompt's token ids and
one SamplingParams per choice (the model's generation_config.json defaults for the fields a request leaves out)."""
from __future__ import annotations

from ..sampling import SamplingParams
from ..structured import StructuredOutput
from ..tokenizer import media_input
from .context import ServerContext
from .protocol import MAX_STOP_STRINGS, APIError, ChatCompletionRequest, OtherPart

# SamplingParams fields a request may leave to the model's generation_config.json defaults
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty")


def check_content(messages) -> None:
    """400s for content parts that are not text: an image (video, audio, file) by name, as every model here is
    served text-only, and a part of a type no API has."""
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if not isinstance(part, OtherPart):
                continue
            where = f"messages[{i}].content[{j}]"
            kind = media_input(part.model_dump())
            if kind is not None:
                raise APIError(400, f"{kind} input is not supported: {where} has type {part.type!r} (this server "
                                    f"runs text-only models)", where, "unsupported_content")
            if part.type == "text":
                raise APIError(400, f"{where}.text must be a string", f"{where}.text", "invalid_value")
            raise APIError(400, f"{where}: unknown content part type {part.type!r} (text is supported)", where,
                           "invalid_value")


def template_message(m) -> dict:
    """A request message as chat templates expect it (transformers' format: content always a string)."""
    out = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        # arguments stay the JSON text the client sent: Qwen3's template writes a string as it is, and for a template
        # of the XML form the tokenizer decodes it to the object that template iterates over
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    return out


def enable_thinking_of(req: ChatCompletionRequest) -> bool:
    """Thinking as the template renders it: chat_template_kwargs.enable_thinking (default on), off for a
    thinking_token_budget of 0 (the template's own empty block: the form the model knows for no thinking)."""
    value = (req.chat_template_kwargs or {}).get("enable_thinking", True)
    if not isinstance(value, bool):
        raise APIError(400, "chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs")
    return value and req.thinking_token_budget != 0


def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest) -> str:
    messages = [template_message(m) for m in req.messages]
    kwargs = dict(req.chat_template_kwargs or {})
    kwargs.pop("enable_thinking", None)
    kwargs.pop("tools", None)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    try:
        return ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 enable_thinking=enable_thinking_of(req), tools=tools, **kwargs)
    except Exception as e:  # noqa: BLE001 - the template's raise_exception and Jinja errors are the request's fault
        raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None


def prompt_ids_of(ctx: ServerContext, prompt, param: str) -> list[int]:
    ids = ctx.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise APIError(400, f"{param} is empty: give at least one token", param)
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise APIError(400, f"{param}: token id(s) {bad[:5]} outside the vocabulary (size {ctx.vocab_size})", param)
    if len(ids) >= ctx.max_model_len:
        raise APIError(400, f"{param} has {len(ids)} tokens; the model's context is {ctx.max_model_len} tokens "
                            f"(max_model_len), which leaves no room for output", param, "context_length_exceeded")
    return ids


def sampling_params(ctx: ServerContext, req, num_prompt_tokens: int, *, max_tokens: int | None,
                    max_tokens_param: str, logprobs: int | None, structured: StructuredOutput | None = None,
                    logit_bias: dict | None = None) -> list[SamplingParams]:
    """One SamplingParams per choice (n of them: the same values, seed + i when a seed is given)."""
    room = ctx.max_model_len - num_prompt_tokens
    if max_tokens is None:
        max_tokens = min(ctx.sampling_defaults.get("max_tokens", room), room)
    elif max_tokens > room:
        raise APIError(400, f"{max_tokens_param} {max_tokens} + the prompt's {num_prompt_tokens} tokens is more than "
                            f"the model's context of {ctx.max_model_len} tokens (max_model_len); at most {room} "
                            f"output tokens fit", max_tokens_param, "context_length_exceeded")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(s == "" for s in stop):
        raise APIError(400, "stop: stop strings must not be empty", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
    kw = {name: getattr(req, name) for name in _DEFAULTED}
    for name, value in kw.items():
        if value is None and name in ctx.sampling_defaults:
            kw[name] = ctx.sampling_defaults[name]
    kw = {k: v for k, v in kw.items() if v is not None}
    try:
        params = [SamplingParams(max_tokens=max_tokens, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
                                 ignore_eos=req.ignore_eos, logprobs=logprobs, structured=structured,
                                 logit_bias=logit_bias,
                                 seed=None if req.seed is None else (req.seed + i) % 2**64, **kw)
                  for i in range(req.n)]
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), name if name in SamplingParams.__dataclass_fields__ else None) from None
    return params
