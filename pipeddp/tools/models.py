"""Models used by the demo, the command line and the benchmarks.

``flatten_resnet`` turns a torchvision ResNet into the ``nn.Sequential`` that
pipeddp can cut: the stem, every residual block as its own layer, the pooling,
a ``Flatten`` and the classifier (23 layers for resnet50)::

    conv1 bn1 relu maxpool | layer1_0 .. layer1_2 | ... | layer4_2 | avgpool flatten fc

Note that every block begins with work on its input and ResNet's stem ends
with ``ReLU(inplace=True)``: a cut right after ``bn1`` gives a stage that
starts with an in-place op, which pipeddp handles.

``flatten_sequential(model, sample)`` does the same for any model whose
forward is a chain of its children (with functional glue such as
``torch.flatten(x, 1)`` in between): it opens nested containers, keeps
residual blocks whole, turns the glue into ``Functional`` layers and checks
the result against ``model(sample)``. For a ResNet it gives the layers of
``flatten_resnet`` with ``Functional(torch.flatten(x, 1))`` as the flatten.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections import OrderedDict
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from .flatten import flatten_sequential
from .functional import Functional

__all__ = ["mlp", "flatten_resnet", "flatten_sequential", "Functional", "resnet", "language_model", "build", "MODELS"]


def mlp(layers: int = 16, width: int = 1024, in_features: int = 1024, out_features: int = 1024) -> nn.Sequential:
    """``layers`` blocks of Linear(width, width) + ReLU (the benchmark MLP)."""
    mods: List[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(in_features if i == 0 else width, out_features if i == layers - 1 else width))
        mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def flatten_resnet(model: nn.Module) -> nn.Sequential:
    """A torchvision ResNet as a flat ``nn.Sequential`` of its stem, blocks and head."""
    parts: List[Tuple[str, nn.Module]] = []
    for name in ("conv1", "bn1", "relu", "maxpool"):
        parts.append((name, model.get_submodule(name)))
    for stage in ("layer1", "layer2", "layer3", "layer4"):
        for i, block in enumerate(getattr(model, stage)):
            parts.append((f"{stage}_{i}", block))
    parts += [("avgpool", model.get_submodule("avgpool")), ("flatten", nn.Flatten(1)),
              ("fc", model.get_submodule("fc"))]
    return nn.Sequential(OrderedDict(parts))


def resnet(name: str = "resnet50", num_classes: int = 1000) -> nn.Sequential:
    """A randomly initialised torchvision ResNet, flattened (no download)."""
    import torchvision

    builder = getattr(torchvision.models, name)
    return flatten_resnet(builder(weights=None, num_classes=num_classes))


def language_model(vocab: int = 16384, width: int = 256, heads: int = 4, hidden: int = 1024,
                   blocks: int = 8) -> nn.Sequential:
    """A language model whose head weighs as much as several blocks: Embedding(vocab, width), ``blocks`` x
    TransformerEncoderLayer(width, heads, hidden) (no dropout, batch first), LayerNorm and Linear(width, vocab).
    With the defaults the head's matrix (4.2 M weights) outweighs five blocks (0.8 M each): where an equal number
    of layers per stage is not an equal share of the work."""
    return nn.Sequential(nn.Embedding(vocab, width),
                         *(nn.TransformerEncoderLayer(width, heads, hidden, dropout=0.0, batch_first=True)
                           for _ in range(blocks)),
                         nn.LayerNorm(width), nn.Linear(width, vocab))


def _token_sample(batch: int, tokens: int = 64, vocab: int = 16384) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, tokens))


def _mlp_sample(batch: int) -> torch.Tensor:
    return torch.randn(batch, 1024)


def _image_sample(batch: int, side: int = 64) -> torch.Tensor:
    return torch.randn(batch, 3, side, side)


#: name -> (builder, sample(batch) for profiling)
MODELS: Dict[str, Tuple[Callable[[], nn.Sequential], Callable[[int], torch.Tensor]]] = {
    "mlp": (mlp, _mlp_sample),
    "resnet18": (lambda: resnet("resnet18"), _image_sample),
    "resnet50": (lambda: resnet("resnet50"), _image_sample),
    "lm": (language_model, _token_sample),
}


def build(name: str, *, small: bool = False) -> Tuple[nn.Sequential, Callable[[int], torch.Tensor]]:
    """The model called ``name`` and a function making a sample batch for it.

    ``small=True`` gives a quicker variant for pictures and smoke runs: an
    MLP of 8 x 512, a language model of 4 blocks of width 128 over 2048 tokens,
    or ResNet inputs of 32 x 32 instead of 64 x 64.
    """
    if ":" in name:
        return user_model(name)
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)} or give your own as "
                         "package.module:function")
    builder, sample = MODELS[name]
    if small and name == "mlp":
        return mlp(8, 512, 512, 512), lambda b: torch.randn(b, 512)
    if small and name == "lm":
        return language_model(2048, 128, 4, 512, 4), lambda b: _token_sample(b, 32, 2048)
    if small:
        return builder(), lambda b: _image_sample(b, 32)
    return builder(), sample


def user_model(spec: str) -> Tuple[nn.Sequential, Callable[[int], torch.Tensor]]:
    """A user's model for the command line: ``package.module:function`` returning ``(nn.Sequential, sample)``.

    The function is called with no arguments; ``sample`` is one input batch.
    The command line needs batches of its own ``--batch`` size, so they are
    made by taking the sample's rows in turn (``sample[i % len(sample)]``):
    real inputs of the user's shape and dtype, not invented ones. The current
    directory is importable, as under ``python -m``, so a file beside the
    user's shell (``mymodels.py`` -> ``mymodels:build``) is found.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model {spec!r}: write package.module:function (e.g. mymodels:build)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r} ({exc}); run from the folder that "
                         "holds it or put it on PYTHONPATH") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--model {spec!r}: {module_name} has no function {attr!r}")
    got = fn()
    if not (isinstance(got, tuple) and len(got) == 2):
        raise ValueError(f"--model {spec!r}: {attr}() must return (model, sample), an nn.Sequential and one input "
                         f"batch; it returned {type(got).__name__}")
    model, sample = got
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"--model {spec!r}: {attr}() returned a {type(model).__name__}, not an nn.Sequential; "
                         "return pipeddp.tools.models.flatten_sequential(model, sample) to make one")
    if not isinstance(sample, torch.Tensor) or sample.dim() == 0 or len(sample) == 0:
        raise ValueError(f"--model {spec!r}: the sample {attr}() returned must be a tensor with a batch dimension, "
                         f"got {type(sample).__name__}")

    def make_sample(batch: int) -> torch.Tensor:
        return sample[torch.arange(batch) % len(sample)]

    return model, make_sample
