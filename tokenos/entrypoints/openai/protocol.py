"""The OpenAI-compatible wire format: request validation, sampling-parameter mapping, responses.

Requests are strict pydantic models: a field of the wrong type ("0.5" for a float, 1.0 for an
int) is rejected rather than coerced, and range rules (temperature >= 0, top_p in (0, 1], n >= 1,
max_tokens >= 1, non-empty messages, ...) live on the fields, so a violation names its `param`.
The server answers every violation with 400 and an OpenAI-style body (`ErrorResponse`).
`to_sampling_params()` is the one place a request becomes engine parameters; the front door
(`tokenos.engine.input_processor`) then checks it against the model.
Unknown fields are ignored (clients send extras), as vLLM does, EXCEPT fields that name a feature
tokenos does not implement yet (logits processors, best_of > n, ...): those are refused with
400 (`reject_unsupported`), because ignoring them would silently change what the client gets.
Structured output (``response_format``, ``structured_outputs``, ``guided_*``) becomes a
`StructuredOutputsParams` (`structured_outputs()`), and so does a forced ``tool_choice``
(`tokenos.entrypoints.openai.tool_choice`).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from tokenos.core.messages import StructuredSpec
from tokenos.core.validation import INT64_MAX, INT64_MIN, InvalidRequestError
from tokenos.entrypoints.openai.tool_choice import (
    ToolChoiceError,
    forced_schema,
    is_forced,
    resolve_tool_choice,
)
from tokenos.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tokenos.structured.backend import GrammarError, backend_name, check_grammar

# ------------------------------------------------------------------ errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class OpenAIError(Exception):
    """An error a client caused (or an engine failure), with its HTTP status and OpenAI body."""

    TYPES = {
        400: "invalid_request_error",
        401: "invalid_request_error",
        404: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "server_error",
    }

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds, sent as Retry-After (429 / 503)

    def to_response(self) -> ErrorResponse:
        kind = self.TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        )


# ------------------------------------------------------------------ requests

# Ranges shared by both endpoints (OpenAI's, widened where vLLM widens them).
Temperature = Annotated[float | None, Field(ge=0.0)]
TopP = Annotated[float | None, Field(gt=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
MaxTokens = Annotated[int | None, Field(ge=1)]
NumTopLogprobs = Annotated[int | None, Field(ge=0, le=20)]


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


_SURROGATE = re.compile("[\ud800-\udfff]")


def holds(value: Any, is_bad: Any) -> bool:
    """Whether `is_bad` holds for a scalar anywhere inside `value` (model fields, dict keys and values,
    list items)."""
    if isinstance(value, BaseModel):
        return any(holds(v, is_bad) for v in value.__dict__.values())
    if isinstance(value, dict):
        return any(holds(k, is_bad) or holds(v, is_bad) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(holds(v, is_bad) for v in value)
    return is_bad(value)


def _is_surrogate_text(value: Any) -> bool:
    return isinstance(value, str) and _SURROGATE.search(value) is not None


class RequestModel(StrictModel):
    """A top-level request body. Its strings must be valid Unicode: JSON escapes can smuggle in lone
    surrogates, which no tokenizer encodes and no response can carry, so they are refused up front."""

    @model_validator(mode="after")
    def _valid_unicode(self) -> RequestModel:
        self.refuse_fields_holding(
            _is_surrogate_text, "`{name}` is not valid Unicode (it holds a lone surrogate)."
        )
        return self

    def refuse_fields_holding(self, is_bad: Any, message: str) -> None:
        """400 naming the first field (known or extra) with a value `is_bad` holds for anywhere inside."""
        for name, value in {**self.__dict__, **(self.model_extra or {})}.items():
            if holds(value, is_bad):
                raise OpenAIError(message.format(name=name), param=name)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


def _unset(value: Any) -> bool:
    return value is None


def _no_tools(value: Any) -> bool:
    return value is None or value == []


def _no_tool_choice(value: Any) -> bool:
    return value is None or value == "none"


def _response_format(value: Any) -> dict[str, Any]:
    """OpenAI's response_format: json_schema (its ``schema``) or json_object."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise TypeError("response_format must be an object with a type")
    kind = value["type"]
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, dict) or not isinstance(body.get("schema"), dict):
            raise TypeError("response_format json_schema needs json_schema.schema, a JSON schema object")
        return {"json": body["schema"]}
    raise TypeError(f"response_format type {kind!r} is not supported (json_schema, json_object or text)")


def _backend_or_none(name: Any) -> str | None:
    try:
        return backend_name(name) if isinstance(name, str) else None
    except ValueError:
        return None


