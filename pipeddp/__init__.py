"""pipeddp: pipeline-parallel + data-parallel training of ``nn.Sequential`` models.

The public face is small:

- ``Pipeline``: one process, one replica, the model cut over several devices.
- ``HybridParallel``: replicas of that pipeline joined by DDP, or sharded over them with FSDP2 (``shard=``),
  under torchrun or ``spawn``.
- ``partition``: the balanced cut, with a report of what it measured; ``HeavyLayerWarning`` when one
  layer costs more than a stage's share (split it, e.g. with ``flatten_sequential``).
- ``flatten_sequential``: a model (torchvision CNNs, transformers' LMs and encoders, timm's vision transformers)
  as the fine ``nn.Sequential`` of its own layers that the engines cut, under the model's own names.
- ``spawn``: start a local multi-process job the way torchrun would.
- ``data.loader``: a DataLoader sharded by replica (not by rank), preparing batches ahead with ``prefetch=``.
- ``resume``: pick up the newest complete checkpoint of a directory.
- ``materialize``: a model built on the meta device, with the weights an engine gives its stages from ``seed=``
  (the engines take such a model as it is: each process allocates only its own layers).
- ``CollectiveError``: the ranks did not make the same collective call (``save`` on one rank, say);
  ``PeerError``: a neighbouring process of a pipeline did not deliver, or an earlier step broke the link.
- ``simulate``: predict a step from measured costs (``pipeddp plan`` ranks configurations with it).
- ``is_recomputing``: whether a layer's forward is a recompute (activation checkpointing) replay;
  ``is_checkpointing``: whether it is the first forward of a micro-batch whose activations will be recomputed.
- ``gpipe``, ``one_f_one_b``, ``interleaved``, ``zero_bubble``, ``Action``, ``format_schedule``: schedules as
  data, to print, simulate, or to start a schedule of one's own from.
"""

from .distributed import data
from .distributed.agreement import CollectiveError
from .distributed.launch import spawn
from .distributed.p2p import PeerError
from .hybrid import HybridParallel, resume
from .partitioning.report import HeavyLayerWarning, Partition, partition
from .pipeline import Pipeline
from .runtime.materialize import materialize
from .runtime.rng import is_checkpointing, is_recomputing
from .runtime.schedule.actions import Action
from .runtime.schedule.builders import gpipe, interleaved, one_f_one_b, zero_bubble
from .runtime.schedule.checks import format_schedule
from .tools.flatten import flatten_sequential
from .tools.simulate import simulate

__all__ = ["Pipeline", "HybridParallel", "Partition", "partition", "HeavyLayerWarning", "spawn", "resume", "data",
           "simulate", "gpipe", "one_f_one_b", "interleaved", "zero_bubble", "Action", "format_schedule",
           "is_recomputing", "is_checkpointing", "flatten_sequential", "CollectiveError", "PeerError",
           "materialize"]
__version__ = "0.4.0"
