"""A tensor-parallel plan, resolved against the model before anything is allocated: which module takes which style.

``HybridParallel(..., mesh=mesh, tp_plan=...)`` on a mesh named ``dp``,
``pp``, ``tp`` shards the modules the plan names over ``tp`` with PyTorch's
own tensor parallelism (``parallelize_module``: ``ColwiseParallel``,
``RowwiseParallel``, DTensor parameters), in each stage a process holds::

    tp_plan="auto"                 the model's own (a transformers model's ``tp_plan``: its config's
                                   ``base_model_tp_plan`` and its head's ``_tp_plan``), in its names
    tp_plan={"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}
                                   patterns of the user's module names (``*`` matches one part of a
                                   name), to a style's name or any ``ParallelStyle``

The patterns are matched against the names of the model the user wrote (a
flattened model's modules are mapped back with ``Names``), and resolved to
the flattened model's own module paths, which are the stage modules' paths.

Everything here only reads the model (its modules' types and sizes, on the
meta device too), so a wrong plan is refused on every rank alike, before a
group or a tensor exists: a pattern that matches no module, a style on a
module it cannot shard, a ``tp`` size that does not divide the dimension a
style splits (a Linear's outputs for ``colwise``, inputs for ``rowwise``, an
attention's heads), and a parameter tied to another place (an embedding tied
to the head) that is not split alike at every place. A tie split alike
(``embedding_rowwise`` with ``colwise_gather_output``: both by rows of the
vocabulary) is kept one weight shard by shard (``ties``, over the ranks of one
tp coordinate).

Dropout and other random ops draw the numbers they draw without tp
(``spanned``): every tp rank of a stage runs from the stage's seed, so an
activation replicated over tp draws one mask on all of them; between a module
whose style leaves its output split (``colwise``) and the next whose style
takes a split input (``rowwise``) the activations are split, and each random
op there draws the whole tensor and keeps the rank's part
(``runtime.shard_draws``; docs/parallelism.md says where that part is the
plain model's).

A head sharded on the vocabulary (transformers' ``colwise_gather_output``)
gathers its logits, so every tp rank holds them whole and the user's loss
runs unchanged (a mean, or ``(total, count)``). A model's last layer whose
output would stay split (``colwise`` on the head) is refused: the loss would
see a slice of the vocabulary on each rank (torch's ``loss_parallel`` is not
offered).
"""

from __future__ import annotations

from fnmatch import fnmatch
from functools import lru_cache, partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from torch import nn

from ..runtime.draws import split_draws
from ..runtime.names import Names, recorded_source

__all__ = ["STYLE_NAMES", "resolve_plan", "check_tp_plan_arg", "layer_plan", "spanned"]

PlanArg = Union[str, Mapping[str, Any], None]


def _styles() -> Dict[str, Callable[[nn.Module], Any]]:
    """The styles known by name (transformers' names), each made for the module it shards."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def rowwise(m: nn.Module) -> Any:  # an embedding's input is the (replicated) token ids, not a sharded activation
        return RowwiseParallel(input_layouts=Replicate()) if isinstance(m, nn.Embedding) else RowwiseParallel()

    return {"colwise": lambda m: ColwiseParallel(), "rowwise": rowwise,
            "colwise_gather_output": lambda m: ColwiseParallel(output_layouts=Replicate()),
            "embedding_rowwise": lambda m: RowwiseParallel(input_layouts=Replicate())}


STYLE_NAMES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise")


def check_tp_plan_arg(tp_plan: PlanArg, *, has_tp: bool, mode: str) -> None:
    """The argument's type, and that it comes with a mesh that has a ``tp`` dimension, in stage mode."""
    if tp_plan is None:  # before the import: a job without tensor parallelism never loads DTensor
        return
    from torch.distributed.tensor.parallel import ParallelStyle

    if mode != "stage":
        raise ValueError(f"tp_plan shards each stage over the mesh's 'tp' dimension, one stage per process: use "
                         f"mode='stage' with mesh= (got mode={mode!r})")
    if not has_tp:
        raise ValueError("tp_plan needs a mesh with a 'tp' dimension: build it as init_device_mesh('cuda', (replicas, "
                         "stages, tp), mesh_dim_names=('dp', 'pp', 'tp')) and pass mesh=mesh")
    if isinstance(tp_plan, str):
        if tp_plan != "auto":
            raise ValueError(f"tp_plan must be 'auto' (the model's own plan) or a dict of module-name patterns to "
                             f"styles, got {tp_plan!r}")
        return
    if not isinstance(tp_plan, Mapping) or not tp_plan:
        raise ValueError(f"tp_plan must be 'auto' or a non-empty dict {{pattern: style}}, got {tp_plan!r}")
    for pattern, style in tp_plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"tp_plan's keys are module-name patterns (e.g. 'blocks.*.fc1'), got {pattern!r}")
        if not isinstance(style, ParallelStyle) and style not in STYLE_NAMES:
            raise ValueError(f"tp_plan[{pattern!r}] = {style!r}: a style is one of {STYLE_NAMES} or a "
                             "torch.distributed.tensor.parallel.ParallelStyle")


