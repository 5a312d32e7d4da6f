"""``flatten_sequential``: a model as a fine ``nn.Sequential`` of its own layers, checked against the model.

The partitioner cuts between the children of an ``nn.Sequential``, so the
finer the chain, the better the balance. Two families of models are opened:

* ``chain``: a forward that is a chain of its children, read with
  ``torch.fx`` (torchvision's CNNs, ``nn.TransformerEncoder`` stacks through
  ``tools.transformer``, ``nn.ModuleList`` loops)::

      resnet18: conv1 bn1 relu maxpool layer1_0 ... layer4_1 avgpool Functional(torch.flatten(x, 1)) fc

* ``stack``: a model built around a stack of identical blocks that fx
  cannot read (transformers' GPT-2, Llama, BERT; timm's vision transformers),
  read by running it once on the sample; the blocks pass
  ``(hidden, *extras)`` on (``carry``); an encoder-decoder opens at both of
  its stacks (``encdec``), and steps after the last block that are no chain
  become one replayed layer (``head``)::

      LlamaForCausalLM: embed model_layers_0 .. model_layers_3 model_norm lm_head
      T5ForConditionalGeneration: embed encoder_block_0 .. encoded decoder_block_0 .. lm_head

Either way the layers are the model's own modules (nothing is copied), the
result is run next to the model on the sample, and the original names of the
state are recorded for the engines (``runtime.names``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from ...runtime import names as key_names
from ...runtime.materialize import is_meta, record_first_names, record_init
from ..transformer import EncoderCall, EncoderLayerCall
from .chain import NotAChain, by_hand, chain_layers, configure_encoders, unique_names
from .check import clone, differences, train_mode_differences
from .encdec import open_stacks
from .head import TailProgram
from .layerdrop import refuse_layer_drop
from .lent import LentWeights
from .stack import NotAStack, call_model, find_stack, model_output
from .stack_layers import StackInput

__all__ = ["flatten_sequential"]

Layer = Tuple[str, nn.Module, Dict[str, str]]


def _stack_hint(path: str) -> str:
    return (f"Write the model as layers by hand instead: one that computes what {path}.0 is given, one per block of "
            f"model.{path} taking and passing on (hidden, *extras), then the output part (docs/models.md shows how)")


def _open(model: nn.Module) -> Tuple[List[Layer], List[EncoderCall], bool]:
    """The layers of the chain family, or ``([], [], False)`` with the reason kept when the forward is no chain."""
    found, calls = chain_layers(model)
    own = {id(m) for m in model.modules()}
    layers: List[Layer] = []
    for path, layer in found:
        if isinstance(layer, EncoderLayerCall) and id(layer) not in own:
            layers.append((path, layer, {"layer": path}))  # the wrapper holds no state; its child is the model's
        else:
            layers.append((path, layer, {"": path} if id(layer) in own else {}))
    return layers, calls, False


def _layers(model: nn.Module, sample: Any) -> Tuple[List[Layer], List[EncoderCall], bool]:
    """The layers of whichever family takes the model; ``ValueError`` naming the construct and the way out."""
    name = type(model).__name__
    try:
        return _open(model)
    except NotAChain as exc:
        chain_reason = str(exc)
    stack = find_stack(model)
    if stack is None:
        raise ValueError(f"cannot flatten {name}: its forward is not a chain of its children: {chain_reason}. "
                         f"{by_hand(model)}") from None
    try:
        return open_stacks(model, sample, *stack), [], True
    except NotAStack as exc:  # the blocks' reason first: torch.fx's failure on a stack of blocks says little
        raise ValueError(f"cannot flatten {name}: its blocks {stack[0]} cannot be opened: {exc}. "
                         f"{_stack_hint(stack[0])} (Read as a chain of its children by torch.fx, it failed too: "
                         f"{chain_reason}.)") from None


def flatten_sequential(model: nn.Module, sample: Any, *, rtol: float = 1e-5, atol: float = 1e-6) -> nn.Sequential:
    """``model`` as a flat ``nn.Sequential`` of its own layers, checked against the model on ``sample``.

    pipeddp cuts an ``nn.Sequential`` between its children, so the stages can
    only be as even as the children allow. This opens the model up into the
    finest sequence of its own layers:

    * a model whose forward is a chain of its children (torchvision's CNNs,
      ``nn.TransformerEncoder`` stacks, ``nn.ModuleList`` loops): nested
      chains are opened, residual blocks (and children with hooks) stay whole,
      functional glue (``torch.flatten(x, 1)``) becomes a ``Functional`` layer;
      the flat model takes ``sample`` as the model does (``model(sample)``);
    * a model built around a stack of identical blocks (Hugging Face
      transformers' causal LMs and encoders such as GPT-2, Llama, BERT; timm's
      vision transformers): an ``embed`` layer runs the model's own forward up
      to its first block, each block is a layer that takes and passes on
      ``(hidden, *extras)`` (the attention mask, rotary ``(cos, sin)``,
      positions), and the modules after the last block (``model_norm``,
      ``lm_head``) follow. ``sample`` is the batch: a tensor (``input_ids``,
      images), or a dict of keyword arguments (``{"input_ids": ...,
      "attention_mask": ...}``; give a padded sample if batches will be
      padded). No key-value cache is used (``use_cache=False``); the result
      computes the model's ``logits``. See docs/models.md.

    A model built on the meta device (``with torch.device("meta"):``) is
    flattened without being given its memory: each module is lent seeded values
    only while it runs (``lent``), and the result stays on meta for an engine to
    materialize stage by stage; a Hugging Face model's ``_init_weights`` is
    recorded on it as the engines' default ``init``.

    Parameters are shared with the model, so a tied embedding and head stay
    one weight (pipeddp keeps its copies on other stages equal). The original
    names are recorded on the result: a ``Pipeline`` or ``HybridParallel``
    built from it saves and loads state under them, so its weights load into
    the original model with ``strict=True`` and the original's into it (the
    flat ``nn.Sequential``'s own ``state_dict`` keeps the flat names). The
    result is run on ``sample`` next to ``model`` under ``torch.no_grad()``,
    in eval mode and in train mode from the same random seeds (``check``;
    the training flags, buffers and generators are restored)::

        flat = flatten_sequential(torchvision.models.resnet50(weights=None), torch.randn(2, 3, 64, 64))
        flat = flatten_sequential(LlamaForCausalLM(config), {"input_ids": ids, "attention_mask": mask})

    Raises:
        ValueError: the model can be opened by neither way, naming the
            construct (the step of the forward, or the call and its line in the
            model's code) and the way out; or the result differs from the model
            on ``sample`` by more than ``rtol``/``atol`` in either mode (the
            message gives the largest difference); or the model drops whole
            layers at random in training (``layerdrop``), naming the settings
            to set to 0.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"flatten_sequential needs an nn.Module, got {type(model).__name__}")
    refuse_layer_drop(model)
    modes = [(m, m.training) for m in model.modules()]
    own = {id(m) for m, _ in modes}
    # a Hugging Face model's own initialisation (per module, as the engines call it); timm's _init_weights is not
    meta = is_meta(model)
    init = getattr(model, "_init_weights", None) if meta and hasattr(model, "post_init") else None
    lent = LentWeights(model, init) if meta else contextlib.nullcontext()
    try:
        lent.__enter__()
        model.eval()
        layers, calls, stacked = _layers(model, sample)
        if not layers:
            raise ValueError(f"cannot flatten {type(model).__name__}: its forward calls no layer (it returns its "
                             "input)")
        names = unique_names([path for path, _, _ in layers])
        flat = nn.Sequential(OrderedDict(zip(names, (layer for _, layer, _ in layers))))
        flat.eval()
        seen: Dict[int, List[Tuple[Any, Any]]] = {}
        hooks = [call.encoder.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.setdefault(id(mod), []).append((args, kwargs)), with_kwargs=True)
            for call in {id(c.encoder): c for c in calls}.values()]
        with torch.no_grad():
            try:
                want = model_output(call_model(model, clone(sample))) if stacked else model(clone(sample))
            finally:
                for hook in hooks:
                    hook.remove()
            configure_encoders(calls, seen)
            got = flat(clone(sample))
            bad = differences(got, want, rtol, atol)
            checked = "eval"
            if not bad:  # and in train mode, from the same seeds (check.py)
                bad = train_mode_differences(
                    lambda: model_output(call_model(model, clone(sample))) if stacked else model(clone(sample)),
                    lambda: flat(clone(sample)), [model, flat], rtol, atol)
                checked = "train"
    except RuntimeError as exc:
        if isinstance(lent, LentWeights) and "meta" in str(exc):
            raise ValueError(f"cannot flatten {type(model).__name__} built on the meta device: its forward used a "
                             "tensor of a module it did not call (each module is given values only while it runs): "
                             f"{exc}. Build the model on a real device to flatten it") from exc
        raise
    finally:
        lent.__exit__(None, None, None)
        for m, mode in modes:
            m.training = mode
    if isinstance(lent, LentWeights):  # what the layers registered of the model's own while it ran: lent values
        for layer in flat.modules():  # an encoder-decoder's second stack opens inside a layer (``encoded.input``)
            if isinstance(layer, (StackInput, TailProgram)):
                layer.take_kept()
    for layer in [flat] + [m for m in flat.modules() if id(m) not in own]:
        layer.training = model.training
    if bad:
        where = "; ".join(f"{w}: {what}" for w, what in bad[:3]) + ("; ..." if len(bad) > 3 else "")
        # mypy: stacked means find_stack found one, which mypy cannot follow
        hint = _stack_hint(find_stack(model)[0]) if stacked else by_hand(model)  # type: ignore[index]
        what = "the model's output on the sample" if stacked else "model(sample)"
        differs = "behave differently in eval mode" if checked == "eval" else \
            "branch on self.training or draw random numbers between its layers"
        raise ValueError(f"the flattened {type(model).__name__} does not compute {what} in {checked} mode "
                         f"(rtol={rtol:g}, atol={atol:g}): {where}. Its forward may do more than call its layers "
                         f"in order (for example {differs}). {hint}")
    prefixes: Dict[str, str] = {}
    for name, (_, _, origins) in zip(names, layers):
        for suffix, original in origins.items():
            prefixes[f"{name}.{suffix}" if suffix else name] = original
    key_names.record(flat, prefixes, source=model)
    record_init(flat, init if callable(init) else None)
    record_first_names(flat, model)
    return flat
