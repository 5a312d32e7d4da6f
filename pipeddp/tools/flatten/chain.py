"""The chain family: a model whose forward is a chain of its children, opened as far as it goes.

The partitioner cuts between the children of an ``nn.Sequential``, so the
finer the chain, the better the balance. ``torch.fx`` traces the model with
its direct children as leaves; if the graph is a single chain (every step uses
the previous step's output and otherwise constants), each child becomes a
layer, nested containers are opened up the same way, a child whose forward is
not a chain (a residual block) stays whole, and function calls between them
become ``Functional`` layers. The result shares the model's modules and is
checked against ``model(sample)``::

    resnet18: conv1 bn1 relu maxpool layer1_0 ... layer4_1 avgpool Functional(torch.flatten(x, 1)) fc
"""

from __future__ import annotations

import builtins
import itertools
import operator
from typing import AbstractSet, Any, Dict, List, NamedTuple, Optional, Set, Tuple

from torch import fx, nn

from ..functional import INPUT, TRAINING, Functional, call_text, describe_value
from ..transformer import ENCODER_ARGS, EncoderCall, encoder_layers, is_plain_encoder

__all__ = ["NotAChain", "chain_layers", "configure_encoders", "unique_names", "BY_HAND", "by_hand"]

#: the way out when a model cannot be flattened (``by_hand`` adds an example made of the model's own children)
BY_HAND = "Wrap the parts of the model in order by hand"


def by_hand(model: nn.Module) -> str:
    """The way out, with the model's own children as the example: ``nn.Sequential(model.stem, model.body, ...)``."""
    children = [name for name, _ in model.named_children()]
    if len(children) < 2:
        return f"{BY_HAND}, as an nn.Sequential of its layers"
    parts = ", ".join(f"model.{c}" for c in children[:4]) + (", ..." if len(children) > 4 else "")
    return (f"{BY_HAND}, e.g. nn.Sequential({parts}) with a Functional layer for glue between them "
            "(torch.flatten(x, 1)); a layer may take and return a tuple to carry more than one value")


class NotAChain(Exception):
    """A forward that is not a chain of its children; the message says where it breaks."""


class _ChildrenAsLeaves(fx.Tracer):
    """Traces ``root.forward`` only: every module it calls is a leaf (one ``call_module`` node)."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self._traced_root = root

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return m is not self._traced_root


def _describe(node: Any) -> str:
    """A node of a traced forward written as code: ``self.layer3(layer2)``, ``x.size(0)``."""
    if not isinstance(node, fx.Node):
        return describe_value(node)
    if node.op == "placeholder":
        return node.name
    if node.op == "get_attr":
        return f"self.{node.target}"
    if node.op == "call_module":
        parts = [describe_value(a) for a in node.args] + [f"{k}={describe_value(v)}" for k, v in node.kwargs.items()]
        return f"self.{node.target}({', '.join(parts)})"
    if node.op == "call_function" and node.target is builtins.getattr and len(node.args) == 2 \
            and isinstance(node.args[1], str):
        return f"{describe_value(node.args[0])}.{node.args[1]}"
    if node.op in ("call_function", "call_method"):
        return call_text(node.target, tuple(node.args), dict(node.kwargs))
    return node.name


def _meets_data(a: fx.Node) -> Optional[fx.Node]:
    """The first node that uses ``a``'s result (directly or not) together with a value not computed from it."""
    todo, seen = list(a.users), {a}
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    for n in a.graph.nodes:
        if n in seen and n is not a and any(i not in seen for i in n.all_input_nodes):
            return n
    return None


def _drop_dead_lookups(graph: fx.Graph) -> None:
    """Remove unused ``x[i]`` / ``x.shape`` nodes (tuple unpacking such as ``x, _ = self.rnn(x)`` makes them)."""
    for node in reversed(list(graph.nodes)):
        if (not node.users and node.op == "call_function" and node.target in (operator.getitem, builtins.getattr)):
            graph.erase_node(node)


def _output_of(node: fx.Node) -> str:
    """A step's result in a message: ``layer3 output``, ``the input x``, ``the output of torch.flatten(x, 1)``."""
    if node.op == "placeholder":
        return f"the input {node.name}"
    if node.op == "call_module":
        return f"{node.target} output"
    return f"the output of {_describe(node)}"