def _matches(pattern: str, name: str) -> bool:
    parts, got = pattern.split("."), name.split(".")
    return len(parts) == len(got) and all(fnmatch(g, p) for p, g in zip(parts, got))


def _auto_plan(model: nn.Sequential) -> Dict[str, Any]:
    """The model's own plan: a transformers model's ``tp_plan`` (``base_model_tp_plan`` with its head's)."""
    source = recorded_source(model)
    found = getattr(source, "tp_plan", None) if source is not None else None
    if not isinstance(found, Mapping) or not found:
        what = type(source).__name__ if source is not None else "a model not flattened from a transformers model"
        raise ValueError(f"tp_plan='auto' takes the plan a transformers model carries (config.base_model_tp_plan), but "
                         f"{what} has none: pass tp_plan={{pattern: 'colwise' | 'rowwise' | ParallelStyle}} in the "
                         "model's module names")
    unknown = {k: v for k, v in found.items() if v not in STYLE_NAMES}
    if unknown:
        raise ValueError(f"the model's own tensor-parallel plan uses styles pipeddp does not translate: {unknown} (it "
                         f"knows {STYLE_NAMES}); pass tp_plan as a dict of patterns to torch ParallelStyles instead")
    return dict(found)


def resolve_plan(model: nn.Sequential, tp_plan: PlanArg, size: int) -> Dict[str, Any]:
    """``{flattened module path: ParallelStyle}`` for ``tp_plan`` over ``size`` tensor-parallel ranks; refuses a plan
    that cannot apply (see the module docstring), naming the fix. Reads the model only."""
    from torch.distributed.tensor.parallel import ParallelStyle

    plan = _auto_plan(model) if isinstance(tp_plan, str) else dict(tp_plan or {})  # "auto": the only string
    names = Names.of(model)
    modules = [(k, names.original(k), m) for k, m in model.named_modules() if k]
    made = _styles()
    out: Dict[str, Any] = {}
    for pattern, style in plan.items():
        hits = [(k, original, m) for k, original, m in modules if _matches(pattern, original)]
        if not hits:
            raise ValueError(f"tp_plan pattern {pattern!r} matches no module of the model (its modules are named "
                             f"like {_examples(modules)}); write it in the model's own names, '*' for one part")
        for k, original, m in hits:
            built = style if isinstance(style, ParallelStyle) else made[style](m)
            _check_module(original, m, built, size)
            out[k] = built
    _check_heads(model, {names.original(k) for k in out}, size)
    _check_output(model, out, names)
    _check_ties(model, out, names)
    return out


def _examples(modules: List[Any]) -> str:
    picked = [original for _, original, m in modules if not list(m.children())][:4]
    return ", ".join(repr(n) for n in picked) or "nothing"


