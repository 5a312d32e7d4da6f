"""Opening ``nn.TransformerEncoder``: each encoder layer its own entry, called as the encoder calls it.

``nn.TransformerEncoder.forward`` is not a chain ``torch.fx`` can read (it
branches on its arguments), yet what it computes is one::

    encoder(src, mask, is_causal)  =  norm(layer_N( ... layer_1(src, src_mask=m, is_causal=c) ...))

with ``m`` the mask made canonical (a bool mask becomes 0 / -inf in the
input's dtype) and ``c`` the causal hint (given, or detected by comparing
``m`` with the causal mask). So ``flatten_sequential`` lists the layers and
the final ``norm`` in its place. A layer called without a mask is used as
it is; one called with a mask becomes an ``EncoderLayerCall`` that passes
the same mask and hint to it:

* a mask that does not depend on the input (a buffer of the model, a tensor
  built from constants) is kept as a non-persistent buffer (it follows
  ``.to(dtype)`` and the stage's device, and stays out of the state dict);
* a mask computed from the input's sizes must be the causal mask (checked on
  the sample); each layer then makes the causal mask of its own input's
  sequence length, so any length works, as in the model.

The encoder's sparsity fast path turns the input into a nested tensor only
when a ``src_key_padding_mask`` is given; a per-batch padding mask is a second
input besides the previous layer's output, which an ``nn.Sequential`` cannot
pass, so such an encoder is not opened (the model is refused, naming the call).
Every layer still takes its own fast path (inference under ``no_grad``)
exactly as it does inside the encoder.

``nn.TransformerDecoder`` stacks are not opened: each decoder layer reads
``memory`` besides the previous layer's output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch
from torch import nn

if TYPE_CHECKING:  # typing has TypeGuard from Python 3.10 on; only the checker reads it here
    from typing import TypeGuard

__all__ = ["EncoderCall", "EncoderLayerCall", "is_plain_encoder", "encoder_layers", "ENCODER_ARGS"]

#: ``nn.TransformerEncoder.forward``'s arguments, in order.
ENCODER_ARGS = ("src", "mask", "src_key_padding_mask", "is_causal")


def is_plain_encoder(module: nn.Module) -> TypeGuard[nn.TransformerEncoder]:
    """An ``nn.TransformerEncoder`` (or a subclass) that runs ``nn.TransformerEncoder.forward``."""
    return isinstance(module, nn.TransformerEncoder) and type(module).forward is nn.TransformerEncoder.forward


def _seq_len(x: torch.Tensor, batch_first: bool) -> int:
    """The sequence length the encoder reads off its input (an unbatched input is ``(seq, feature)``)."""
    if x.dim() == 2:
        return x.size(0)
    return x.size(1 if batch_first else 0)


def _canonical(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as 0 / -inf in ``dtype`` (True means masked out); a float mask as it is, as the encoder does."""
    if mask.is_floating_point():
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