def _is_size(node: fx.Node) -> bool:
    """``x.size(0)``, ``x.shape``, ``x.dim()``: a number read off a tensor."""
    return (node.op == "call_method" and node.target in ("size", "dim", "numel", "nelement", "stride")) or \
        (node.op == "call_function" and node.target is builtins.getattr and
         len(node.args) > 1 and node.args[1] in ("shape", "ndim", "dtype", "device"))


def _check_single_use(prev: fx.Node, side: AbstractSet[fx.Node]) -> None:
    users = [u for u in prev.users if u not in side]
    if len(users) <= 1:
        return
    for u in users:
        if _is_size(u):
            meets = _meets_data(u)
            used = f"an argument of {_describe(meets)}" if meets is not None else "used further on"
            raise NotAChain(f"{_describe(u)} depends on the input and is {used}; a layer of an nn.Sequential sees "
                             "only the previous layer's output (torch.flatten(x, 1) or nn.Flatten(1) needs no size)")
    uses = " and ".join(_describe(u) for u in users[:3]) + (f" and {len(users) - 3} more" if len(users) > 3 else "")
    times = "twice" if len(users) == 2 else f"{len(users)} times"
    raise NotAChain(f"{_output_of(prev)} is used {times} (by {uses})")


def _encoder_sites(graph: fx.Graph, root: nn.Module) -> Tuple[Dict[fx.Node, EncoderCall], Set[fx.Node]]:
    """Calls of an ``nn.TransformerEncoder`` with a mask or causal hint, and the nodes that only make that mask.

    The mask may be a constant (a buffer, a tensor built from constants) or
    be computed from sizes of values of the chain (``x.size(1)``: a causal
    mask); those nodes are not steps of the chain. A mask computed from the
    values themselves, or a padding mask, is a second input: refused.
    """
    sites: Dict[fx.Node, EncoderCall] = {}
    side: Set[fx.Node] = set()
    for n in graph.nodes:
        encoder = root.get_submodule(str(n.target)) if n.op == "call_module" else None
        if encoder is None or not n.args or not is_plain_encoder(encoder):
            continue
        if len(n.args) > len(ENCODER_ARGS) or any(k not in ENCODER_ARGS[1:] for k in n.kwargs):
            continue
        bound = dict(zip(ENCODER_ARGS, n.args))
        bound.update(n.kwargs)
        if bound.get("src_key_padding_mask") is not None:
            raise NotAChain(f"{_describe(n)} passes a src_key_padding_mask: a per-batch mask is a second input "
                             "besides the previous step's output, which an nn.Sequential cannot pass from layer to "
                             "layer")
        hint, mask = bound.get("is_causal"), bound.get("mask")
        if isinstance(hint, fx.Node) or (mask is not None and not isinstance(mask, fx.Node)):
            continue
        mine: Set[fx.Node] = set()
        sized = False
        todo = [mask] if mask is not None else []
        while todo:
            a = todo.pop()
            if a in mine:
                continue
            if a.op in ("placeholder", "call_module"):
                raise NotAChain(f"{_describe(n)} passes a mask computed from {_output_of(a)}: only a constant "
                                 "mask or one made from the input's size (the causal mask) can be given to each layer")
            mine.add(a)
            if _is_size(a):
                sized = True
                continue
            todo.extend(a.all_input_nodes)
        if any(u not in mine and u is not n for a in mine for u in a.users):
            continue  # the mask's parts are used by the chain too: the chain check names the place
        encoder = root.get_submodule(str(n.target))
        assert isinstance(encoder, nn.TransformerEncoder)
        sites[n] = EncoderCall(encoder, f"self.{n.target}", mask is not None, sized, hint)
        side |= mine
    return sites, side


