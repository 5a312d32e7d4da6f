"""What a stage's layers need around them in a step, read once a step: whether they can draw, and what calls them.

Two costs of every forward that most small stages do not need, each decided per step (a step's layers keep their
modules, hooks and flags throughout), never per action:

- the seeded-random context (``rng``: a generator of the stage's own, its seed per micro-batch): a stage made only
  of torch layers that never draw (``Linear``, ``ReLU``, ``LayerNorm``, a convolution, ... and dropout that is off:
  ``p == 0`` or ``eval()``), none with a forward hook or a forward of its own, and, on the last stage, a loss of
  torch's that draws nothing, cannot draw: it runs without the context, and a step where no stage of the process
  can draw draws no base seed. Any other module (a class of the user's, a subclass, ``RReLU``, a container whose
  children could change) may draw, and its stage keeps the context (``rng``).
- ``nn.Module.__call__`` around each layer: where a layer has no hooks (nor does any module globally), is not
  compiled by ``Module.compile`` and keeps torch's ``__call__``, that call does nothing but call ``forward``, so the
  stage calls the layers' ``forward`` in a row, as ``nn.Sequential`` would call the layers (a layer with a hook is
  called as before, hooks and all). Hooks added to a layer mid-step apply from the next step.
- a copy of stage 0's input per micro-batch (``stage``: the micro-batches are views of the user's batch and share
  its version counter, so a layer writing one in place would spoil what another saved for its backward): where
  every layer is one of torch's that never writes its input (no ``inplace=True``, no hook anywhere), none is made.
"""

from __future__ import annotations

from typing import Any, Callable, FrozenSet, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.modules import module as _module

__all__ = ["Calls", "read", "loss_draws_nothing", "run_layers"]

#: torch layers whose forward draws no random number in any mode (exact classes: a subclass may draw)
_QUIET: FrozenSet[type] = frozenset({
    nn.Identity, nn.Linear, nn.Bilinear, nn.Flatten, nn.Unflatten, nn.Embedding, nn.EmbeddingBag,
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid,
    nn.Tanh, nn.Softplus, nn.Softsign, nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Hardtanh, nn.Hardswish,
    nn.Hardsigmoid, nn.Hardshrink, nn.Softshrink, nn.Tanhshrink, nn.Threshold, nn.GLU, nn.LogSigmoid,
    nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d,
    nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.Upsample, nn.PixelShuffle, nn.PixelUnshuffle, nn.ZeroPad2d,
} | ({nn.RMSNorm} if hasattr(nn, "RMSNorm") else set()))
#: torch's dropout layers: quiet while off (``eval()``, or ``p == 0``)
_DROPOUTS: FrozenSet[type] = frozenset({nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                                        nn.FeatureAlphaDropout})
_F = nn.functional
#: torch's losses that draw nothing, as functions and as modules
_QUIET_LOSSES: FrozenSet[Any] = frozenset({
    _F.mse_loss, _F.l1_loss, _F.smooth_l1_loss, _F.huber_loss, _F.cross_entropy, _F.nll_loss, _F.kl_div,
    _F.binary_cross_entropy, _F.binary_cross_entropy_with_logits})
_QUIET_LOSS_MODULES: FrozenSet[type] = frozenset({
    nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.CrossEntropyLoss, nn.NLLLoss, nn.KLDivLoss, nn.BCELoss,
    nn.BCEWithLogitsLoss})
_CALL = nn.Module.__call__
_CALL_IMPL = nn.Module._call_impl


def _global_hooks() -> bool:
    """Whether any module hook is installed process-wide (every module's ``__call__`` then runs it)."""
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks
                or _module._global_backward_hooks or _module._global_backward_pre_hooks)


Calls = Tuple[Callable[[Any], Any], ...]


def read(module: nn.Sequential) -> Tuple[bool, Optional[Calls], bool]:
    """The stage's ``module`` (pipeddp's own ``nn.Sequential`` of the stage's layers) as it is now, in one walk:
    whether no forward of it can draw a random number, what calls each layer (its ``forward`` where ``__call__``
    would do nothing else, else the layer; None: call the module as it is), and whether a layer may write its
    input in place. See the module docstring.
    """
    if type(module) is not nn.Sequential or "forward" in module.__dict__ or torch._C._get_tracing_state() is not None:
        return False, None, True
    hooked = bool(module._forward_hooks or module._forward_pre_hooks)
    everywhere = _global_hooks()
    quiet = not (hooked or _module._global_forward_hooks or _module._global_forward_pre_hooks)
    direct = not (hooked or everywhere or module._backward_hooks or module._backward_pre_hooks
                  or module._compiled_call_impl is not None)
    writes = not direct  # a hook may write what it is given
    calls: List[Callable[[Any], Any]] = []
    for layer in module._modules.values():
        if layer is None:
            continue
        kind = type(layer)
        forward_hooks = layer._forward_hooks or layer._forward_pre_hooks
        own = forward_hooks or layer._modules or "forward" in layer.__dict__
        if quiet and (own or (
                kind not in _QUIET and not (kind in _DROPOUTS and (not layer.training or layer.p == 0)))):
            quiet = False
        if not writes and (own or (kind not in _QUIET and kind not in _DROPOUTS)
                           or layer.__dict__.get("inplace", False)):  # (torch's layers keep it there)
            writes = True
        if direct:
            plain = not (forward_hooks or layer._backward_hooks or layer._backward_pre_hooks) \
                and kind.__call__ is _CALL and kind._call_impl is _CALL_IMPL and layer._compiled_call_impl is None
            calls.append(layer.forward if plain else layer)
    return quiet, tuple(calls) if direct else None, writes


def loss_draws_nothing(loss_fn: Optional[Callable[..., Any]]) -> bool:
    """Whether ``loss_fn`` is one of torch's losses that draw nothing (a function, or a module without hooks)."""
    if loss_fn is None:
        return True
    try:
        if loss_fn in _QUIET_LOSSES:
            return True
    except TypeError:  # not hashable: not one of them
        return False
    return type(loss_fn) in _QUIET_LOSS_MODULES and not (
        loss_fn._forward_hooks or loss_fn._forward_pre_hooks or "forward" in loss_fn.__dict__)  # type: ignore


def run_layers(calls: Calls, value: Any) -> Any:
    """``nn.Sequential.forward`` over ``calls``."""
    for call in calls:
        value = call(value)
    return value
