"""One parser for every way a trainer's settings arrive: a YAML file, flags, ``--set KEY=VALUE`` items, a mapping.

``ConfigParser`` is a ``transformers.HfArgumentParser`` over a config dataclass (``GRPOConfig``, ``PPOConfig``):
one flag per field, converted by a type function chosen from the field's annotation (int, float, bool, a
``Literal``'s values, a list of them, a mapping; ``null`` where the field is optional). A file's values, ``--set``
items and mappings given in code are turned into the same flags and parsed by the same functions, so a value meets
one rule wherever it comes from (TRL's ``TrlParser`` sets a file's values as the flags' defaults, which argparse
converts only when they are strings). The ranges and the fields that depend on each other are the dataclass's
``__post_init__``. Every error is a ``ConfigError`` that names the key, raised before the model loads.

YAML is read as a config's author means it, by YAML 1.2's core schema rather than PyYAML's YAML 1.1: only
true/false are booleans (1.1 also reads yes/no/on/off, so ``mixed_precision: no`` became False), and 1e-5 or 5E3
are numbers (1.1 wants a dot and a signed exponent); a whole number written with an exponent and no dot (5e3) is
an int, so it can fill an int field of the trainer or of the ``engine`` mapping.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from transformers import HfArgumentParser

from .config import ConfigError, GRPOConfig, TrainerConfig, suggest

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"

_BOOL_TAG = "tag:yaml.org,2002:bool"
_EXPONENT_TAG = "tag:rollout,2026:exponent-number"
_NULLS = frozenset({"null", "Null", "NULL", "none", "None", "~"})


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans (true/false only) and numbers in exponent notation."""


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
ConfigLoader.add_implicit_resolver(
    _EXPONENT_TAG, re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _exponent_number(loader: ConfigLoader, node: yaml.ScalarNode) -> int | float:
    text = str(loader.construct_scalar(node)).replace("_", "")
    value = float(text)
    return int(value) if "." not in text and value.is_integer() else value


ConfigLoader.add_constructor(_EXPONENT_TAG, _exponent_number)


def load_yaml(text: str) -> Any:
    """``text`` read as YAML by ``ConfigLoader``.

    Raises:
        yaml.YAMLError: not valid YAML.
    """
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 (a SafeLoader)


def read_yaml_config(path: str | Path) -> dict[str, Any]:
    """The mapping of a YAML config file (empty for an empty file).

    Raises:
        FileNotFoundError: no such file.
        ConfigError: not valid YAML, or not a mapping (the message names the file).
    """
    try:
        loaded = load_yaml(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: a trainer config must be a YAML mapping, got {type(loaded).__name__}")
    return loaded


# ---------------------------------------------------------------------- the flags' type functions
def parse_int(text: str) -> int:
    """An int written any way a number is written ("30", "5e3", "1_000", "2.0").

    Raises:
        argparse.ArgumentTypeError: not a number, or not a whole one.
    """
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"must be an int, got {text!r}")
    return int(value)


def parse_float(text: str) -> float:
    """A number ("1e-5", "0.2", "3", "inf").

    Raises:
        argparse.ArgumentTypeError: not a number, or NaN.
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}")
    return value


def parse_bool(text: str) -> bool:
    """true/false (also yes/no, on/off, 1/0, any case).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    lowered = text.lower()
    if lowered in ("true", "yes", "on", "1", "t", "y"):
        return True
    if lowered in ("false", "no", "off", "0", "f", "n"):
        return False
    raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")


def parse_mapping(text: str) -> dict[str, Any]:
    """A YAML mapping written inline ("{max_batch_tokens: 1024}"), for the ``engine`` flag.

    Raises:
        argparse.ArgumentTypeError: not YAML, or not a mapping.
    """
    try:
        value = load_yaml(text)
    except yaml.YAMLError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a YAML mapping such as '{{max_batch_tokens: 1024}}', got {text!r}")
    return value


def _one_of(choices: tuple[Any, ...]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        for choice in choices:
            if text == str(choice):
                return choice
        raise argparse.ArgumentTypeError(f"must be one of {choices}, got {text!r}")

    return parse


def _or_null(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_or_null(text: str) -> Any:
        return None if text in _NULLS else parse(text)

    return parse_or_null


_PARSERS: dict[Any, Callable[[str], Any]] = {int: parse_int, float: parse_float, bool: parse_bool, str: str}


def type_function(annotation: Any) -> Callable[[str], Any]:
    """The flag's type function for a field annotation (of one value: a list's items are parsed one by one).

    Raises:
        TypeError: an annotation no config field uses (a new field needs its parser here).
    """
    args = typing.get_args(annotation)
    optional = typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        (annotation,) = [a for a in args if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is list:
        (annotation,) = typing.get_args(annotation)
        origin = typing.get_origin(annotation)
    if origin is Literal:
        parse = _one_of(typing.get_args(annotation))
    elif origin is dict:
        parse = parse_mapping
    elif annotation in _PARSERS:
        parse = _PARSERS[annotation]
    else:
        raise TypeError(f"no flag parser for a field of type {annotation!r}")
    return _or_null(parse) if optional else parse


def _flag_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return yaml.safe_dump(value, default_flow_style=True, width=math.inf).strip()
    return str(value)


# ---------------------------------------------------------------------- the parser
class ConfigParser(HfArgumentParser):
    """An ``HfArgumentParser`` of one config class whose flags keep out of the result unless given.

    Args:
        config_class: ``GRPOConfig``, ``PPOConfig`` or another ``TrainerConfig``.
        command_line: also take ``--config FILE`` and ``--set KEY=VALUE`` (the scripts' parser).
    """

    def __init__(self, config_class: type[TrainerConfig], command_line: bool = False, **kwargs: Any) -> None:
        super().__init__(config_class, allow_abbrev=False, **kwargs)
        self.config_class = config_class
        hints = typing.get_type_hints(config_class)
        self.field_names = [f.name for f in dataclasses.fields(config_class)]
        self._list_fields = set()
        for action in self._actions:
            if action.dest not in hints:
                continue
            # Given flags only: the dataclass's defaults apply to the rest, and a flag overrides a file's value.
            action.default = argparse.SUPPRESS
            action.required = False
            if not isinstance(action, argparse._StoreAction):  # --no_<flag> of a bool that defaults to true
                continue
            action.type = type_function(hints[action.dest])
            if action.nargs == "+":
                self._list_fields.add(action.dest)
            if action.choices is not None:  # the type function checks them, and takes null where it may
                action.metavar = "{" + ",".join(map(str, action.choices)) + "}"
                action.choices = None
            if action.dest == "engine":
                action.metavar = "YAML_MAPPING"
        if command_line:
            self.add_argument(
                "--config", help=f"YAML file of {config_class.__name__} fields (default: the recipe in configs/)"
            )
            self.add_argument(
                "--set", action="append", default=[], metavar="KEY=VALUE", help="override a key (YAML value)"
            )

    def convert(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` (a file's mapping, ``--set`` items, keyword arguments) converted by the flags' type functions.

        Raises:
            ConfigError: an unknown key (with the closest known one), or a value its field's type refuses.
        """
        argv: list[str] = []
        for key, value in values.items():
            if key not in self.field_names:
                raise ConfigError(f"unknown key {key!r}{suggest(str(key), self.field_names)}")
            if key in self._list_fields and isinstance(value, list):
                argv += [f"--{key}", *map(_flag_text, value)]
            else:
                argv.append(f"--{key}={_flag_text(value)}")
        self.exit_on_error = False
        try:
            namespace, _ = self.parse_known_args(argv)
        except argparse.ArgumentError as e:
            name = (e.argument_name or "").split("/")[0].lstrip("-")
            raise ConfigError(f"{name} {e.message}" if e.message.startswith("must") else f"{name}: {e.message}") from e
        finally:
            self.exit_on_error = True
        return self.null_lists({k: v for k, v in vars(namespace).items() if k in self.field_names})

    def null_lists(self, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` with a list field given as ``null`` alone set to None (argparse's ``nargs="+"`` reads
        ``--reward_weights null`` as ``[None]``)."""
        return {k: None if k in self._list_fields and v == [None] else v for k, v in values.items()}


def config_from_dict(values: Mapping[str, Any], cls: type[TrainerConfig] = GRPOConfig) -> Any:
    """Build a ``cls`` from a mapping of its fields (numbers may be written as strings, e.g. "1e-5").

    Raises:
        ConfigError: not a mapping, an unknown key (named, with the closest known key), or a bad value.
    """
    if not isinstance(values, Mapping):
        raise ConfigError(f"a trainer config must be a mapping of keys to values, got {type(values).__name__}")
    return cls(**ConfigParser(cls).convert(values))


def load_config(path: str | Path | None = None, cls: type[TrainerConfig] = GRPOConfig, **overrides: Any) -> Any:
    """Read a YAML config and apply overrides (None values are ignored).

    Args:
        path: a YAML file holding a mapping; None starts from the defaults.
        cls: the config class.
        **overrides: values that replace the file's.

    Raises:
        ConfigError: unknown key, bad value, or a file that is not a YAML mapping.
        FileNotFoundError: ``path`` does not exist.
    """
    values: dict[str, Any] = read_yaml_config(path) if path is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return config_from_dict(values, cls)
    except ConfigError as e:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}{e}") from e


def parse_config(
    argv: Sequence[str] | None = None,
    cls: type[TrainerConfig] = GRPOConfig,
    default_config: Path | None = None,
    description: str | None = None,
) -> Any:
    """The run's config (a ``cls``): the YAML file, then the flags, then the ``--set`` items.

    Args:
        argv: the command line after the program name (None: ``sys.argv[1:]``).
        cls: the config class.
        default_config: the file read when no ``--config`` is given and it exists; None:
            ``configs/<cls.default_config_file>`` of this checkout.
        description: the text of ``--help`` (default: the first line of the class's docstring).

    Raises:
        ConfigError: an unknown key or flag (with the closest known one), a bad value, a malformed ``--set``
            item, a ``--config`` that names no file, or a file that is not a YAML mapping. The file's name leads
            the message only when the file itself is invalid.
        SystemExit: a flag whose value its type refuses (argparse prints the flag and the reason).
    """
    description = description or (cls.__doc__ or "").split("\n")[0]
    parser = ConfigParser(cls, command_line=True, description=description)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    namespace, unknown = parser.parse_known_args(list(argv) if argv is not None else None)
    if unknown:
        flags = [u for u in unknown if u.startswith("-")]
        hint = suggest(flags[0].lstrip("-").replace("-", "_"), parser.field_names, as_flag=True) if flags else ""
        raise ConfigError(f"unknown argument(s) {' '.join(unknown)}{hint}")
    given = parser.null_lists(vars(namespace))
    path, items = given.pop("config", None), given.pop("set", [])
    if default_config is None and cls.default_config_file is not None:
        default_config = REPO_CONFIGS / cls.default_config_file
    if path is None and default_config is not None and default_config.is_file():
        path = str(default_config)  # the default recipe, when running from a checkout
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"--config {path}: no such file")
    from_file: dict[str, Any] = {}
    if path is not None:
        try:
            from_file = parser.convert(read_yaml_config(path))
        except ConfigError as e:
            raise ConfigError(e.args[0] if str(e).startswith(f"{path}: ") else f"{path}: {e}") from e
    from_set = parser.convert(_set_items(items))
    values = {**from_file, **given, **from_set}
    engine = {**from_file.get("engine", {}), **given.get("engine", {}), **from_set.get("engine", {})}
    if engine:
        values["engine"] = engine
    if "reward_funcs" in given.keys() | from_set.keys() and "reward_weights" not in given.keys() | from_set.keys():
        values["reward_weights"] = None  # the file's weights belong to the file's reward functions
    try:
        return cls(**values)
    except ConfigError as e:
        if path is not None and _invalid(from_file, cls):
            raise ConfigError(f"{path}: {e}") from e
        raise  # the file alone is valid: a flag or --set item is at fault, not the file


def _set_items(items: Sequence[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items as a mapping of YAML values; ``engine.KEY=VALUE`` sets one engine field."""
    values: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = key.strip(), load_yaml(raw)
        if key.startswith("engine."):
            values.setdefault("engine", {})[key[len("engine.") :]] = value
        else:
            values[key] = value
    return values


def _invalid(values: dict[str, Any], cls: type[TrainerConfig]) -> bool:
    try:
        cls(**values)
    except ConfigError:
        return True
    return False