def _chain(graph: fx.Graph, side: AbstractSet[fx.Node] = frozenset(),
           sites: Optional[Dict[fx.Node, EncoderCall]] = None) -> List[fx.Node]:
    """The nodes of a forward that is a chain, in order; else ``NotAChain`` naming the break.

    ``side`` nodes (an encoder's mask) are left out; the ``sites`` (encoder
    calls with a mask) may take them besides the previous step's output.
    """
    sites = sites or {}
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if not inputs:
        raise NotAChain("forward takes no input")
    for extra in inputs[1:]:
        if extra.users:
            raise NotAChain(f"forward uses its argument {extra.name!r} besides the input")
    prev = inputs[0]
    steps: List[fx.Node] = []
    for n in nodes:
        if n.op == "placeholder" or n in side:
            continue
        if n.op == "output":
            if n.args[0] is not prev:
                raise NotAChain(f"forward returns {_describe(n.args[0])}, not {_output_of(prev)}")
            _check_single_use(prev, side)
            return steps
        if n.op == "get_attr":
            raise NotAChain(f"{_describe(n)} is read directly by forward, not through a child module")
        _check_single_use(prev, side)
        ins = [i for i in n.all_input_nodes if i not in side]
        if prev not in ins:
            if not ins:
                raise NotAChain(f"{_describe(n)} does not depend on the input")
            raise NotAChain(f"{_describe(n)} does not use {_output_of(prev)}")
        others = [i for i in ins if i is not prev]
        if others:
            extra = ", ".join(_output_of(o) for o in others)
            raise NotAChain(f"{_describe(n)} uses {extra} besides {_output_of(prev)}")
        if n in sites:
            if n.args[0] is not prev:
                raise NotAChain(f"{_describe(n)} is not called on {_output_of(prev)}")
        elif n.op == "call_module" and (tuple(n.args) != (prev,) or n.kwargs):
            raise NotAChain(f"{_describe(n)} is called with more than the previous step's output")
        steps.append(n)
        prev = n
    raise NotAChain("forward has no output")


def _merge(a: Any, b: Any, prev: fx.Node) -> Any:
    """One argument of a step traced in training (``a``) and in eval mode (``b``), as a ``Functional`` template."""
    if isinstance(a, fx.Node):
        if not isinstance(b, fx.Node) or a.name != b.name or a is not prev:
            raise NotAChain("")
        return INPUT
    if a is True and b is False:
        return TRAINING
    if type(a) is not type(b) and not (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list))):
        raise NotAChain("")
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            raise NotAChain("")
        items = [_merge(x, y, prev) for x, y in zip(a, b)]
        return tuple(items) if isinstance(a, tuple) else items
    if isinstance(a, dict):
        if list(a) != list(b):
            raise NotAChain("")
        return {k: _merge(a[k], b[k], prev) for k in a}
    if isinstance(a, slice):
        return slice(_merge(a.start, b.start, prev), _merge(a.stop, b.stop, prev), _merge(a.step, b.step, prev))
    if a is b:
        return a
    try:
        same = bool(a == b)
    except Exception:  # noqa: BLE001 - a constant that cannot be compared counts as different
        same = False
    if not same:
        raise NotAChain("")
    return a


class _Step(NamedTuple):
    """A step of a chain: a child module (by its path relative to its owner), glue, or a layer to keep as it is.

    ``kind`` is ``"module"`` (opened further where it can be), ``"glue"`` (a
    ``Functional`` named after its node) or ``"leaf"`` (kept). ``call``: how
    an encoder is called (its mask), for an encoder step.
    """

    kind: str
    name: str
    layer: nn.Module
    call: Optional[EncoderCall] = None


