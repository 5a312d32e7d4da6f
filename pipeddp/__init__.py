"""pipeddp: pipeline-parallel + data-parallel training of ``nn.Sequential`` models.

The public face is small:

- ``Pipeline``: one process, one replica, the model cut over several devices.
- ``partition``: the balanced cut, with a report of what it measured.
"""

from .partition import Partition, partition
from .pipeline import Pipeline
from .schedule import format_schedule, gpipe, one_f_one_b

__all__ = ["Pipeline", "Partition", "partition", "gpipe", "one_f_one_b", "format_schedule"]
__version__ = "0.1.0"