def _check_module(name: str, module: nn.Module, style: Any, size: int) -> None:
    """A column- or row-wise style needs a Linear or an Embedding whose split dimension ``size`` divides."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    colwise = isinstance(style, ColwiseParallel)
    if not colwise and not isinstance(style, RowwiseParallel):
        return  # another ParallelStyle says itself what it applies to
    kind = "colwise" if colwise else "rowwise"
    if isinstance(module, nn.Linear):
        dim, what = (module.out_features, "out_features") if colwise else (module.in_features, "in_features")
    elif isinstance(module, nn.Embedding):
        dim, what = (module.embedding_dim, "embedding_dim") if colwise else (module.num_embeddings, "num_embeddings")
    else:
        raise ValueError(f"tp_plan gives {name} ({type(module).__name__}) the {kind} style, which shards an nn.Linear "
                         "or an nn.Embedding only: name its Linear layers in the plan instead, or pass a ParallelStyle "
                         "written for it")
    if dim % size:
        raise ValueError(f"tp_plan shards {name} {kind} over tp={size}, but its {what}={dim} is not divisible by "
                         f"{size}: choose a tp size that divides it, or leave {name} out of the plan")


def _check_heads(model: nn.Sequential, planned: Any, size: int) -> None:
    """An attention sharded over ``tp`` splits its heads: a transformers config's head counts must divide."""
    if not any("attn" in n or "attention" in n for n in planned):
        return
    config = getattr(recorded_source(model), "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % size:
            raise ValueError(f"tp_plan splits the attention's heads over tp={size}, but config.{key}={heads} is not "
                             f"divisible by {size}: choose a tp size that divides it, or leave the attention out of "
                             "the plan")


def _check_output(model: nn.Sequential, styles: Mapping[str, Any], names: Names) -> None:
    """The model's output (its last layer's, or that layer's last module's) must be whole on every tp rank: a
    column-wise style that leaves it split would hand the loss a slice of the vocabulary on each rank."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    children = [k for k, _ in model.named_children()]
    if not children:
        return
    last = children[-1]
    leaves = [k for k, m in model.get_submodule(last).named_modules() if not list(m.children())]
    ends = {last} | ({f"{last}.{leaves[-1]}"} if leaves and leaves[-1] else set())
    for path in ends & set(styles):
        style = styles[path]
        if isinstance(style, ColwiseParallel) and any(isinstance(p, Shard) for p in style.output_layouts):
            raise ValueError(f"tp_plan shards {names.original(path)} column-wise and leaves its output split, but it "
                             "makes the model's output (the logits): the loss would see a slice of the vocabulary on "
                             "each tp rank. Give it 'colwise_gather_output' (its logits gathered whole on every tp "
                             "rank, as tp_plan='auto' does for a transformers head), or leave it out of the plan")


def _check_ties(model: nn.Sequential, styles: Mapping[str, Any], names: Names) -> None:
    """A parameter held at several places (an embedding tied to the head) that the plan shards must be split alike at
    every place: then each tp rank holds the same piece everywhere and the tie's copies are kept one shard by shard
    (``ties``: the gains summed over the ranks with the same tp coordinate). Otherwise it is refused."""
    uses: Dict[int, List[Tuple[str, str]]] = {}  # id(parameter) -> (module path, attribute) of every place
    for path, m in model.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None:
                uses.setdefault(id(p), []).append((path, attr))
    for path in styles:
        if _used_twice(model, path):
            raise ValueError(f"tp_plan shards {names.original(path)}, a module used at several places of the model; "
                             "a sharded module used twice is not supported: give each place a module of its own "
                             "(tie their weights instead), or leave it out of the plan")
        for p in model.get_submodule(path).parameters(recurse=False):
            places = sorted(set(uses[id(p)]))
            if len(places) < 2:
                continue
            split = {f"{names.original(k)}.{a}": _split_of(model.get_submodule(k), a, styles.get(k))
                     for k, a in places}
            if len(set(split.values())) > 1 or OTHER in split.values():
                told = ", ".join(f"{n} ({how})" for n, how in sorted(split.items()))
                raise ValueError(f"tp_plan shards {names.original(path)}, whose weight is tied to another place, but "
                                 f"not alike at every place: {told}. A tied weight must be split on the same dimension "
                                 "wherever it is used (an embedding 'embedding_rowwise' with its head "
                                 "'colwise_gather_output': both by rows of the vocabulary), by a style of a module of "
                                 "its own at each place: give the places such styles, untie it (a transformers "
                                 "config's tie_word_embeddings=False), or leave every place out of the plan")


OTHER = "split by a style whose layout is not known"


def _split_of(module: nn.Module, attr: str, style: Any) -> str:
    """How ``style`` lays out ``module``'s parameter ``attr``: whole, its weight split by rows or by columns, or
    ``OTHER`` where that cannot be told (another ParallelStyle, a bias)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style is None:
        return "whole"
    if attr != "weight" or not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return OTHER
    colwise = isinstance(style, ColwiseParallel)
    if isinstance(module, nn.Linear):  # a Linear's weight is (out, in): colwise splits its rows
        return "split by rows" if colwise else "split by columns"
    return "split by columns" if colwise else "split by rows"  # an Embedding's is (vocabulary, width)


def _used_twice(model: nn.Sequential, path: str) -> bool:
    target = model.get_submodule(path)
    return sum(1 for _, m in model.named_modules(remove_duplicate=False) if m is target) > 1


def layer_plan(styles: Mapping[str, Any], layer: str) -> Optional[Dict[str, Any]]:
    """The styles of the modules under the model's layer ``layer``, by their paths in it (``""``: the layer), each
    that splits an activation or takes a split one wrapped by ``spanned``."""
    out = {}
    for path, style in styles.items():
        if path == layer:
            out[""] = spanned(style)
        elif path.startswith(layer + "."):
            out[path[len(layer) + 1:]] = spanned(style)
    return out or None


def _spans(style: Any) -> Tuple[bool, bool]:
    """Whether ``style``'s module takes an input split over tp (a span of split activations ends at its forward:
    ``rowwise``) and whether it leaves its output split (one starts after it: ``colwise``; a row-wise output split
    on the sequence), read from torch's column- and row-wise styles' layouts; neither for a style of another kind."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return False, False
    return (any(isinstance(p, Shard) for p in style.input_layouts),
            any(isinstance(p, Shard) for p in style.output_layouts))


def _split_from(parts: int, index: int, module: nn.Module, inputs: Any, output: Any) -> None:
    split_draws(parts, index)


def _whole_from(module: nn.Module, inputs: Any) -> None:
    split_draws(None)


def spanned(style: Any) -> Any:
    """``style``, wrapped where its module's forward starts or ends the span of activations split over tp.

    After the forward of a module that leaves its output split, this thread's random ops act on parts of split
    tensors (``draws.split_draws``: each draws the whole tensor's numbers and keeps the rank's part); from the
    forward of a module that takes the split input, on whole tensors again. Every forward of a stage starts
    outside the span (``draws.stage_generator``), so a recompute runs through the same spans as its first forward.
    """
    ends, starts = _spans(style)
    return _spanned_style()(style, ends, starts) if ends or starts else style


@lru_cache(maxsize=None)
def _spanned_style() -> type:
    """The ParallelStyle ``spanned`` wraps with (made at the first use: DTensor is loaded with it, not before)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    class Spanned(ParallelStyle):
        """``style`` applied, then the hooks on its module that end the span before its forward (``ends``) and
        start one after it (``starts``)."""

        def __init__(self, style: Any, ends: bool, starts: bool) -> None:
            self.style, self.ends, self.starts = style, ends, starts

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            self.style.src_data_rank = self.src_data_rank  # parallelize_module sets it on the style it is given
            module = self.style._apply(module, device_mesh)
            if self.ends:
                module.register_forward_pre_hook(_whole_from)
            if self.starts:
                module.register_forward_hook(partial(_split_from, device_mesh.size(), device_mesh.get_local_rank()))
            return module

    return Spanned
