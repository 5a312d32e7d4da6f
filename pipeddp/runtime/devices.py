"""Check and normalise the devices users name."""

from __future__ import annotations

from typing import List, Sequence, Union

import torch

__all__ = ["resolve_device", "resolve_devices", "DeviceLike"]

DeviceLike = Union[str, int, torch.device]


def resolve_device(device: DeviceLike) -> torch.device:
    """A ``torch.device`` that exists on this machine, or a ``ValueError`` that says what does.

    ``"cuda"`` without an index means the current CUDA device; an int ``i``
    means ``cuda:i`` (as in torch). Only CPU and CUDA devices are supported.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{device!r} is not a device name; use e.g. 'cpu' or 'cuda:0'") from exc
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device {device!r}: pipeddp runs stages on 'cpu' or 'cuda:N' devices only")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(
            f"device {str(dev)!r} does not exist: this machine has no usable CUDA device; "
            "run the stages on CPU with devices=['cpu', 'cpu']"
        )
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= count:
        raise ValueError(
            f"device {str(dev)!r} does not exist: this machine has {count} CUDA device(s), "
            f"cuda:0 to cuda:{count - 1}"
        )
    return torch.device("cuda", index)


def resolve_devices(devices: Sequence[DeviceLike]) -> List[torch.device]:
    """Resolve a non-empty list of devices (one per stage)."""
    if isinstance(devices, (str, int, torch.device)) or not isinstance(devices, Sequence):
        raise TypeError(
            f"devices must be a list with one device per stage, e.g. ['cuda:0', 'cuda:1'], got {devices!r}"
        )
    if len(devices) == 0:
        raise ValueError("devices is empty: give one device per stage, e.g. ['cpu', 'cpu']")
    return [resolve_device(d) for d in devices]
