"""The two call shapes of a PLE layer: vLLM 0.33's three tensors, or the seed's four with
``hidden_states`` first; ``seed_call_shape`` lets a method take either."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

BATCH = ("input_ids", "query_start_loc", "ngram_context")
SEED_BATCH = ("hidden_states", *BATCH)


def batch_arguments(method: str, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
    """``(input_ids, query_start_loc, ngram_context)`` of a call in either layer shape: vLLM
    0.33's three tensors, or four with ``hidden_states`` (a floating tensor or None,
    not read) first. The count of arguments decides, so no tensor is taken for another."""
    seed = "hidden_states" in kwargs or len(args) + len(kwargs) == len(SEED_BATCH)
    names = SEED_BATCH if seed else BATCH
    if len(args) > len(names):
        raise TypeError(f"{method}() takes ({', '.join(BATCH)}) or ({', '.join(SEED_BATCH)}), "
                        f"got {len(args)} positional arguments")
    values = dict(zip(names, args, strict=False))
    for name, value in kwargs.items():
        if name not in names or name in values:
            raise TypeError(f"{method}() got an unexpected or repeated argument {name!r}")
        values[name] = value
    missing = [name for name in names if name not in values]
    if missing:
        raise TypeError(f"{method}() is missing {', '.join(missing)} (it takes "
                        f"({', '.join(BATCH)}) or ({', '.join(SEED_BATCH)}))")
    hidden_states = values.get("hidden_states")
    if hidden_states is not None and not (isinstance(hidden_states, torch.Tensor)
                                          and hidden_states.is_floating_point()):
        raise TypeError(f"{method}(): hidden_states, the first of four arguments, must be a "
                        f"floating tensor or None, got {_kind(hidden_states)}")
    for name in BATCH:
        value = values[name]
        if not isinstance(value, torch.Tensor) or value.is_floating_point():
            hint = (" (hidden_states goes first, before three more)" if name == "input_ids"
                    and isinstance(value, torch.Tensor) else "")
            raise TypeError(f"{method}(): {name} must be an integer tensor, got "
                            f"{_kind(value)}{hint}")
    return tuple(values[name] for name in BATCH)


def seed_call_shape(method: Callable[..., Any]) -> Callable[..., Any]:
    """The layer method ``method(self, input_ids, query_start_loc, ngram_context)`` (vLLM 0.33's
    shape, the signature ``help`` shows), callable in the seed's four-argument shape too:
    ``(hidden_states, input_ids, query_start_loc, ngram_context)``, positionally or by name,
    ``hidden_states`` a floating tensor or None and not read. ``batch_arguments`` maps either
    shape onto the three tensors, or raises the TypeError naming the argument."""

    @functools.wraps(method)
    def either_shape(self, *args: torch.Tensor | None, **kwargs: torch.Tensor | None):
        return method(self, *batch_arguments(method.__name__, args, kwargs))

    return either_shape


def _kind(value) -> str:
    """A value's type for an error message: a tensor's dtype, else its class."""
    return f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
