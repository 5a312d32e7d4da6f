"""An encoder-decoder opened at both of its stacks: the encoder's blocks, then the decoder's.

T5, BART and the models built like them take ``encoder_outputs``: given it,
their forward skips the encoder. So the encoder's blocks are opened as any
stack's (the first layer runs the model's forward up to the encoder's first
block), the batch's tensors travel through them beside the hidden state, and
one layer joins the two halves::

    embed              model.forward(**batch) up to encoder.block.0       -> (h, *extras, *batch)
    encoder_block_i    the encoder's blocks                               -> ... (the last: (h, *batch))
    encoded            the encoder's last steps on h (final_layer_norm, dropout), then
                       model.forward(**batch, encoder_outputs=(h,)) up to decoder.block.0
    decoder_block_j    the decoder's blocks, given the encoder's output and mask as extras
    ...                the head

Everything the model computes runs as the model's own code: the encoder's
masks and position bias, the decoder's, the cross-attention mask.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .record import NotAStack, fixed_args
from .stack import Layer, Recorded, find_stack, model_output, stack_layers
from .stack_layers import Source, StackInput, split_call
from .tail import tail_layers

__all__ = ["Encoded", "open_stacks", "encoder_of"]


class Encoded(nn.Module):
    """The join of an encoder-decoder: the encoder's last steps on its hidden state, then the model's forward on
    the batch (rebuilt from the tensors the encoder's blocks carried, by ``keys``) with that ``encoder_outputs``,
    up to the decoder's first block (``input``, a ``StackInput``)."""

    def __init__(self, tail: nn.Sequential, decoder_input: StackInput, keys: List[str]) -> None:
        super().__init__()
        self.encoder_tail = tail
        self.input = decoder_input
        self.keys = list(keys)

    # mypy: nn.Module.forward is variadic; a stage layer takes its one carried value
    def forward(self, carried: Any) -> Any:  # type: ignore[override]
        hidden = self.encoder_tail(carried[0])
        batch: Dict[str, Any] = dict(zip(self.keys, carried[1:]))
        batch["encoder_outputs"] = (hidden,)
        return self.input(batch)

    def extra_repr(self) -> str:
        return f"the encoder's output and the batch ({', '.join(self.keys)}) into the decoder"


def encoder_of(model: nn.Module, stack_path: str) -> Optional[Tuple[str, str, nn.Module]]:
    """``(encoder's path, its stack's path, the stack)`` where ``model`` is an encoder-decoder whose forward takes
    ``encoder_outputs`` and whose encoder, apart from the stack at ``stack_path``, holds a block stack; else None."""
    get = getattr(model, "get_encoder", None)
    try:
        takes = "encoder_outputs" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if not callable(get) or not takes:
        return None
    encoder = get()
    path = next((p for p, m in model.named_modules() if m is encoder and p), None)
    if path is None or stack_path.startswith(path + ".") or not isinstance(encoder, nn.Module):
        return None
    found = find_stack(encoder)
    return None if found is None else (path, f"{path}.{found[0]}", found[1])


def open_stacks(model: nn.Module, sample: Any, path: str, stack: nn.Module) -> List[Layer]:
    """The layers of a block-stack model: an encoder-decoder's two stacks (``encoder_of``), else the one stack."""
    encoder = encoder_of(model, path)
    if encoder is None:
        return stack_layers(model, sample, path, stack)
    return _encoder_decoder(model, sample, encoder, path, stack)


def _keywords(model: nn.Module, sample: Any) -> Tuple[Dict[str, Any], List[Tuple[Source, str]]]:
    """The sample as the model's keyword arguments, and where each of its tensors sits in a batch, by keyword."""
    args, kwargs = split_call(sample, fixed_args(model))
    names = [n for n, p in inspect.signature(model.forward).parameters.items()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(names):
        raise NotAStack(f"{type(model).__name__}.forward takes {len(names)} positional arguments, the sample gives "
                        f"{len(args)}")
    words = dict(zip(names, args), **kwargs)
    places: List[Tuple[Source, str]] = [(("args", i), names[i]) for i, v in enumerate(args)
                                        if isinstance(v, torch.Tensor)]
    places += [(("kwargs", k), k) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return words, places


def _encoder_decoder(model: nn.Module, sample: Any, encoder: Tuple[str, str, nn.Module], path: str,
                     stack: nn.Module) -> List[Layer]:
    enc_path, enc_stack_path, enc_stack = encoder
    name = type(model).__name__
    words, places = _keywords(model, sample)
    outputs: List[Any] = []
    hook = model.get_submodule(enc_path).register_forward_hook(lambda m, a, out: outputs.append(out))
    try:
        found = Recorded(model, sample, enc_stack_path, enc_stack)
    finally:
        hook.remove()
    encoded = model_output(outputs[-1]) if outputs else None
    if not isinstance(encoded, torch.Tensor):
        raise NotAStack(f"{enc_path} of {name} returns no hidden state")
    tail = tail_layers(found.run, found.start, encoded, name)
    # the decoder's half, recorded with the encoder's output given (the encoder is not run)
    decoder = stack_layers(model, {**words, "encoder_outputs": (encoded,)}, path, stack, skip=[enc_path])
    first, first_names = decoder[0][1], decoder[0][2]
    assert isinstance(first, StackInput)
    inside = {p for p, _ in model.named_modules() if p == enc_path or p.startswith(enc_path + ".")}
    outside = {p for p, _ in model.named_modules() if p and p not in inside and not enc_path.startswith(p + ".")}
    used = found.used | {p for p, _, _ in tail} | outside
    layers = found.layers(used, [source for source, _ in places])
    steps = nn.Sequential()
    origins = {f"input.{k}": v for k, v in first_names.items()}
    for i, (step_path, step, names) in enumerate(tail):
        key = f"{i}_{step_path.replace('.', '_')}"
        steps.add_module(key, step)
        origins.update({f"encoder_tail.{key}" + (f".{s}" if s else ""): v for s, v in names.items()})
    join = Encoded(steps, first, [key for _, key in places])
    return layers + [("encoded", join, origins)] + decoder[1:]
