"""``Functional``: functional glue (``torch.flatten(x, 1)``, ``F.relu(x)``) as a layer of its own.

``flatten_sequential`` turns the function calls between a model's children into
layers, so that the result is a plain ``nn.Sequential`` the partitioner can cut
anywhere. A ``Functional`` holds the function and its constant arguments, with
markers for the layer's input (``INPUT``) and its training flag (``TRAINING``,
so ``F.dropout(x, training=self.training)`` keeps following the layer's mode),
and prints as the call it makes::

    Functional(torch.flatten(x, 1))
"""

from __future__ import annotations

import operator
from typing import Any, Dict, Tuple

import torch
from torch import fx, nn

__all__ = ["Functional", "Slot", "INPUT", "TRAINING", "describe_value", "call_text"]


class Slot:
    """A marker in a ``Functional``'s arguments: the layer's input, or its training flag."""

    def __init__(self, text: str, global_name: str) -> None:
        self.text = text
        self.global_name = global_name

    def __repr__(self) -> str:
        return self.text

    def __reduce__(self) -> str:  # pickled and deep-copied as the module-level singleton
        return self.global_name


INPUT = Slot("x", "INPUT")
TRAINING = Slot("self.training", "TRAINING")

_OPERATORS = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/", operator.floordiv: "//",
    operator.mod: "%", operator.pow: "**", operator.matmul: "@", operator.and_: "&", operator.or_: "|",
    operator.xor: "^", operator.lshift: "<<", operator.rshift: ">>",
}


def describe_value(value: Any) -> str:
    """A constant (or a slot) as it would be written in Python."""
    if isinstance(value, Slot):
        return value.text
    if isinstance(value, slice):
        parts = ["" if v is None else describe_value(v) for v in (value.start, value.stop)]
        text = ":".join(parts)
        return text if value.step is None else f"{text}:{describe_value(value.step)}"
    if value is Ellipsis:
        return "..."
    if isinstance(value, tuple):
        inner = ", ".join(describe_value(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(describe_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {describe_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return f"torch.{str(value).replace('torch.', '')}" if isinstance(value, torch.dtype) else repr(value)
    if isinstance(value, fx.Node):
        return value.name
    return repr(value)


def _fn_name(fn: Any) -> str:
    """``torch.flatten``, ``F.adaptive_avg_pool2d``, ``operator.neg``: how ``fn`` is written in code."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None) or ""
    if module == "torch.nn.functional":
        return f"F.{name}"
    if module in ("torch", "torch.functional") or (module.startswith("torch") and getattr(torch, name, None) is fn):
        return f"torch.{name}"
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    if module == "builtins":
        return name
    qual = getattr(fn, "__qualname__", name)
    return f"{module}.{qual}" if module else qual


def call_text(fn: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
    """``fn(*args, **kwargs)`` written as code: ``torch.flatten(x, 1)``, ``x.view(-1, 512)``, ``x + 1``, ``x[:, 0]``."""
    if isinstance(fn, str):  # a method of the first argument
        rest = [describe_value(a) for a in args[1:]] + [f"{k}={describe_value(v)}" for k, v in kwargs.items()]
        return f"{describe_value(args[0]) if args else '?'}.{fn}({', '.join(rest)})"
    if not kwargs and len(args) == 2 and fn in _OPERATORS:
        return f"{describe_value(args[0])} {_OPERATORS[fn]} {describe_value(args[1])}"
    if not kwargs and len(args) == 2 and fn is operator.getitem:
        index = args[1]
        inner = (", ".join(describe_value(i) for i in index) if isinstance(index, tuple) and index
                 else describe_value(index))
        return f"{describe_value(args[0])}[{inner}]"
    if not kwargs and len(args) == 1 and fn is operator.neg:
        return f"-{describe_value(args[0])}"
    parts = [describe_value(a) for a in args] + [f"{k}={describe_value(v)}" for k, v in kwargs.items()]
    return f"{_fn_name(fn)}({', '.join(parts)})"


def _fill(value: Any, x: Any, training: bool) -> Any:
    """``value`` with the input slot replaced by ``x`` and the training slot by ``training``."""
    if value is INPUT:
        return x
    if value is TRAINING:
        return training
    if isinstance(value, tuple):
        return tuple(_fill(v, x, training) for v in value)
    if isinstance(value, list):
        return [_fill(v, x, training) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, x, training) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_fill(value.start, x, training), _fill(value.stop, x, training), _fill(value.step, x, training))
    return value


def _has_slot(value: Any, slot: Slot) -> bool:
    if value is slot:
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_slot(v, slot) for v in value)
    if isinstance(value, dict):
        return any(_has_slot(v, slot) for v in value.values())
    if isinstance(value, slice):
        return any(_has_slot(v, slot) for v in (value.start, value.stop, value.step))
    return False


class Functional(nn.Module):
    """A function of the previous layer's output and constants, as a layer: ``fn(x, *args, **kwargs)``.

    ``fn`` is a callable (``torch.flatten``, ``F.adaptive_avg_pool2d``,
    ``operator.add``) or the name of a method of ``x`` (``"view"``). The input
    goes first unless ``Functional.INPUT`` marks its place among the
    arguments; ``Functional.TRAINING`` stands for the layer's training flag
    (``F.dropout(x, 0.2, training=self.training)``)::

        Functional(torch.flatten, 1)              # torch.flatten(x, 1)
        Functional("view", -1, 512)               # x.view(-1, 512)
        Functional(operator.getitem, Functional.INPUT, (slice(None), 0))  # x[:, 0]

    ``flatten_sequential`` makes one for each piece of glue between the
    children of a model.
    """

    INPUT = INPUT
    TRAINING = TRAINING

    def __init__(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        if not (callable(fn) or isinstance(fn, str)):
            raise TypeError(f"Functional needs a function or a method name, got {fn!r}")
        if not (_has_slot(args, INPUT) or _has_slot(kwargs, INPUT)):
            args = (INPUT,) + args
        self._set(fn, tuple(args), dict(kwargs))

    @classmethod
    def template(cls, fn: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> "Functional":
        """A layer from arguments that already hold ``INPUT`` where the input goes."""
        layer = cls(fn)
        layer._set(fn, args, kwargs)
        return layer

    def _set(self, fn: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        self.fn = fn
        self.args: Tuple[Any, ...] = args
        self.kwargs: Dict[str, Any] = kwargs
        name = fn if isinstance(fn, str) else getattr(fn, "__name__", "")
        # Read by the stage: a layer that starts a stage in place gets a copy of the stage's input.
        self.inplace = kwargs.get("inplace") is True or (name.endswith("_") and not name.endswith("__"))

    def forward(self, x: Any) -> Any:
        args = _fill(self.args, x, self.training)
        kwargs = _fill(self.kwargs, x, self.training)
        if isinstance(self.fn, str):
            return getattr(args[0], self.fn)(*args[1:], **kwargs)
        return self.fn(*args, **kwargs)

    def extra_repr(self) -> str:
        return call_text(self.fn, self.args, self.kwargs)
