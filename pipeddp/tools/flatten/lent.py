"""Running a model built on the meta device within about one module's memory, so that it can be flattened.

``flatten_sequential`` finds a model's layers by running it on a sample and
checks the result by running both; a model built under
``torch.device("meta")`` has no values to run. Giving it all its memory would
defeat building it there, so each module that owns meta tensors is *lent*
memory and values only while it runs: a forward pre-hook swaps in CPU tensors
initialised from a generator seeded by the module's name (its ``init``, else
``reset_parameters()``, else small normal values for floating tensors and zeros
for the rest), and the forward hook puts the meta tensors back. Both runs see
the same values, so the comparison holds; nothing lent outlives the run (the
layers built while the model ran that hold the model's own tensors, the first
layer of each block stack and a replayed head, register them again afterwards:
``StackInput.take_kept``, ``TailProgram.take_kept``).

A module that owns tensors and has children (a vision transformer's class token
beside its blocks, BERT's embeddings and their ``token_type_ids`` buffer) may
use its own tensors anywhere in its forward, between its children's calls: it
is lent for the whole run instead, which costs its own tensors only (its
children are lent one by one).

A forward that reads a module's tensor without calling that module (a weight
tied by reference to ``other.weight`` and used as ``F.linear(h, other.weight)``)
meets a meta tensor and fails; ``flatten_sequential`` then says to build the
model on a real device.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...runtime.materialize import Init, initialiser, layer_seed

__all__ = ["LentWeights"]

#: the seed lent values are drawn from (any fixed seed: the two runs only need the same values)
_SEED = 0


class _Loan:
    """One module's meta tensors and the CPU tensors lent in their place while it runs (calls may nest)."""

    def __init__(self, name: str, module: nn.Module, init: Optional[Init]) -> None:
        self.name, self.module, self.init = name, module, init
        self.depth = 0
        self.meta: Dict[Tuple[str, str], torch.Tensor] = {}

    def lend(self) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        m = self.module
        tables: Tuple[Tuple[str, Dict[str, Any]], ...] = (("p", m._parameters), ("b", m._buffers))
        for kind, table in tables:
            for key, t in list(table.items()):
                if t is not None and t.is_meta:
                    self.meta[(kind, key)] = t
                    real = torch.empty_like(t, device="cpu")
                    table[key] = nn.Parameter(real, requires_grad=t.requires_grad) if kind == "p" else real
        run = initialiser(m, self.init)
        with torch.no_grad():
            if run is not None:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(layer_seed(_SEED, self.name))
                    run()
            else:
                generator = torch.Generator().manual_seed(layer_seed(_SEED, self.name))
                for kind, key in self.meta:
                    t = (m._parameters if kind == "p" else m._buffers)[key]
                    assert t is not None
                    if t.is_floating_point():
                        t.normal_(0.0, 0.02, generator=generator)
                    else:
                        t.zero_()

    def give_back(self) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        for (kind, key), t in self.meta.items():
            table: Dict[str, Any] = self.module._parameters if kind == "p" else self.module._buffers
            table[key] = t
        self.meta.clear()


class LentWeights:
    """While entered, every module of ``model`` that owns meta tensors has memory and values when it runs."""

    def __init__(self, model: nn.Module, init: Optional[Init] = None) -> None:
        self.loans: List[_Loan] = []
        for name, m in model.named_modules():
            if any(t.is_meta for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))):
                self.loans.append(_Loan(name, m, init))
        self._hooks: List[RemovableHandle] = []
        self._held: List[_Loan] = []

    def __enter__(self) -> "LentWeights":
        try:
            for loan in self.loans:
                if any(True for _ in loan.module.children()):
                    loan.lend()  # may use its own tensors between its children's calls: lent for the whole run
                    self._held.append(loan)
                else:
                    self._hooks.append(loan.module.register_forward_pre_hook(lambda *_, loan=loan: loan.lend()))
                    self._hooks.append(loan.module.register_forward_hook(lambda *_, loan=loan: loan.give_back(),
                                                                         always_call=True))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for loan in self._held:
            loan.give_back()
        self._held.clear()