def _steps(module: nn.Module, call: Optional[EncoderCall] = None) -> List[_Step]:
    """The steps of ``module.forward`` if it is a chain of submodules and glue; else ``NotAChain``."""
    if isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward:
        return [_Step("module", name, child) for name, child in module.named_children()]
    if is_plain_encoder(module):
        return [_Step("leaf", path, layer) for path, layer in encoder_layers(module, call)]
    saved = module.training
    graphs = []
    try:
        for mode in (True, False):  # a forward that reads self.training must do the same in both modes
            module.training = mode
            graph = _ChildrenAsLeaves(module).trace(module)
            _drop_dead_lookups(graph)
            graphs.append(graph)
    except Exception as exc:  # noqa: BLE001 - whatever stops torch.fx, reported with its message
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NotAChain(f"torch.fx cannot trace {type(module).__name__}.forward "
                         f"({type(exc).__name__}: {first})") from exc
    finally:
        module.training = saved
    train, evaluate = graphs
    sites, side = _encoder_sites(train, module)
    chain = _chain(train, side, sites)
    twins: Dict[fx.Node, fx.Node] = {}
    for a, b in itertools.zip_longest(train.nodes, evaluate.nodes):
        if a is None or b is None or (a.op, a.target, a.name) != (b.op, b.target, b.name):
            def runs(n: Optional[fx.Node]) -> str:
                return "returns" if n is None or n.op == "output" else f"runs {_describe(n)}"
            raise NotAChain(f"{type(module).__name__}.forward reads self.training: at this step training mode "
                             f"{runs(a)}, eval mode {runs(b)}")
        twins[a] = b
    out: List[_Step] = []
    prev = next(n for n in train.nodes if n.op == "placeholder")
    for n in chain:
        if n.op == "call_module":
            out.append(_Step("module", str(n.target), module.get_submodule(str(n.target)), sites.get(n)))
        else:
            try:  # constants equal in both modes; True in training and False in eval is self.training
                args = _merge(tuple(n.args), tuple(twins[n].args), prev)
                kwargs = _merge(dict(n.kwargs), dict(twins[n].kwargs), prev)
            except NotAChain:
                raise NotAChain(f"{type(module).__name__}.forward reads self.training: {_describe(n)} in training "
                                 f"mode is {_describe(twins[n])} in eval mode") from None
            out.append(_Step("glue", n.name, Functional.template(n.target, args, kwargs)))
        prev = n
    return out


def _has_hooks(module: nn.Module) -> bool:
    """Hooks run around ``module(x)``; opening the module up would drop them."""
    return any(getattr(module, attr, None) for attr in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


def _open(module: nn.Module, call: Optional[EncoderCall]) -> Optional[List[_Step]]:
    """The steps of a child that is itself a chain, or None to keep it as one layer."""
    if _has_hooks(module):
        return None
    if not any(True for _ in module.children()) and not isinstance(module, nn.Sequential):
        return None  # a leaf (an empty nn.Sequential is an identity and contributes nothing)
    try:
        return _steps(module, call)
    except NotAChain:
        return None


def _expand(steps: List[_Step], prefix: str, out: List[Tuple[str, nn.Module]], calls: List[EncoderCall]) -> None:
    for step in steps:
        path = prefix + step.name
        inner = _open(step.layer, step.call) if step.kind == "module" else None
        if step.call is not None:
            if inner is None:
                raise ValueError(f"cannot flatten: {step.call.where} is called with a mask but cannot be opened "
                                 f"(it has hooks), and as one layer it would get no mask. {BY_HAND}")
            calls.append(step.call)
        if inner is not None:
            _expand(inner, path + ".", out, calls)
        else:
            out.append((path, step.layer))


def unique_names(paths: List[str]) -> List[str]:
    """Paths as layer names: ``layer1.0`` -> ``layer1_0``, made unique and usable as attribute names."""
    used, names, container = set(), [], nn.Sequential()
    for path in paths:
        base = path.replace(".", "_") or "layer"
        name, k = base, 1
        while name in used or hasattr(container, name):  # "float", "train", "training" are taken
            name, k = f"{base}_{k}", k + 1
        used.add(name)
        names.append(name)
    return names


def configure_encoders(calls: List[EncoderCall], seen: Dict[int, List[Tuple[Any, Any]]]) -> None:
    """Give each opened encoder's layers the mask its call passed in the sample's run (in the order of the calls)."""
    taken: Dict[int, int] = {}
    for call in calls:
        k = taken.get(id(call.encoder), 0)
        runs = seen.get(id(call.encoder), [])
        if k >= len(runs):
            raise ValueError(f"cannot flatten: {call.where} was not called by model(sample) as its forward reads. "
                             f"{BY_HAND}")
        taken[id(call.encoder)] = k + 1
        call.configure(*runs[k])




def chain_layers(model: nn.Module) -> Tuple[List[Tuple[str, nn.Module]], List[EncoderCall]]:
    """``(path, layer)`` of the finest chain ``model`` is made of, and the encoder calls whose masks are to be read.

    ``NotAChain`` (naming the step) when the model's own forward is not a chain.
    """
    found: List[Tuple[str, nn.Module]] = []
    calls: List[EncoderCall] = []
    _expand(_steps(model), "", found, calls)
    return found, calls
