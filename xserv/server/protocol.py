"""The OpenAI request bodies the server accepts (pydantic validates them) and its error body.

Types are strict (no "0.5" for a number, no true for an integer). Fields of OpenAI's (and vLLM's) APIs that xserv
does not implement are refused with a 400 naming them (`UNSUPPORTED`) unless their value is one that changes
nothing; fields that only label a request for OpenAI's platform (`user`, `metadata`, ...) are ignored
(`IGNORED`); other unknown fields are ignored, as OpenAI-compatible servers do. Range checks that SamplingParams also makes are repeated here so that the 400 names the request's
own field (`max_completion_tokens`, `top_logprobs`).
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..sampling import MAX_LOGPROBS, MAX_N

MAX_STOP_STRINGS = 16

Finite = Annotated[float, Field(allow_inf_nan=False)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Request(_Body):
    """A top-level request body: unknown fields are kept (model_extra) so that `unsupported_field` can see them."""
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    """response_format's json_schema: {"name", "description", "schema", "strict"}. The schema is always enforced
    (strict true or false: xserv constrains the tokens either way)."""
    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _SamplingFields(_Request):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: Finite | None = Field(None, ge=0)
    top_p: Finite | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: Finite | None = Field(None, ge=0, le=1)
    presence_penalty: Finite | None = Field(None, ge=-2, le=2)
    frequency_penalty: Finite | None = Field(None, ge=-2, le=2)
    repetition_penalty: Finite | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # the answer's constraint (xserv/server/constraints.py: at most one of them) and logit_bias (checked there too,
    # so that every problem names the field)
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict | None = None
    logit_bias: dict | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class OtherPart(_Body):
    """A content part that is not text (image_url, input_audio, file, ...): kept so that the chat endpoint can refuse
    it by name (chat_request.check_content) instead of a validation error about the text part it is not."""
    model_config = ConfigDict(extra="allow", strict=True)
    type: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCallIn(_Body):
    """A call of an earlier assistant turn, as the client sends the history back."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns
    reasoning_content: str | None = None  # assistant turns (the template may show it again)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # with thinking on: at most this many reasoning tokens, then </think> is forced and the answer follows (0: thinking
    # off, as enable_thinking false); vLLM's name
    thinking_token_budget: int | None = Field(None, ge=0)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[Annotated[int, Field(ge=0)]]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


# ---- fields xserv does not implement ------------------------------------------------------------------------------
def _absent(v) -> bool:
    return v is None


def _off(v) -> bool:
    return v is None or v is False


def _empty(v) -> bool:
    return v is None or v == {} or v == [] or v == ""


# field -> (the values that change nothing, why the others are refused); both endpoints unless listed per endpoint
UNSUPPORTED_COMMON = {
    "guided_whitespace_pattern": (_absent, "guided_whitespace_pattern is not supported (JSON answers are compact)"),
    "use_beam_search": (_off, "beam search is not supported"),
    "min_tokens": (lambda v: v is None or v == 0, "min_tokens is not supported"),
    "prompt_logprobs": (_absent, "prompt logprobs are not supported"),
    "include_stop_str_in_output": (_off, "stop strings are never part of the output here"),
    "allowed_token_ids": (_absent, "allowed_token_ids is not supported"),
    "bad_words": (_empty, "bad_words is not supported"),
    "truncate_prompt_tokens": (_absent, "prompt truncation is not supported"),
    "echo": (_off, "echo (the prompt in the output) is not supported"),
}
UNSUPPORTED_CHAT = UNSUPPORTED_COMMON | {
    "functions": (_absent, "functions/function_call are deprecated by OpenAI: use tools/tool_choice"),
    "function_call": (_absent, "functions/function_call are deprecated by OpenAI: use tools/tool_choice"),
    "audio": (_absent, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is supported (modalities: [\"text\"])"),
    "prediction": (_absent, "predicted outputs are not supported"),
    "web_search_options": (_absent, "web search is not supported"),
    "reasoning_effort": (_absent, "reasoning_effort is not supported: switch Qwen3's thinking with "
                                  "chat_template_kwargs {\"enable_thinking\": false} or bound it with "
                                  "thinking_token_budget"),
    "verbosity": (_absent, "verbosity is not supported"),
    "continue_final_message": (_off, "continue_final_message is not supported"),
    "add_generation_prompt": (lambda v: v is None or v is True, "add_generation_prompt false is not supported"),
    "chat_template": (_absent, "a request's own chat_template is not supported"),
    "documents": (_absent, "documents are not supported"),
}
UNSUPPORTED_COMPLETION = UNSUPPORTED_COMMON | {
    "suffix": (_empty, "suffix (insertion) is not supported"),
    "thinking_token_budget": (_absent, "a thinking budget bounds a chat answer's think block: use "
                                       "/v1/chat/completions"),
}
# accepted and ignored: they label the request for OpenAI's platform and change nothing in the answer
IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "request_id",
           "priority")


def unsupported_field(req, table: dict) -> APIError | None:
    """A 400 naming the first field of `req` that xserv does not implement, with a value that would matter."""
    extra = req.model_extra or {}
    for name, (harmless, why) in table.items():
        if name in extra and not harmless(extra[name]):
            return APIError(400, f"{name} is not supported by this server: {why}", name, "unsupported_field")
    best_of = extra.get("best_of")
    if best_of is not None and best_of != getattr(req, "n", 1) and "best_of" not in table:
        return APIError(400, f"best_of is not supported by this server (best_of {best_of!r} with n "
                             f"{getattr(req, 'n', 1)}): only best_of = n", "best_of", "unsupported_field")
    return None


# ---- errors -------------------------------------------------------------------------------------------------------
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "internal_server_error", 503: "server_unavailable"}


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def validation_error(errors: list[dict]) -> APIError:
    """A 400 naming the first problem pydantic found (`messages[0].role: Input should be ...`)."""
    if not errors:
        return APIError(400, "invalid request body")
    e = errors[0]
    loc = [part for part in e.get("loc", ()) if part != "body"]
    kind = e.get("type", "")
    if kind == "json_invalid":
        detail = e.get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON ({detail})".replace(" ()", ""), None,
                        "invalid_json")
    # drop pydantic's union-branch labels ("str", "list[...]", "function-after[...]") from the location
    loc = [part for part in loc if isinstance(part, int) or ("[" not in part and part not in ("str", "int", "float",
                                                                                               "bool", "list"))]
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else part)
    if kind == "missing":
        message = f"{param} is required" if param else "the request body is required (a JSON object)"
    elif kind in ("model_type", "dict_type", "model_attributes_type") and not param:
        message = "the request body must be a JSON object"
    else:
        message = f"{param}: {e.get('msg', 'invalid value')}" if param else e.get("msg", "invalid request")
    return APIError(400, message, param or None, "invalid_value" if kind != "missing" else "missing_field")
