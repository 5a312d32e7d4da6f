"""Checkpoint files: one consolidated file with the plain model's keys.

A checkpoint is a ``torch.save`` of plain values only (tensors, numbers,
strings, lists, tuples, dicts), so PyTorch's safe loader opens it and
nothing in it can run code when it is read::

    {"format": "pipeddp/2",
     "model": {"0.weight": ..., ...},        # loads into the plain nn.Sequential
     "optimizer": {"state": {"0.weight": {...}}, "param_groups": [...]} or None,
     "extra": {...},                         # the caller's own values (step, epoch, ...)
     "rng": [{"torch": ..., "python": ..., "numpy": {...}, "cuda": [...]}, ...],   # one per rank
     "meta": {"stages": 2, "replicas": 2, "world_size": 4, "balance": [...], "mode": "replica",
              "optimizer": "torch.optim.adam.Adam"}}

    ck = torch.load("ckpt.pt")               # weights_only=True, PyTorch's default
    plain_model.load_state_dict(ck["model"])

pipeddp reads checkpoints only with ``weights_only=True`` (``load``): a file
that needs anything else (a pickled object that would run code, or a file
written by another program) is refused with an error naming it.

Optimizer state is keyed by parameter *name* (``optim_state.py``), not by
position, so it can be loaded by any partition of the model: each process
takes the entries of the parameters it holds. ``meta["optimizer"]`` names
the optimizer's class.

Writes are atomic: the file is written under a temporary name in the same
directory, flushed to disk (``fsync``), and renamed over the target, so a
crash leaves either the old checkpoint or the new one, never half a file.

Reading tells three cases apart, because a user acts differently on each:
a pipeddp checkpoint; a file that is damaged or is not a checkpoint at all
(random bytes, a truncated zip, another program's file:
``DamagedCheckpointError``, which ``resume`` skips, saying so); and a pickle
that references Python objects the safe loader refuses
(``UnsafeCheckpointError``: it would run code if loaded the unsafe way, so
``resume`` never falls back past it silently). The directory of
``save_checkpoint`` is ``catalog.py``'s, the sharded format ``sharded.py``'s.
"""

from __future__ import annotations

import numbers
import os
import pickle
import pickletools
import random
import secrets
import zipfile
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, cast

import numpy as np
import torch

__all__ = ["atomic_save", "FORMAT", "rng_state", "set_rng_state", "load", "check_plain", "check_model_keys",
           "check_model_tensors", "specs", "UnsafeCheckpointError", "DamagedCheckpointError", "first_line"]

#: ``pipeddp/1`` files held NumPy objects in their RNG states; see the README for a one-time conversion.
FORMAT = "pipeddp/2"
#: the file DCP writes last in a sharded checkpoint's directory (its metadata)
DCP_METADATA = ".metadata"


def _open_for_write(fd: int) -> Any:
    """The file object a save writes through (one place, so tests can inject faults)."""
    return os.fdopen(fd, "wb")


def _create_temporary(directory: str) -> Tuple[int, str]:
    """A new file ``directory/.tmp-<random>.pt``, with the permissions the user's umask gives, as ``open`` does.

    ``tempfile.mkstemp`` would make it ``-rw-------`` whatever the umask, and the
    rename keeps that: a teammate could not read the checkpoint. Creating it with
    mode 0o666 leaves the umask to decide, exactly as ``torch.save(obj, path)``.
    """
    while True:
        tmp = os.path.join(directory, f".tmp-{secrets.token_hex(6)}.pt")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to ``path`` so that readers see the old file or the whole new one.

    The file gets the permissions of a plain ``torch.save`` (0o666 less the umask).
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = _create_temporary(directory)
    try:
        with _open_for_write(fd) as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class UnsafeCheckpointError(ValueError):
    """A file PyTorch's safe loader refuses because it references Python objects: loading it would run code."""


class DamagedCheckpointError(ValueError):
    """A file (or sharded directory) that is damaged, or is not a pipeddp checkpoint at all."""