_GRAMMAR_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def _structured_body(value: Any) -> dict[str, Any]:
    """vLLM's structured_outputs object: one of json, json_object, regex, choice, grammar."""
    if not isinstance(value, dict):
        raise TypeError("structured_outputs must be an object")
    known = {*_GRAMMAR_KEYS, "disable_any_whitespace"}
    unknown = {k for k, v in value.items() if k not in known and v not in (None, False)}
    if unknown:
        raise TypeError(f"unsupported structured_outputs fields {sorted(unknown)}")
    return {k: v for k, v in value.items() if k in known}


# Fields that ask for structured output -> their StructuredOutputsParams keywords.
_STRUCTURED_FIELDS = {
    "response_format": _response_format,
    "structured_outputs": _structured_body,
    "guided_json": lambda v: {"json": v},
    "guided_regex": lambda v: {"regex": v},
    "guided_choice": lambda v: {"choice": v},
    "guided_grammar": lambda v: {"grammar": v},
}


# Request fields that would change what the user gets, refused until tokenos implements them: field ->
# (accepted when, what to say). Everything else unknown is ignored, as vLLM does.
_UNSUPPORTED_SAMPLING = {
    "guided_whitespace_pattern": (_unset, "guided_whitespace_pattern is not supported"),
    "logits_processors": (_unset, "logits_processors are not supported"),
}
_UNSUPPORTED_CHAT = {
    "functions": (_no_tools, "functions is deprecated and not supported: use tools"),
    "function_call": (_no_tool_choice, "function_call is deprecated and not supported: use tool_choice"),
    "documents": (_unset, "documents are not supported yet"),
}


