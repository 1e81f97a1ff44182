"""Structured outputs in training: the trainers' ``structured_outputs_regex`` and ``structured_outputs_json_schema``
become one ``rollout.StructuredOutputs``, checked when the config is built (``TrainerConfig.__post_init__``).

The constraint rides on every training rollout request as its ``structured_outputs`` option: the in-process manager
masks the sampled tokens with it, ``trainers.remote.RemoteRollouts`` sends it as vLLM's ``structured_outputs`` field,
and multi-turn episodes pass it to every model turn (``rollout.run_episodes(structured_outputs=...)``). Held-out
evaluation stays unconstrained unless ``structured_outputs_eval`` is set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import rollout

from .config import ConfigError

REGEX = "structured_outputs_regex"
SCHEMA = "structured_outputs_json_schema"


def structured_outputs_of(config: Any) -> rollout.StructuredOutputs | None:
    """The constraint a config's ``structured_outputs_regex`` or ``structured_outputs_json_schema`` names.

    Args:
        config: a ``trainers.config.TrainerConfig`` (any object with the two fields).

    Returns:
        ``StructuredOutputs(regex=...)``, ``StructuredOutputs(json=<the file's schema>)``, or None when neither is set.

    Raises:
        ConfigError: both are set (the message names both); the regex is not one xgrammar parses; the schema file
            is missing, is not JSON, or is not a schema xgrammar converts; xgrammar is not installed (the message
            names the field and the extra that installs it).
    """
    regex, schema_path = getattr(config, REGEX), getattr(config, SCHEMA)
    if regex is not None and schema_path is not None:
        raise ConfigError(
            f"{REGEX} and {SCHEMA} are exclusive (a rollout has one constraint): set one of them, or neither"
        )
    if regex is None and schema_path is None:
        return None
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise ConfigError(f"{REGEX} must be a non-empty regular expression or null, got {regex!r}")
        return _checked(REGEX, {"regex": regex})
    path = Path(str(schema_path)).expanduser()
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{SCHEMA}: cannot read the JSON schema file {str(path)!r}: {e.strerror or e}") from e
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{SCHEMA}: {str(path)!r} is not JSON: {e}") from e
    if not isinstance(schema, dict):
        raise ConfigError(f"{SCHEMA}: {str(path)!r} must hold a JSON object (a schema), got {type(schema).__name__}")
    return _checked(SCHEMA, {"json": schema})


def _checked(name: str, fields: dict[str, Any]) -> rollout.StructuredOutputs:
    """``StructuredOutputs(**fields)``, its errors as ``ConfigError`` naming the config field ``name``."""
    try:
        return rollout.StructuredOutputs(**fields)
    except ImportError as e:
        raise ConfigError(f"{name}: {e}") from e
    except ValueError as e:  # FieldError: the message names structured_outputs.<kind> and what xgrammar said
        raise ConfigError(f"{name}: {e}") from e
