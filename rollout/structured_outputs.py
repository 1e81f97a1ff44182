"""A request's structured-output constraint (``StructuredOutputs``), checked when constructed.

vLLM's ``StructuredOutputsParams`` under the same field names: exactly one of ``json`` (a JSON schema), ``regex``,
``choice``, ``grammar`` (EBNF, xgrammar's dialect) or ``json_object`` (any JSON object). Construction parses the
constraint with xgrammar (no tokenizer needed), so a bad schema, regex or grammar is refused at the public boundary
with a ``FieldError`` naming ``structured_outputs.<kind>``; the engine compiles it against its tokenizer later
(``engine.sample.structured``). xgrammar is imported lazily: it is the optional extra ``rollout[structured]``.
Leaf module but for ``checks``.
"""

from __future__ import annotations

import json as _json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rollout.checks import FieldError

__all__ = ["StructuredOutputs", "TokenMatcher", "import_xgrammar"]

KINDS = ("json", "regex", "choice", "grammar", "json_object")


def import_xgrammar() -> Any:
    """The ``xgrammar`` module.

    Raises:
        ImportError: it is not installed; the message names the extra that installs it.
    """
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(
            "structured_outputs needs the xgrammar library: pip install 'rollout[structured]' (xgrammar>=0.2)"
        ) from e
    return xgrammar


class TokenMatcher(Protocol):
    """What a request needs of its grammar matcher (xgrammar's ``GrammarMatcher`` is one)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (and no change) when the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """True once an end-of-sequence id was accepted where the grammar may end."""
        ...


def _ebnf_literal(text: str) -> str:
    """``text`` as a double-quoted EBNF string literal of xgrammar's dialect (backslash and quote escaped)."""
    for raw, escaped in (("\\", "\\\\"), ('"', '\\"'), ("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t")):
        text = text.replace(raw, escaped)
    return f'"{text}"'


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match: exactly one kind, validated at construction.

    Attributes:
        json: a JSON schema, as a dict or its JSON text; stored as JSON text (key order kept: it is the order of the
            generated object's properties).
        regex: a regular expression the whole output must match (xgrammar's regex dialect).
        choice: the output is exactly one of these non-empty strings; a list is stored as a tuple.
        grammar: an EBNF grammar (xgrammar's dialect, GBNF-like, start rule ``root``).
        json_object: True: any JSON object (``response_format={"type": "json_object"}``).
        disable_any_whitespace: for ``json`` and ``json_object``: no free whitespace between JSON tokens (vLLM's field
            of that name); False lets the model put whitespace where JSON allows it.

    The output may end (an end-of-sequence token is allowed) exactly where the constraint is complete; it still ends at
    ``max_new_tokens``, complete or not.

    Raises:
        FieldError: no kind or more than one (``structured_outputs``), or a bad value of one (``field`` is
            ``structured_outputs.<kind>``: a schema that is not a JSON object or that xgrammar cannot convert, a regex
            or grammar it cannot parse, an empty choice list); the message names what is allowed.
        ImportError: xgrammar is not installed (``import_xgrammar``).
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise FieldError(
                "structured_outputs",
                f"structured_outputs must set exactly one of json, regex, choice, grammar or json_object, got {got}",
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise FieldError(
                "structured_outputs.disable_any_whitespace",
                f"structured_outputs.disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}",
            )
        kind = given[0]
        name = f"structured_outputs.{kind}"
        if kind == "json":
            schema = self.json
            if isinstance(schema, Mapping):
                try:
                    schema = _json.dumps(schema)
                except (TypeError, ValueError) as e:
                    raise FieldError(name, f"{name} must be a JSON schema (a dict or its JSON text): {e}") from e
            if not isinstance(schema, str):
                raise FieldError(name, f"{name} must be a JSON schema (a dict or its JSON text), got {schema!r:.80}")
            object.__setattr__(self, "json", schema)
        elif kind == "choice":
            choice = self.choice
            if isinstance(choice, Sequence) and not isinstance(choice, (str, bytes)):
                choice = tuple(choice)
            if not (isinstance(choice, tuple) and choice and all(isinstance(c, str) and c for c in choice)):
                raise FieldError(name, f"{name} must be a non-empty list of non-empty str, got {self.choice!r:.80}")
            object.__setattr__(self, "choice", choice)
        elif kind == "json_object":
            if self.json_object is not True:
                raise FieldError(name, f"{name} must be True or False, got {self.json_object!r}")
        elif not (isinstance(getattr(self, kind), str) and getattr(self, kind)):
            raise FieldError(name, f"{name} must be a non-empty str, got {getattr(self, kind)!r:.80}")
        try:
            self.to_grammar()
        except (RuntimeError, ValueError) as e:
            what = {"json": "a JSON schema", "regex": "a regular expression", "grammar": "an EBNF grammar"}.get(kind)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise FieldError(name, f"{name} must be {what or 'valid'} that xgrammar accepts: {first}") from e

    @property
    def kind(self) -> str:
        """The one kind set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, its text, disable_any_whitespace): what a compiled grammar is cached under."""
        kind = self.kind
        value = getattr(self, kind)
        text = "\x00".join(value) if kind == "choice" else ("" if kind == "json_object" else value)
        return kind, text, self.disable_any_whitespace

    def to_dict(self) -> dict[str, Any]:
        """vLLM's ``structured_outputs`` request field: the one kind (a ``json`` schema parsed back to a dict, a
        ``choice`` as a list) and ``disable_any_whitespace`` when set; ``coerce`` of it gives an equal constraint."""
        kind = self.kind
        value = getattr(self, kind)
        body: dict[str, Any] = {
            kind: _json.loads(value) if kind == "json" else list(value) if kind == "choice" else value
        }
        if self.disable_any_whitespace:
            body["disable_any_whitespace"] = True
        return body

    def to_grammar(self) -> Any:
        """The constraint as an ``xgrammar.Grammar`` (parsed, not compiled against a tokenizer).

        Raises:
            RuntimeError: xgrammar refuses the schema, regex or grammar. ImportError: no xgrammar.
        """
        xgr = import_xgrammar()
        kind = self.kind
        any_whitespace = not self.disable_any_whitespace
        if kind == "json":
            return xgr.Grammar.from_json_schema(self.json, any_whitespace=any_whitespace)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(self.regex)
        if kind == "choice":
            assert self.choice is not None
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in self.choice))
        return xgr.Grammar.from_ebnf(self.grammar)

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputs | None:
        """``value`` as ``StructuredOutputs``: itself, None, or a mapping of its fields (``{"regex": "[0-9]+"}``).

        Raises:
            FieldError: another type, an unknown key, or what construction raises.
        """
        if value is None or isinstance(value, StructuredOutputs):
            return value
        if isinstance(value, Mapping):
            allowed = (*KINDS, "disable_any_whitespace")
            unknown = [k for k in value if k not in allowed]
            if unknown:
                raise FieldError(
                    f"structured_outputs.{unknown[0]}",
                    f"structured_outputs.{unknown[0]} is not a field of structured_outputs; "
                    f"allowed: {', '.join(allowed)}",
                )
            return cls(**value)
        raise FieldError(
            "structured_outputs",
            f"structured_outputs must be a StructuredOutputs, a dict of its fields or None, got {type(value).__name__}",
        )