def first_line(exc: BaseException) -> str:
    """The gist of an error for a one-line message (torch's are paragraphs)."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:200]


def _pickle_globals(data: bytes) -> Optional[List[str]]:
    """The ``module.name`` globals the pickles at the start of ``data`` reference; None if none parses.

    A legacy ``torch.save`` file is several pickles followed by raw storage
    bytes, so the scan stops at the first stream that is not a pickle. Names
    reached through the memo are followed; one that cannot be told is "?".
    Nothing is unpickled: ``pickletools`` only reads the opcodes.
    """
    found: List[str] = []
    pos, parsed = 0, 0
    while pos < len(data):
        pushed: List[Optional[str]] = []
        memo: Dict[int, Optional[str]] = {}
        names: List[str] = []
        try:
            # over bytes genops always knows the position, and the memo opcodes' argument is an int
            for op, arg, at in cast(Iterator[Tuple[Any, Any, int]], pickletools.genops(data[pos:])):
                if op.name in ("GLOBAL", "INST"):
                    names.append(str(arg).replace(" ", "."))
                elif op.name == "STACK_GLOBAL":
                    mod, name = pushed[-2:] if len(pushed) >= 2 else (None, None)
                    names.append(f"{mod}.{name}" if mod and name else "?")
                elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
                    pushed.append(str(arg))
                elif op.name == "MEMOIZE":
                    memo[len(memo)] = pushed[-1] if pushed else None
                elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                    memo[int(arg)] = pushed[-1] if pushed else None
                elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                    pushed.append(memo.get(int(arg)))
                elif op.name == "STOP":
                    pos += at + 1
                elif op.name not in ("FRAME", "PROTO"):
                    pushed.append(None)
        except ValueError:  # not (or no longer) a pickle stream
            break
        parsed += 1
        found += names
    return found if parsed else None


def _refused_globals(path: str) -> List[str]:
    """The globals that made the safe loader refuse ``path`` (empty when it refused it for another reason).

    For ``torch.save``'s zip format this is PyTorch's own answer
    (``torch.serialization.get_unsafe_globals_in_checkpoint``). Any other file
    (a legacy ``torch.save``, a plain pickle) that parses as pickles and
    references globals is counted as unsafe too.
    """
    if zipfile.is_zipfile(path):
        try:
            return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except Exception:  # noqa: BLE001 - an archive torch cannot read is damaged, not unsafe
            return []
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    return _pickle_globals(data) or []


def _damaged(path: str, exc: BaseException) -> DamagedCheckpointError:
    if os.path.getsize(path) == 0:
        why = "the file is empty"
    elif not zipfile.is_zipfile(path):
        why = "not a whole torch.save file: no complete zip archive, so truncated or another kind of file"
    else:
        why = first_line(exc)
    return DamagedCheckpointError(f"{path} is damaged or is not a checkpoint ({why})")


def load(path: str, *, mmap: bool = False) -> Dict[str, Any]:
    """Read a pipeddp checkpoint with ``torch.load(weights_only=True)``, onto the CPU.

    ``mmap``: its tensors memory-mapped (copy on write), so that only the bytes
    a caller copies out are read (a process that holds slices of the model).

    Raises ``UnsafeCheckpointError`` (nothing from the file was run) when the
    safe loader refused the file because it references Python objects, and
    ``DamagedCheckpointError`` when it is damaged or not a pipeddp checkpoint
    (random bytes, a truncated file, another program's file). A missing file,
    a directory or a file without read permission raises as ``open`` would.
    """
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except pickle.UnpicklingError as exc:
        refused = _refused_globals(path)
        if refused:
            shown = ", ".join(refused[:5]) + (" ..." if len(refused) > 5 else "")
            raise UnsafeCheckpointError(
                f"{path} was refused by PyTorch's safe loader (weights_only=True): it references Python objects "
                f"({shown}) that would run code when loaded, so it is not a pipeddp checkpoint of this version, "
                "and nothing in it was run. If you wrote it yourself with an older pipeddp and trust it, convert it "
                "once as the README's 'Checkpoints' section shows."
            ) from None
        raise _damaged(path, exc) from None
    except Exception as exc:  # noqa: BLE001 - a truncated zip, an empty or a foreign file
        raise _damaged(path, exc) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or "model" not in payload:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise DamagedCheckpointError(f"{path} is not a pipeddp checkpoint of format {FORMAT!r} (found {found!r}); "
                                     "write one with HybridParallel.save or save_checkpoint")
    return payload


_PLAIN = (str, bytes, bool, numbers.Number, type(None), torch.Tensor, torch.dtype, torch.device, torch.Size)


def check_plain(value: Any, where: str) -> None:
    """Raise ``TypeError`` naming the entry of ``value`` that the safe loader could not read back.

    Checked before a checkpoint is written, so that a save never produces a
    file that ``load`` (or a plain ``torch.load``) then refuses.
    """
    if isinstance(value, _PLAIN) and not isinstance(value, (np.generic, np.ndarray)):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            check_plain(k, f"{where} key {k!r}")
            check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}; a checkpoint holds plain "
                    "values only (tensors, numbers, strings, lists, tuples, dicts), so that it loads with "
                    "torch.load(weights_only=True): convert it (e.g. int(x), x.tolist(), torch.as_tensor(x))")


def _listing(keys: Sequence[str], limit: int = 8) -> str:
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return f"{list(keys)[:limit]}{more}" if keys else "none"


def check_model_keys(path: str, saved: Iterable[str], model: Iterable[str]) -> None:
    """Raise ``ValueError`` naming ``path`` and the missing and unexpected keys, when the two sets differ.

    ``model`` is the whole model's keys (every stage's), so every rank of a
    job raises the same error, before any state changes.
    """
    saved, model = set(saved), set(model)
    missing, unexpected = sorted(model - saved), sorted(saved - model)
    if missing or unexpected:
        raise ValueError(
            f"{path} is a checkpoint of another model: missing keys (the model has them, the checkpoint does not): "
            f"{_listing(missing)}; unexpected keys (in the checkpoint, not in the model): {_listing(unexpected)}. "
            "Load it into the model it was saved from (the same layers under the same names; the stages, replicas "
            "and mode may differ)"
        )


#: ``(shape, dtype)`` of a saved tensor, as the check below compares them
Spec = Tuple[Sequence[int], torch.dtype]


def _kind(dtype: torch.dtype) -> str:
    """What a copy into a tensor of another dtype must not change: bool, integer, floating or complex values."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "integer"


