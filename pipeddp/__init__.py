"""pipeddp: pipeline-parallel + data-parallel training of ``nn.Sequential`` models.

The public face is small:
- ``Pipeline``: one process, one replica, the model cut over several devices.
- ``HybridParallel``: replicas of that pipeline joined by DDP, or sharded over them with FSDP2 (``shard=``),
  under torchrun or ``spawn``.
- ``partition``: the balanced cut and what it measured; ``HeavyLayerWarning``: one layer costs over a stage's share.
- ``flatten_sequential``: a model (torchvision CNNs, transformers' LMs and encoders, timm's vision transformers)
  as the fine ``nn.Sequential`` of its own layers that the engines cut, under the model's own names.
- ``spawn``: start a local multi-process job the way torchrun would.
- ``data.loader``: a DataLoader sharded by replica (not by rank), preparing batches ahead with ``prefetch=``.
- ``resume``: the newest complete checkpoint of a directory; ``materialize``: a meta-built model's weights.
- ``CollectiveError``, ``PeerError``: ranks in different collective calls; a peer that did not deliver.
- ``simulate``: predict a step from measured costs (``pipeddp plan`` ranks configurations with it).
- ``is_recomputing`` / ``is_checkpointing``: whether a layer's forward is a recompute replay / a first forward
  whose activations will be recomputed. ``gpipe``, ``one_f_one_b``, ``interleaved``, ``zero_bubble``,
  ``Action``, ``format_schedule``: schedules as data.
"""

from . import data
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
           "simulate", "gpipe", "one_f_one_b", "interleaved", "zero_bubble", "Action", "format_schedule", "materialize",
           "is_recomputing", "is_checkpointing", "flatten_sequential", "CollectiveError", "PeerError"]
__version__ = "0.4.0"
