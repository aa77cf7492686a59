"""Structured outputs at the ingress: the grammar a request asks for, checked before it takes a slot.

A request asks with one of: vLLM's `structured_outputs` (json, regex, choice, grammar, json_object) or its older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`; chat's `response_format` (`json_object`,
`json_schema`); chat's `tool_choice` "required" or a named function, whose arguments follow the tool's `parameters`
(the schemas vLLM builds). The spec is compiled here once (blink.shared.grammar: off the event loop, cached by spec,
under a time limit), so what the engine cannot serve is a 400 in OpenAI's envelope before it takes a slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial

from blink.ingress.errors import APIError
from blink.ingress.protocol import ChatRequest, NamedToolChoice, SamplingFields, Tool
from blink.ingress.state import IngressState
from blink.shared.drive_modes import MODES
from blink.shared.grammar import (
    ANY_OBJECT,
    COMPILE_TIMEOUT_S,
    GrammarCompiler,
    GrammarError,
    GrammarKind,
    GrammarSpec,
    check_combination,
)
from blink.shared.grammar_backends import device_regex, guidance

KIND_NAMES = {GrammarKind.JSON_SCHEMA: "json_schema", GrammarKind.REGEX: "regex", GrammarKind.EBNF: "grammar"}
# The kind a field asks for, for a refusal before its spec is made (structured_outputs may ask for any).
PARAM_KINDS = {"guided_json": "json_schema", "response_format": "json_schema", "tool_choice": "json_schema",
               "guided_regex": "regex", "guided_choice": "grammar", "guided_grammar": "grammar"}


async def grammar_of_body(state: IngressState, body: SamplingFields) -> GrammarSpec | None:
    """The grammar the body asks for, checked (check_grammar), or None."""
    try:
        asked = requested_grammar(body)
    except APIError as e:  # malformed, or asked twice: counted by the field that asked
        _refused(state, PARAM_KINDS.get(e.param or "", "unknown"), "invalid")
        raise
    if asked is None:
        return None
    param, spec = asked
    await check_grammar(state, spec, param)
    return spec


def reasoning_end_id(state: IngressState, grammar: GrammarSpec | None, prompt: str) -> int:
    """The token a grammar waits for before it masks (the record's reasoning_end_id), as vLLM masks from the end of
    the reasoning: the reasoning parser's end marker when it is one token and the prompt did not close the block
    already; -1 (from the first token) otherwise. Like vLLM's, a grammar whose model writes no think block never
    starts."""
    parser = state.reasoning_parser
    if grammar is None or parser is None or parser.closed_in(prompt):
        return -1
    end = state.tokenizer.raw.token_to_id(parser.end)
    return -1 if end is None else end


def requested_grammar(body: SamplingFields) -> tuple[str, GrammarSpec] | None:
    """The grammar the body asks for and the field that asks, or None; a 400 when it asks twice or the spec is
    malformed."""
    asked: list[tuple[str, Callable[[], GrammarSpec]]] = []
    if body.structured_outputs is not None:
        asked.append(("structured_outputs", body.structured_outputs.spec))
    for name, make in (("guided_json", GrammarSpec.json_schema), ("guided_choice", GrammarSpec.choice),
                       ("guided_regex", partial(GrammarSpec, GrammarKind.REGEX)),
                       ("guided_grammar", partial(GrammarSpec, GrammarKind.EBNF))):
        if (value := getattr(body, name)) is not None:
            asked.append((name, partial(make, value)))
    if isinstance(body, ChatRequest):
        asked += _chat_grammar(body)
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(400, f"ask for one structured output at a time, not {', '.join(n for n, _ in asked)}",
                       param=asked[1][0])
    param, make = asked[0]
    try:
        spec = make()
        check_combination(body.ignore_eos, body.min_tokens)
    except GrammarError as e:
        raise APIError(400, str(e), param=param) from None
    return param, spec


def _chat_grammar(body: ChatRequest) -> list[tuple[str, Callable[[], GrammarSpec]]]:
    asked: list[tuple[str, Callable[[], GrammarSpec]]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", partial(GrammarSpec.json_schema, ANY_OBJECT)))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_
        asked.append(("response_format", partial(GrammarSpec.json_schema, ANY_OBJECT if schema is None else schema)))
    choice = body.tool_choice
    if body.tools and (choice == "required" or isinstance(choice, NamedToolChoice)):
        asked.append(("tool_choice", lambda: GrammarSpec.json_schema(forced_calls_schema(body))))
    return asked


def forced_calls_schema(body: ChatRequest) -> dict:
    """What a forced tool call's output follows, as vLLM builds it: the named function's parameters; for "required",
    a list of at least one {"name", "parameters"} of any tool (one at most without parallel_tool_calls)."""
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in body.tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise GrammarError(f"tool_choice names {choice.function.name[:64]!r}, which is not among the tools")
        return _parameters(tool)
    defs: dict = {}
    for tool in body.tools:
        defs.update((tool.function.parameters or {}).get("$defs", {}))
    calls = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                        "parameters": {k: v for k, v in _parameters(tool).items() if k != "$defs"}},
         "required": ["name", "parameters"]} for tool in body.tools]}}
    if body.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return {**calls, "$defs": defs} if defs else calls


def _parameters(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


async def check_grammar(state: IngressState, spec: GrammarSpec, param: str) -> None:
    """A 400 unless the engine can serve `spec`: its drive mode masks grammars, it fits the record's grammar area,
    and it compiles within the time limit. Counted in blink:structured_output_requests."""
    kind = KIND_NAMES.get(spec.kind, "grammar")
    try:
        _check_serving(state, spec, param)
        compiler = state.grammars or await state.off_loop(_compiler_for, state)
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(compiler.submit(spec))), compiler.timeout_s)
    except (APIError, GrammarError, TimeoutError) as e:
        _refused(state, kind, _reason(e))
        if isinstance(e, APIError):
            raise
        message = str(e) if isinstance(e, GrammarError) else (
            f"the {kind.replace('_', ' ')} did not compile within {compiler.timeout_s:g} s; simplify it")
        raise APIError(400, message, param=param) from None
    outcome = "device" if MODES[state.info.drive].walks_grammars else "host"
    state.metrics.structured.labels(model_name=state.info.model, kind=kind, outcome=outcome).inc()


def _refused(state: IngressState, kind: str, reason: str) -> None:
    state.metrics.structured.labels(model_name=state.info.model, kind=kind, outcome="refused").inc()
    state.metrics.structured_refused.labels(model_name=state.info.model, kind=kind, reason=reason).inc()


def _reason(error: Exception) -> str:
    """blink:structured_output_refused_requests's reason for a refusal."""
    if isinstance(error, TimeoutError):
        return "timeout"
    if isinstance(error, GrammarError):
        return "invalid"
    return "too_large" if getattr(error, "code", None) == "grammar_too_large" else "unsupported"


def _check_serving(state: IngressState, spec: GrammarSpec, param: str) -> None:
    # Every drive mode serves structured outputs (shared/drive_modes.py): the host mode masks any grammar; the device
    # modes walk a token automaton, so a spec that does not lower to one is refused.
    if MODES[state.info.drive].walks_grammars:
        try:
            device_regex(spec)
        except GrammarError as e:
            raise APIError(400, f"{e} (this engine runs {state.info.drive!r})", param=param,
                           code="unsupported_parameter") from None
        except ImportError:  # outlines-core is not beside the ingress: the engine ends such a request
            pass
    size, limit = len(spec.text.encode()), state.info.max_grammar_bytes
    if size > limit:
        raise APIError(400, f"the structured output's spec is {size} bytes; this server takes {limit} at most "
                       "(--max-grammar-bytes)", param=param, code="grammar_too_large")


def _compiler_for(state: IngressState) -> GrammarCompiler:
    """The ingress's compiler, made on the first constrained request: llguidance whatever the engine masks with (the
    ingress runs without torch, which xgrammar needs); a spec the engine's xgrammar refuses after it is ended there."""
    if state.grammars is None:
        try:
            backend = guidance(state.tokenizer.raw, state.info.vocab_size, state.info.eos_token_ids)
        except ImportError as e:
            raise APIError(400, f"structured outputs need llguidance beside the ingress ({e})",
                           code="unsupported_parameter") from None
        state.grammars = GrammarCompiler(backend, state.grammar_timeout_s or COMPILE_TIMEOUT_S)
    return state.grammars
