"""Package faces whose public names are imported on first use (PEP 562's module ``__getattr__``).

A console script (``rollout-serve``, ``rollout-fleet``, ``rollout-score``...) imports its package before it parses
its flags; a face that imported its modules at once would import torch first, and a bad flag would be answered only
after the seconds that takes. A lazy face imports each module when one of its names is first read, and keeps the
name. The faces still list their imports under ``TYPE_CHECKING``, for type checkers and for tests/test_layering.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_face"]


def lazy_face(
    namespace: dict[str, Any], exports: Mapping[str, str], submodules: bool = False
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose names load on first use.

    Args:
        namespace: the package's ``globals()`` (a loaded name is kept there, so it is looked up once).
        exports: each public name -> the absolute name of the module that defines it.
        submodules: any other name is tried as a submodule of the package (``rollout.engine``); off, it is an
            ``AttributeError``.

    Returns:
        ``(__getattr__, __dir__)``, to assign at the package's top level.
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        """A public name (or, with ``submodules``, a submodule) of the package, imported on first use and kept.

        Raises:
            AttributeError: ``name`` is neither.
        """
        module = exports.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        elif submodules:
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":  # the submodule exists and failed to import one of its own
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return __getattr__, __dir__