class EncoderCall:
    """How one call site passes the mask to an encoder: read from the graph, completed from the sample's run.

    ``mask_given``: the call passes a mask (a value, not the constant None);
    ``sized``: that mask is computed from sizes of the input (so it changes
    with the input and must be the causal mask); ``is_causal``: the hint as
    written (None: detect). ``layers``: the ``EncoderLayerCall`` made for
    this site, configured by ``configure`` once the mask's value is known.
    """

    def __init__(self, encoder: nn.TransformerEncoder, where: str, mask_given: bool, sized: bool,
                 is_causal: Optional[bool]) -> None:
        self.encoder = encoder
        self.where = where
        self.mask_given = mask_given
        self.sized = sized
        self.is_causal = is_causal
        self.layers: List[EncoderLayerCall] = []

    @property
    def plain(self) -> bool:
        """No mask and no causal hint: the layers are called with their defaults, as they are."""
        return not self.mask_given and not self.is_causal

    def configure(self, args: Tuple[Any, ...], kwargs: dict) -> None:
        """Set every layer of this site from the encoder's arguments in the sample's run."""
        bound = dict(zip(ENCODER_ARGS, args))
        bound.update(kwargs)
        src, mask = bound["src"], bound.get("mask")
        batch_first = bool(self.encoder.layers[0].self_attn.batch_first)
        if mask is None:
            for layer in self.layers:
                layer.set_call("none", bool(self.is_causal))
            return
        if not isinstance(mask, torch.Tensor):
            raise ValueError(f"{self.where} passes a mask of type {type(mask).__name__}; the encoder takes a tensor")
        canonical = _canonical(mask.detach(), src.dtype)
        n = _seq_len(src, batch_first)
        causal = nn.Transformer.generate_square_subsequent_mask(n, device=canonical.device, dtype=canonical.dtype)
        is_causal_mask = canonical.shape == causal.shape and bool((canonical == causal).all())
        if self.sized:
            if not is_causal_mask:
                raise ValueError(
                    f"{self.where} passes a mask computed from the input's size that is not the causal mask "
                    f"(nn.Transformer.generate_square_subsequent_mask) of the sample's {n} positions; each opened "
                    "layer could not rebuild it. Keep the mask in a buffer of the model (a constant mask is passed "
                    "to every layer as it is)")
            hint = self.is_causal if self.is_causal is not None else True
            for layer in self.layers:
                layer.set_call("causal", hint)
            return
        if mask.requires_grad:
            raise ValueError(f"{self.where} passes a mask that requires grad (a learnt mask); the opened layers "
                             "would get a frozen copy of it. Wrap the encoder by hand instead")
        hint = self.is_causal if self.is_causal is not None else is_causal_mask
        for layer in self.layers:
            layer.set_call("constant", hint, mask.detach().clone())


class EncoderLayerCall(nn.Module):
    """An encoder layer called with the mask and causal hint its ``nn.TransformerEncoder`` passed it.

    ``kind`` is ``"causal"`` (the causal mask of each input's length),
    ``"constant"`` (the ``mask`` buffer, made canonical in the input's dtype)
    or ``"none"``. Its one child is the model's own layer (shared, not copied).
    """

    mask: Optional[torch.Tensor]

    def __init__(self, layer: nn.Module, batch_first: bool) -> None:
        super().__init__()
        self.layer = layer
        self.batch_first = batch_first
        self.kind = "none"
        self.is_causal = False
        self.register_buffer("mask", None, persistent=False)

    def set_call(self, kind: str, is_causal: bool, mask: Optional[torch.Tensor] = None) -> None:
        self.kind, self.is_causal = kind, bool(is_causal)
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask: Optional[torch.Tensor] = None
        if self.kind == "causal":
            mask = nn.Transformer.generate_square_subsequent_mask(_seq_len(x, self.batch_first), device=x.device,
                                                                  dtype=x.dtype)
        elif self.kind == "constant" and self.mask is not None:
            mask = _canonical(self.mask, x.dtype)
        return self.layer(x, src_mask=mask, is_causal=self.is_causal)

    def extra_repr(self) -> str:
        what = {"causal": "causal mask", "constant": "constant mask", "none": "no mask"}[self.kind]
        return f"{what}, is_causal={self.is_causal}"


def encoder_layers(encoder: nn.TransformerEncoder, call: Optional[EncoderCall]) -> List[Tuple[str, nn.Module]]:
    """``(path, layer)`` of the encoder's layers and final norm, each layer wrapped when ``call`` passes a mask."""
    out: List[Tuple[str, nn.Module]] = []
    batch_first = bool(encoder.layers[0].self_attn.batch_first)
    for i, layer in enumerate(encoder.layers):
        if call is None or call.plain:
            out.append((f"layers.{i}", layer))
        else:
            wrapped = EncoderLayerCall(layer, batch_first)
            call.layers.append(wrapped)
            out.append((f"layers.{i}", wrapped))
    if encoder.norm is not None:
        out.append(("norm", encoder.norm))
    return out