def check_model_tensors(what: str, saved: Mapping[str, Spec], own: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming ``what`` and the first entries of ``own`` that ``saved`` does not fit.

    ``own``: this process's share of the model (its state dict); ``saved``:
    the shape and dtype of each saved tensor. Checked before anything is
    copied, so that a refused load leaves the model as it was: torch's
    ``load_state_dict`` copies entry after entry and raises at the first
    misfit, after the entries before it were overwritten. A dtype may change
    in precision (a float32 checkpoint loads into a float64 model, as torch
    casts it) but not in kind (floating, integer, bool, complex).
    """
    wrong = []
    for key, value in own.items():
        if key not in saved or not isinstance(value, torch.Tensor):
            continue
        shape, dtype = saved[key]
        if tuple(shape) != tuple(value.shape) or _kind(dtype) != _kind(value.dtype):
            wrong.append(f"{key}: saved {list(shape)} {str(dtype).replace('torch.', '')}, "
                         f"model {list(value.shape)} {str(value.dtype).replace('torch.', '')}")
    if wrong:
        raise ValueError(
            f"{what} holds tensors that do not fit the model ({len(wrong)} of them): {'; '.join(wrong[:5])}"
            f"{' ...' if len(wrong) > 5 else ''}. Nothing was loaded. Load it into the model it was saved from "
            "(the same layer sizes; the stages, replicas and mode may differ)"
        )


def specs(state: Mapping[str, Any]) -> Dict[str, Spec]:
    """``(shape, dtype)`` of every tensor of a state dict."""
    return {k: (tuple(v.shape), v.dtype) for k, v in state.items() if isinstance(v, torch.Tensor)}


def rng_state() -> Dict[str, Any]:
    """Every random generator this process uses: torch (CPU and CUDA), Python, NumPy, as plain values.

    NumPy's legacy state is a tuple holding an ndarray, which the safe loader
    refuses; it is stored as its parts, the 624 key words as an int64 tensor.
    """
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what ``rng_state`` recorded."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
