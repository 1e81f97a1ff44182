"""Structured outputs over HTTP: the request fields that constrain the output, as one ``rollout.StructuredOutputs``.

A request may constrain its output with one of (vLLM's, OpenAI's and SGLang's names):

- ``response_format`` (OpenAI's; chat and completions): ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
- ``structured_outputs`` (vLLM's ``StructuredOutputsParams``): ``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``, ``disable_any_whitespace``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``;
- SGLang's ``regex``, ``json_schema`` and ``ebnf``;
- on chat, ``tool_choice: "required"`` or a named function (``{"type": "function", "function": {"name": ...}}``):
  the output is one Hermes tool call (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, the format
  ``chat.parse_tool_calls`` reads), or several when ``parallel_tool_calls`` is not false, whose arguments validate
  against the tool's ``parameters`` schema (an EBNF grammar of the call text, built from that schema by xgrammar).

More than one of them is a 400 naming them; a bad value a 400 whose ``param`` names the field as the request spells
it (``response_format.json_schema.schema``, ``structured_outputs.regex``, ``guided_choice``,
``tools.0.function.parameters``...). Everything here reads the body alone, but for the tool-call format: the chat
template must write Hermes tool calls (it names ``<tool_call>``), else forcing a tool is refused naming ``tool_choice``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rollout import FieldError, StructuredOutputs
from rollout.serve.chat import TOOL_CALL_OPEN
from rollout.serve.protocol import ChatCompletionRequest, SamplingFields
from rollout.structured_outputs import import_xgrammar

__all__ = ["request_structured_outputs"]

TOOL_CALL_CLOSE = "</tool_call>"
# The single-field spellings: request field -> the ``StructuredOutputs`` field it sets.
ALIASES = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "regex": "regex",  # SGLang's
    "json_schema": "json",  # SGLang's (a JSON schema's text)
    "ebnf": "grammar",  # SGLang's (its EBNF is xgrammar's dialect too)
}


def request_structured_outputs(req: SamplingFields, tokenizer: Any = None) -> StructuredOutputs | None:
    """The constraint a request's fields ask for, or None when they ask for none.

    Args:
        req: a completions or chat body.
        tokenizer: the served tokenizer (its chat template must write Hermes tool calls for a forced ``tool_choice``);
            None skips that check.

    Returns:
        The request's ``StructuredOutputs`` (parsed by xgrammar: a bad schema, regex or grammar was refused).

    Raises:
        FieldError: more than one field constrains the output (``field`` the second, the message names them all); a
            bad value (``field`` as the request spells it); ``tool_choice`` forcing a tool that ``tools`` lacks, or a
            chat template that writes no Hermes tool calls.
    """
    given: list[tuple[str, Any]] = []
    rf = req.response_format
    if rf is not None and not (isinstance(rf, Mapping) and rf.get("type") == "text"):
        given.append(("response_format", rf))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", req.structured_outputs))
    for name in ALIASES:
        if getattr(req, name) is not None:
            given.append((name, getattr(req, name)))
    if isinstance(req, ChatCompletionRequest) and req.tool_choice not in (None, "auto", "none"):
        given.append(("tool_choice", req.tool_choice))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise FieldError(
            given[1][0],
            f"{given[1][0]}: a request constrains its output with one field at most; it set {names}",
        )
    name, value = given[0]
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        # Clients that serialise vLLM's StructuredOutputsParams send its unset fields as null: those change nothing.
        return StructuredOutputs.coerce({k: v for k, v in value.items() if v is not None})
    if name == "tool_choice":
        assert isinstance(req, ChatCompletionRequest)
        return _tool_call(req, tokenizer)
    return _renamed(name, lambda: StructuredOutputs(**{ALIASES[name]: value}))


def _renamed(field: str, build: Any) -> StructuredOutputs:
    """``build()``, with the ``FieldError`` of a bad value (``structured_outputs.<kind>``) naming the request's
    ``field`` instead."""
    try:
        return build()
    except FieldError as e:
        message = str(e).replace(e.field, field, 1) if str(e).startswith(e.field) else f"{field}: {e}"
        raise FieldError(field, message) from e


def _response_format(value: Any) -> StructuredOutputs:
    """OpenAI's ``response_format`` (``json_object`` or ``json_schema``; ``text`` was taken as none)."""
    if not isinstance(value, Mapping):
        raise FieldError("response_format", f"response_format: an object is expected, got {value!r:.80}")
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise FieldError(
            "response_format.type",
            f"response_format.type: {kind!r} is not supported; one of 'text', 'json_object', 'json_schema'",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping) or "schema" not in spec:
        raise FieldError(
            "response_format.json_schema.schema",
            "response_format.json_schema.schema: a JSON schema is required with type 'json_schema' "
            '({"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}})',
        )
    return _renamed("response_format.json_schema.schema", lambda: StructuredOutputs(json=spec["schema"]))


