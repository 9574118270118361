"""Checkpoint files: written atomically, the previous one kept, checked before anything trains on them.

A checkpoint is a ``torch.save`` zip archive (``checkpoint.pt``). :func:`save` writes the new one under a hidden
temporary name in the same folder, flushes it to disk and renames it over ``checkpoint.pt``; the file it replaces
is kept as ``checkpoint.prev.pt`` (hard-linked before the rename, so ``checkpoint.pt`` itself never disappears).
:func:`load` checks the archive before it is used: every record's CRC-32 (``torch.load`` does not check them, so
a flipped byte inside a tensor would load silently), then that it loads as a dict with the keys the caller needs.
:func:`load_with_fallback` falls back to ``checkpoint.prev.pt`` when ``checkpoint.pt`` is torn and says so.
"""
from __future__ import annotations

import logging
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch

log = logging.getLogger("atlaslab.train")

PREVIOUS_SUFFIX = ".prev"          # checkpoint.pt → checkpoint.prev.pt


class CorruptCheckpoint(RuntimeError):
    """A checkpoint file that is truncated, fails its CRC check or does not hold what a checkpoint holds."""


def previous_path(path: Union[str, Path]) -> Path:
    """Where :func:`save` keeps the checkpoint that ``path`` replaced: ``checkpoint.pt`` → ``checkpoint.prev.pt``."""
    path = Path(path)
    return path.with_name(path.stem + PREVIOUS_SUFFIX + path.suffix)


def temporary_path(path: Union[str, Path]) -> Path:
    """The hidden name a new checkpoint is written under before it is renamed to ``path``."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def save(obj: Any, path: Union[str, Path], keep_previous: bool = True) -> None:
    """Write ``obj`` to ``path`` atomically (a reader sees the old file or the new one, never a partial one); with
    ``keep_previous`` the old file stays as :func:`previous_path`."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.is_file():
            prev, prev_tmp = previous_path(path), temporary_path(previous_path(path))
            try:
                os.link(path, prev_tmp)
            except OSError:                       # a file system without hard links
                shutil.copyfile(path, prev_tmp)
            os.replace(prev_tmp, prev)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def verify(path: Union[str, Path]) -> None:
    """Raise :class:`CorruptCheckpoint` unless ``path`` is a complete zip archive whose records match their
    CRC-32."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, EOFError, OSError) as exc:
        raise CorruptCheckpoint(f"{path} is not a complete checkpoint archive ({exc})") from exc
    if bad is not None:
        raise CorruptCheckpoint(f"{path}: record {bad!r} fails its CRC-32 check")


def load(path: Union[str, Path], map_location: Any = "cpu", required: Sequence[str] = ()) -> Dict[str, Any]:
    """The checkpoint at ``path``, checked (:func:`verify`, then a dict holding every key of ``required``);
    :class:`CorruptCheckpoint` otherwise."""
    verify(path)
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise CorruptCheckpoint(f"{path} does not load ({type(exc).__name__}: {exc})") from exc
    if not isinstance(obj, dict):
        raise CorruptCheckpoint(f"{path} holds a {type(obj).__name__}, not a checkpoint dict")
    missing = [k for k in required if k not in obj]
    if missing:
        raise CorruptCheckpoint(f"{path} lacks {', '.join(missing)}")
    return obj


def load_with_fallback(path: Union[str, Path], map_location: Any = "cpu", required: Sequence[str] = (),
                       describe=None) -> Tuple[Optional[Dict[str, Any]], str]:
    """``(checkpoint, note)``: the checkpoint at ``path`` (None when there is none) and ``""``; or, when it is torn,
    the previous one and a note saying what was torn and what was used instead (also logged as a warning).
    ``describe(checkpoint)`` names the fallback in the note (e.g. its step). Both torn: :class:`CorruptCheckpoint`,
    naming both — nothing trains on a torn checkpoint, and nothing silently starts over."""
    path = Path(path)
    prev = previous_path(path)
    if not path.is_file():
        return None, ""
    try:
        return load(path, map_location, required), ""
    except CorruptCheckpoint as torn:
        if not prev.is_file():
            raise CorruptCheckpoint(f"{torn}; there is no previous checkpoint ({prev.name}) to fall back to") \
                from torn
        try:
            obj = load(prev, map_location, required)
        except CorruptCheckpoint as also:
            raise CorruptCheckpoint(f"{torn}; the previous one is torn too: {also}") from also
        what = describe(obj) if describe is not None else ""
        note = f"{torn}; resumed from the previous checkpoint {prev.name}{f' ({what})' if what else ''} instead"
        log.warning("torn checkpoint: %s", note)
        return obj, note


def remove(path: Union[str, Path]) -> None:
    """Delete the checkpoint at ``path`` and the previous one kept beside it (a fresh start)."""
    for p in (Path(path), previous_path(path)):
        if p.exists():
            p.unlink()


__all__ = ["CorruptCheckpoint", "load", "load_with_fallback", "previous_path", "remove", "save", "temporary_path",
           "verify"]
