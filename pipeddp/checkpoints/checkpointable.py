"""What both public classes do with checkpoints: ``save``, ``save_checkpoint``, ``wait_for_save``, ``load``, ``resume``.

One implementation for ``Pipeline`` (one process) and ``HybridParallel``
(any layout), so the two write the same formats with the same guarantees
and load each other's checkpoints::

    Pipeline  ----save / save_checkpoint---->  ckpt.pt  or  run/step-000000042/  ---load / resume--->  HybridParallel
              <---load / resume-------------                                     <--save ------------

A class using it holds ``topology`` (a ``Pipeline`` is the one-process
topology: one replica, world size 1), ``agreement``, ``balance`` and a
``Saver`` in ``_saver``; with a fixed global batch (``global_batch_plan``)
checkpoints also record the data position (``position``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..distributed.agreement import Agreement
from ..distributed.elastic import POSITION_KEY, DataPosition, GlobalBatch
from ..distributed.topology import Topology
from ..runtime.names import Names, key_mismatch
from ..runtime.warn import warn
from . import checkpoint as files
from . import export, saving, state

__all__ = ["Checkpointable"]


class Checkpointable(nn.Module):
    """Checkpoint methods for an engine (listed before the engine's other base: ``class X(Checkpointable, ...)``).

    Every method is a collective in a job of several processes: call it on
    every rank. Loading is all or nothing: a checkpoint that does not fit the
    model (keys, shapes, dtypes) or the optimizer raises ``ValueError`` naming
    the file and the first entries that differ, and nothing changes.
    """

    topology: Topology
    agreement: Agreement
    balance: List[int]
    _saver: saving.Saver
    #: a fixed global batch (HybridParallel's ``global_batch``); None: checkpoints hold no data position
    global_batch_plan: Optional[GlobalBatch] = None
    position: DataPosition
    key_names: Names
    #: the transformers model the layers came from (``export.source_of``): save_pretrained writes its configuration
    _export_source: Optional[export.Source] = None
    #: the 1-D ``tp`` DeviceMesh of a tensor-parallel engine (None without): its checkpoints are written once for
    #: every tp slice's job, and read per block (``peers``, ``slices``)
    tp_mesh: Optional[Any] = None

    def local_state_dict(self) -> Dict[str, Any]:
        """This process's part of the model, with the model's keys."""
        return super().state_dict()

    # mypy: nn.Module.load_state_dict's Mapping type is narrower than the state dicts both classes take
    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """As ``nn.Module.load_state_dict``, but all or nothing: every entry that this process holds is checked
        (shape and kind of dtype) before any is copied, and with ``strict`` so are the keys (``model_keys``: every
        key of the whole model, for the keys nobody holds); a misfit raises naming the first ones."""
        own = self.local_state_dict()
        if strict:
            self.check_keys(state_dict, own)
        saved = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
        files.check_model_tensors("the state dict", files.specs(saved), own)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def check_keys(self, state_dict: Dict[str, Any], own: Dict[str, Any]) -> None:
        """Refuse, before anything is copied, a state dict that lacks a key this process holds (``own``: its
        ``local_state_dict()``) or has a key the whole model lacks (``model_keys``); the original model's names and
        the pipeline's are both taken."""
        original = self.key_names.original
        given = {original(k) for k in state_dict}
        missing = [k for k in own if k not in given]
        known = set(self.model_keys())
        unexpected = list(dict.fromkeys(original(k) for k in state_dict if original(k) not in known))
        if missing or unexpected:
            raise RuntimeError(key_mismatch(type(self).__name__, missing, unexpected,
                                            f" (rank {self.topology.rank}; nothing was loaded; strict=False loads "
                                            "what matches)"))

    def model_keys(self) -> List[str]:
        """Every key of the whole model's state dict (this process may hold only some of them)."""
        return list(self.local_state_dict())

    def save(self, path: str, optimizer: Optional[torch.optim.Optimizer] = None,
             extra: Optional[Dict[str, Any]] = None, *, sharded: bool = False, async_save: bool = False) -> None:
        """One checkpoint (call on every rank). ``extra``: plain values.

        By default one file, gathered on rank 0 and written there atomically.
        ``sharded=True``: ``path`` is a directory that every process writes its
        own share into, in parallel (torch.distributed.checkpoint), nothing
        gathered; ``async_save=True`` then returns once the share is copied and
        writes it in the background (the next save, load or ``close`` waits).
        """
        # mypy: the mixin is an Engine only once a class adds topology and agreement: mypy cannot see that here
        saving.save(self, path, optimizer, self._with_position(extra), sharded=sharded,  # type: ignore[arg-type]
                    async_save=async_save, saver=self._saver)

    def save_checkpoint(self, directory: str, step: int, optimizer: Optional[torch.optim.Optimizer] = None, *,
                        keep: int = 3, extra: Optional[Dict[str, Any]] = None, sharded: bool = False,
                        async_save: bool = False) -> str:
        """``directory/step-<step>.pt`` (atomic; with ``sharded=True`` the directory ``step-<step>``), keeping the
        newest ``keep`` complete ones, with every rank's RNG states; ``sharded`` and ``async_save`` as in ``save``."""
        # mypy: as above: the concrete class completes the Engine protocol
        return saving.save_checkpoint(self, directory, step, optimizer, keep=keep,  # type: ignore[arg-type]
                                      extra=self._with_position(extra), sharded=sharded, async_save=async_save,
                                      saver=self._saver)

    def save_pretrained(self, directory: str) -> None:
        """The model as a Hugging Face directory (call on every rank): each process writes its own tensors as
        safetensors under the original model's names, rank 0 the index, last, and for a model flattened from a
        transformers model its config, so that the original class's ``from_pretrained(directory)`` opens it (and
        ``load``). A tied weight is written once. A directory holding other files is refused; an earlier export
        there is replaced. See ``pipeddp.checkpoints.export``."""
        # mypy: as above: the concrete class completes the Exporter protocol
        export.save_pretrained(self, directory, self._export_source, saver=self._saver)  # type: ignore[arg-type]

    def wait_for_save(self) -> Optional[str]:
        """Wait until the asynchronous save in flight is complete; returns its path (None if there was none)."""
        return self._saver.wait()

    def load(self, path: str, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
        """Load a checkpoint, a file or a sharded directory, written by any stages/replicas layout (or the other
        class); returns its ``extra``. The optimizer state is matched by parameter name."""
        # mypy: as above: the concrete class completes the Engine protocol
        extra = self._restore_position(state.load(self, path, optimizer, saver=self._saver))  # type: ignore[arg-type]
        assert extra is not None
        return extra

    def resume(self, directory: str, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[Dict[str, Any]]:
        """Load the newest complete checkpoint of ``directory`` (either format); returns its ``extra`` (with
        ``step``), or None when there is none (a warning says so when the directory holds files but no
        checkpoint that reads; a first run, with no directory yet or an empty one, is quiet)."""
        # mypy: as above: the concrete class completes the Engine protocol
        return self._restore_position(state.resume(self, directory, optimizer,  # type: ignore[arg-type]
                                                   saver=self._saver))

    def _with_position(self, extra: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """``extra`` plus the data position, with a fixed global batch (so a restart resumes the epoch)."""
        plan = self.global_batch_plan
        if plan is None:
            return extra
        if extra and POSITION_KEY in extra:
            raise ValueError(f"extra may not use the key {POSITION_KEY!r}: with global_batch the engine records the "
                             "data position there; rename your entry")
        return dict(extra or {}, **{POSITION_KEY: dict(self.position.state(), global_batch=plan.total)})

    def _restore_position(self, extra: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """Take the data position a loaded checkpoint recorded (with a fixed global batch)."""
        if extra is None or self.global_batch_plan is None:
            return extra
        if POSITION_KEY not in extra:
            warn("pipeddp: the checkpoint holds no data position (it was saved without global_batch), so "
                 "the loader starts epoch 0 from its beginning; set engine.position.epoch/.consumed "
                 "yourself if you know where the job stood", RuntimeWarning)
            return extra
        self.position.restore(extra[POSITION_KEY])
        return extra