def _tool_call(req: ChatCompletionRequest, tokenizer: Any) -> StructuredOutputs:
    """The EBNF grammar of the Hermes tool call(s) that ``req.tool_choice`` forces."""
    choice = req.tool_choice
    tools = req.tools or []
    if not tools:
        raise FieldError("tool_choice", f"tool_choice: {choice!r} forces a tool call, but the request has no tools")
    if choice == "required":
        forced = list(enumerate(tools))
    else:
        name = choice.get("function", {}).get("name") if isinstance(choice, Mapping) else None
        if not (isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(name, str)):
            raise FieldError(
                "tool_choice",
                "tool_choice: one of 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}, "
                f"got {choice!r:.80}",
            )
        forced = [(i, t) for i, t in enumerate(tools) if t.function.name == name]
        if not forced:
            offered = ", ".join(repr(t.function.name) for t in tools)
            raise FieldError("tool_choice", f"tool_choice: no tool is named {name!r}; the request offers {offered}")
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else ""
    templates = template.values() if isinstance(template, Mapping) else [template]
    if tokenizer is not None and not any(isinstance(t, str) and TOOL_CALL_OPEN in t for t in templates):
        raise FieldError(
            "tool_choice",
            f"tool_choice: the served model's chat template writes no Hermes tool calls ({TOOL_CALL_OPEN}...), the "
            "only format rollout-serve parses, so a forced tool call cannot be constrained; use 'auto'",
        )
    xgr = import_xgrammar()
    calls = []
    for i, tool in forced:
        # One call's JSON: this tool's name, and arguments that validate against its parameters. A tool without
        # parameters (OpenAI: it takes none) is called with an empty object, as vLLM constrains it; an empty schema
        # would let any JSON value (a number, a string) be its arguments.
        parameters = tool.function.parameters or {"type": "object", "properties": {}}
        schema = {
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        try:
            calls.append(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
        except (RuntimeError, ValueError, TypeError) as e:
            param = f"tools.{i}.function.parameters"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise FieldError(param, f"{param}: not a JSON schema that xgrammar accepts: {first}") from e
    body = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    call = xgr.Grammar.concat(
        xgr.Grammar.from_ebnf(f'root ::= "{TOOL_CALL_OPEN}\\n"'),
        body,
        xgr.Grammar.from_ebnf(f'root ::= "\\n{TOOL_CALL_CLOSE}"'),
    )
    # Renamed so that a root rule can repeat it: one call, or several when parallel calls are allowed.
    lines = str(call).splitlines()
    assert lines[0].startswith("root ::= "), lines[0]
    lines[0] = "tool_call ::= " + lines[0][len("root ::= ") :]
    root = 'root ::= tool_call ("\\n" tool_call)*' if req.parallel_tool_calls is not False else "root ::= tool_call"
    return _renamed("tool_choice", lambda: StructuredOutputs(grammar="\n".join([root, *lines])))
