"""Layer drop (LayerDrop, stochastic depth over whole blocks): refused by name before a model is flattened.

In training, BART, M2M100/NLLB, Wav2Vec2 and many other transformers skip each
block of a stack at random: the model's own loop draws a number before each
block and leaves the block out when it falls under ``layerdrop``::

    for layer in self.layers:
        if self.training and torch.rand([]) < self.layerdrop:   # or self.config.layerdrop
            continue
        hidden = layer(hidden, ...)

A flattened model has no such loop: its blocks are layers that always run, and
its first layer stops the model's forward at the first block, which a drop
skips. So the flat model would train another model (every block always on),
or fail on the batches whose first block is dropped. Which number is drawn,
from which generator and with which comparison differs between models, so
rather than imitate one rule the setting is refused, naming every field and
attribute to set to 0 (it has no effect in eval mode).
"""

from __future__ import annotations

from numbers import Real
from typing import Any, List

from torch import nn

__all__ = ["layer_drop", "refuse_layer_drop"]


def _positive(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and float(value) > 0


def _config_fields(config: Any) -> List[str]:
    """``config.<path>=value`` for every ``*layerdrop*`` field above 0, sub-configs (an encoder's, a decoder's)
    included."""
    to_dict = getattr(config, "to_dict", None)
    values = config if isinstance(config, dict) else to_dict() if callable(to_dict) else vars(config) \
        if hasattr(config, "__dict__") else {}
    found: List[str] = []

    def walk(d: Any, path: str) -> None:
        for key, value in d.items():
            if isinstance(value, dict):
                walk(value, f"{path}{key}.")
            elif "layerdrop" in str(key).lower() and _positive(value):
                found.append(f"config.{path}{key}={value:g}")

    walk(values, "")
    return found


def layer_drop(model: nn.Module) -> List[str]:
    """Where ``model`` turns layer drop on: its config's ``*layerdrop*`` fields above 0, and every module's own
    ``layerdrop`` attribute above 0 (transformers copy the config's value onto a stack when it is built)."""
    found = _config_fields(model.config) if getattr(model, "config", None) is not None else []
    for name, m in model.named_modules():
        value = m.__dict__.get("layerdrop")
        if _positive(value):
            found.append(f"model{'.' + name if name else ''}.layerdrop={value:g}")
    return found


def refuse_layer_drop(model: nn.Module) -> None:
    """``ValueError`` naming every layer-drop setting of ``model`` above 0 and how to turn it off."""
    found = layer_drop(model)
    if not found:
        return
    name = type(model).__name__
    settings = ", ".join(found)
    fixes = "; ".join(("model." if item.startswith("config.") else "") + item.split("=")[0] + " = 0.0"
                      for item in found)
    raise ValueError(f"cannot flatten {name}: it drops whole layers at random in training (layer drop: {settings}), "
                     "which a flattened model's layers cannot do as the model's own loop does (each layer would "
                     "always run, or the first layer would find its block skipped). Turn layer drop off and flatten "
                     f"again: build the model with the config's layer drop at 0.0, or set on this model: {fixes}. "
                     "(It changes nothing in eval mode.)")