class SamplingFields(RequestModel):
    """Fields both endpoints share: OpenAI's sampling knobs plus vLLM's extras."""

    # Unknown fields are kept (not validated) so that the unsupported ones can be refused by name.
    model_config = ConfigDict(strict=True, extra="allow")
    unsupported: ClassVar[dict[str, tuple[Any, str]]] = _UNSUPPORTED_SAMPLING

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Temperature = None
    top_p: TopP = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: Annotated[float | None, Field(ge=0.0, le=1.0)] = None
    repetition_penalty: Annotated[float | None, Field(gt=0.0)] = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    cache_salt: str | None = None
    priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] = 0
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's: the top-n logprobs of every prompt token (the first has none), returned as prompt_logprobs.
    prompt_logprobs: Annotated[int | None, Field(ge=0)] = None
    # vLLM's: only these ids may be sampled; words never to generate; keep the prompt's last k tokens.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Annotated[int | None, Field(ge=-1)] = None
    # vLLM's: the request's extra_args, read by the engine's custom logits processors.
    vllm_xargs: dict[str, str | int | float | bool | list[str | int | float]] | None = None

    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def reject_unsupported(self) -> None:
        """400 for a field naming a feature tokenos does not implement (see ``_UNSUPPORTED_*``)."""
        extra = self.model_extra or {}
        for name, (accepted, what) in self.unsupported.items():
            if name in extra and not accepted(extra[name]):
                raise OpenAIError(f"{what}: remove `{name}` from the request.", param=name)
        best_of = extra.get("best_of")
        if best_of is not None and best_of != self.n:
            raise OpenAIError("best_of other than n is not supported yet.", param="best_of")

    def structured_outputs(self, backend: str = "guidance") -> StructuredOutputsParams | None:
        """The request's grammar from whichever field names it: OpenAI's ``response_format``, vLLM's
        ``structured_outputs``, or the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
        ``guided_grammar``; 400 when several do, when one is malformed, or when ``backend`` (the
        server's grammar backend) cannot compile it."""
        extra = self.model_extra or {}
        asked = extra.get("guided_decoding_backend")
        if asked is not None and _backend_or_none(asked) != backend:
            raise OpenAIError(
                f"guided_decoding_backend {asked!r} is not available: this server uses {backend}.",
                param="guided_decoding_backend",
            )
        found = {name: value for name in _STRUCTURED_FIELDS if (value := extra.get(name)) is not None}
        fmt = found.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") == "text" and len(fmt) == 1:
            del found["response_format"]
        # structured_outputs may carry only options (disable_any_whitespace) for another field's grammar.
        body = found.get("structured_outputs")
        options = {}
        if isinstance(body, dict):
            if body.get("disable_any_whitespace") is not None:
                options["disable_any_whitespace"] = body["disable_any_whitespace"]
            if not any(body.get(k) not in (None, False) for k in _GRAMMAR_KEYS) and len(found) > 1:
                del found["structured_outputs"]
        if len(found) > 1:
            raise OpenAIError(
                f"Give one structured-output field, not {sorted(found)}.", param=sorted(found)[0]
            )
        if not found:
            return None
        ((name, value),) = found.items()
        try:
            params = StructuredOutputsParams(**{**_STRUCTURED_FIELDS[name](value), **options})
            check_grammar(StructuredSpec(*params.spec()), backend)
        except InvalidRequestError as e:
            raise OpenAIError(e.message, param=name) from e
        except (TypeError, GrammarError) as e:
            raise OpenAIError(f"Malformed {name}: {e}", param=name) from e
        return params

    def to_sampling_params(self, structured_backend: str = "guidance") -> SamplingParams:
        """Engine parameters for this request (max_tokens None: up to the context length); grammars are
        checked against ``structured_backend``."""
        self.reject_unsupported()
        max_tokens = self.requested_max_tokens()
        structured = self.structured_outputs(structured_backend)
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                seed=self.seed,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=self._logit_bias(),
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                logprobs=self._num_logprobs(),
                prompt_logprobs=self.num_prompt_logprobs(),
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
                structured_outputs=structured,
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                extra_args=self.vllm_xargs,
            )
        except InvalidRequestError as e:
            raise OpenAIError(e.message, param=e.param) from e
        except ValueError as e:
            raise OpenAIError(str(e)) from e

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise OpenAIError(
                "logit_bias keys must be token ids (integers as strings).", param="logit_bias"
            ) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 (with echo: the prompt alone, as OpenAI's legacy API and vLLM allow) runs one token and drops it.
    max_tokens: Annotated[int | None, Field(ge=0)] = 16
    logprobs: Annotated[int | None, Field(ge=0, le=20)] = None
    echo: bool = False

    def requested_max_tokens(self) -> int | None:
        return max(self.max_tokens, 1) if self.max_tokens is not None else None

    def num_prompt_logprobs(self) -> int | None:
        """Echoing with logprobs scores the prompt too (what lm-eval's loglikelihood reads)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one text or one token-id list each; 400 when empty."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise OpenAIError("prompt must not be empty.", param="prompt")
        return prompts


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionDefinition(StrictModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    model_config = ConfigDict(strict=True, extra="allow")  # tool_calls, tool_call_id ... reach the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            message["content"] = ""
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_template_tool_call(call) for call in message["tool_calls"]]
        return message


def _template_tool_call(call: Any) -> Any:
    """An assistant's earlier call as templates read it: OpenAI sends the arguments as JSON text,
    templates write them with ``tojson``, so they get the object (as vLLM does)."""
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call


class ChatCompletionRequest(SamplingFields):
    unsupported: ClassVar[dict[str, tuple[Any, str]]] = {**_UNSUPPORTED_SAMPLING, **_UNSUPPORTED_CHAT}

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: MaxTokens = None
    logprobs: bool = False
    top_logprobs: NumTopLogprobs = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is continued, not answered
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM's: False drops reasoning_content from the response

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict() for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def resolved_tool_choice(self) -> str | None:
        """ "none" / "auto" / "required" / the forced function's name; None without tools (400 when
        the combination is invalid)."""
        choice = (
            self.tool_choice.model_dump() if isinstance(self.tool_choice, BaseModel) else self.tool_choice
        )
        try:
            return resolve_tool_choice(self.tool_dicts(), choice)
        except ToolChoiceError as e:
            raise OpenAIError(str(e), param=e.param) from e

    def structured_outputs(self, backend: str = "guidance") -> StructuredOutputsParams | None:
        """A forced tool choice is a grammar too: it cannot be combined with another one."""
        params = super().structured_outputs(backend)
        choice = self.resolved_tool_choice()
        if not is_forced(choice):
            return params
        if params is not None:
            raise OpenAIError(
                f"tool_choice {choice!r} forces a tool call: it cannot be combined with a structured-output "
                "field (response_format, structured_outputs, guided_*).",
                param="tool_choice",
            )
        schema = forced_schema(self.tool_dicts(), choice, self.parallel_tool_calls)
        try:
            # Compact JSON: arguments are JSON text anyway, and a call cannot wander off into whitespace.
            params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
            check_grammar(StructuredSpec(*params.spec()), backend)
        except (InvalidRequestError, GrammarError) as e:
            raise OpenAIError(f"The tools' parameter schemas do not compile: {e}", param="tools") from e
        return params

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true.", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict() for m in self.messages or []]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# ------------------------------------------------------------------ responses


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token (None for the first), token id -> its logprob.
PromptLogprobsField = list[dict[int, PromptLogprob] | None] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsField = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobsField = None


class _OmitNone(BaseModel):
    """Serialized without its None fields: clients merge deltas key by key, and a null ``type`` or
    ``id`` in a later fragment would overwrite the first fragment's (the openai client does)."""

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_OmitNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitNone):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall


class DeltaMessage(_OmitNone):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobsField = None  # on the first chunk with a token, when asked for


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenos"
    root: str | None = None
    # A LoRA adapter's base model (vLLM's field); None for the base model itself.
    parent: str | None = None
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(StrictModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; adapters are named


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
