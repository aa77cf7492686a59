"""OpenAI request bodies (with vLLM's extra sampling fields), validated at the edge."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from blink.shared.grammar import StructuredOutputs
from blink.shared.request_schema import MAX_LOGIT_BIAS, MAX_LOGPROBS, EdgeFields, logit_bias_pairs
from blink.shared.service_class import ClassName
from blink.shared.settings import RESERVED_TEMPLATE_VARIABLES

MAX_STOP_STRINGS = 8
MAX_CHOICES = 16  # choices a request may ask for (n, times its prompts)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = Field(False, description="with include_usage, every chunk carries the "
                                               "usage so far (vLLM's)")


class SamplingFields(EdgeFields):
    """Fields both endpoints share: the knobs (temperature, top_p, top_k, min_p, the penalties, ignore_eos,
    priority) and what the offline API takes too (stop_token_ids, seed, prompt_logprobs, the SLOs:
    blink.shared.request_schema), and these."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: StrictInt | None = Field(None, ge=1)
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    user: str | None = None
    # vLLM's extensions.
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    logit_bias: dict[str, StrictFloat] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id -> a bias in [-100, 100] added to its logit")
    cache_salt: str | None = Field(None, min_length=1, max_length=1024, description="requests share cached KV "
                                   "pages only with requests of the same salt (vLLM's; prefix caching)")
    # Blink's: the service class (else the x-blink-class header, else the default); SLOs not given are its.
    service_class: ClassName | None = None
    # vLLM's structured outputs (blink.ingress.structured): one of these, or chat's response_format or forced tools.
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = Field(None, description="a JSON schema the output follows (vLLM's older name)")
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, description="an EBNF grammar whose start rule is root")

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options may only be given with stream: true")  # as OpenAI and vLLM answer
        return self

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        logit_bias_pairs(v)
        return v


class CompletionRequest(SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    # OpenAI's default for completions (chat fills the context); 0 with echo scores the prompt only (lm-eval's
    # loglikelihood requests).
    max_tokens: StrictInt | None = Field(16, ge=0)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = Field(False, description="the prompt before the completion, with its logprobs if asked")
    best_of: Literal[1] | None = None
    suffix: None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, tool_call_id, name...: the chat template's business
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: object) -> object:
        # Said plainly: the union's own error for an image part is "Input should be a valid string".
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"content parts of type {kind[:40]!r} are not supported: this model takes text")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema, rendered into the prompt by the chat template
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema", description="the JSON schema; none: any JSON object")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # false: one call at most (the first the model writes)
    store: Literal[False] | None = Field(None, description="Blink stores no completions: only false is accepted")
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="more variables for the chat template (e.g. enable_thinking), over the server's "
        "--default-chat-template-kwargs (vLLM's)")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_request_s_own(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v and (reserved := RESERVED_TEMPLATE_VARIABLES & v.keys()):
            raise ValueError(f"may not set {', '.join(sorted(reserved))}: the request's own fields give them")
        return v

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")  # as OpenAI answers
        return self


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]


# OpenAI's /v1/responses, stateless (blink.ingress.responses_api translates it onto chat).
class ResponseText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list | None = None  # an earlier output's, given back


class ResponseMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ResponseText]
    id: str | None = None  # an earlier output's, given back
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class ResponseFunctionOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ResponseTool(FunctionDefinition):
    """The Responses API's function tool: a chat tool's function, flattened."""

    type: Literal["function"]


class ResponseToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class ResponseTextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_fields_with_json_schema(self) -> ResponseTextFormat:
        # Else a schema given with json_object (or text) would be accepted and not followed.
        given = [name for name in ("name", "description", "schema_", "strict") if getattr(self, name) is not None]
        if given and self.type != "json_schema":
            raise ValueError(f"{given[0].rstrip('_')} belongs to type json_schema, not {self.type}")
        return self


class ResponseTextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: ResponseTextFormat | None = None


class ResponsesRequest(BaseModel):
    """The stateless part of OpenAI's Responses API: no stored responses, so no previous_response_id."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[ResponseMessage | ResponseFunctionCall | ResponseFunctionOutput] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    tools: list[ResponseTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ResponseToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: ResponseTextConfig | None = None
    stream: StrictBool = False
    store: Literal[False] | None = Field(None, description="Blink stores no responses: only false is accepted")
    metadata: dict[str, str] | None = None
    user: str | None = None
