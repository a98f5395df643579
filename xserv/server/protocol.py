"""The OpenAI request bodies the server accepts (pydantic validates them) and its error body.

Types are strict (no "0.5" for a number, no true for an integer); unknown fields are ignored, as OpenAI-compatible
servers do. Range checks that SamplingParams also makes are repeated here so that the 400 names the request's
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


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
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


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict | None = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[Annotated[int, Field(ge=0)]]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


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
