"""Built-in models and the loader for plugin models named `package.module:ClassName`."""

from __future__ import annotations

import importlib
from typing import Any

from worker.model_registry import BUILTIN  # one registry, torch-free for --help
from worker.models.base import InvalidInput, Model, Prepared


class ModelLoadError(Exception):
    """The model named in the settings cannot be built; the message is for the user."""


def create_model(name: str, options: dict[str, Any]) -> Model:
    """Instantiate a built-in or plugin model with its `model_options`."""
    target = BUILTIN.get(name, name)
    module_name, _, class_name = target.partition(":")
    if not class_name:
        raise ModelLoadError(
            f"unknown model {name!r}: use one of {sorted(BUILTIN)} or 'package.module:ClassName'")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ModelLoadError(f"cannot import model {target!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Model)):
        raise ModelLoadError(f"{target!r} is not a subclass of worker.models.Model")
    try:
        return cls(**options)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"bad model_options for {name!r}: {exc}") from None


__all__ = ["BUILTIN", "InvalidInput", "Model", "ModelLoadError", "Prepared", "create_model"]
