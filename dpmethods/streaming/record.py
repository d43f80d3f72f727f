"""The record of a resumable map (``DataParallel.map(..., checkpoint=path)``): a JSON file.

A :class:`Record` knows which map it records (the method, a digest of each keyword
argument, the model's identity, the input's length, in item mode what shapes each item's
output, a 32-bit digest of every batch read, by index) and which batches' outputs the
consumer has taken. A record without ``"items"`` (as an earlier dpmethods wrote them) is
a map of batches. It is replaced atomically
(written to a temporary file, then renamed). Opening it refuses another map, naming the
file and what differs; :meth:`Record.check_batch` and :meth:`Record.check_end` refuse
another input as it is read. A refused run leaves the file as it found it. While a map
holds the file, ``<file>.lock`` holds a lock that the kernel drops when its process
ends: a second live map on the file is refused, naming the holder's pid.
"""

from __future__ import annotations

import array
import base64
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from dpmethods.types.digests import digest, module_identity
from dpmethods.vocab.warn_once import warn_once

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["Identity", "Record"]

_VERSION = 2
SAVE_EVERY_S = 2.0  # how often taken outputs are written while the map runs
_WRITE_SHARE = 0.01  # a record whose write takes longer is written less often


@dataclasses.dataclass(frozen=True)
class Identity:
    """What makes a map the same map: its method, a digest of each keyword argument, the
    model's identity (``None``: not checked), the input's ``len()`` (``None``: it has
    none), the shard ``(rank, world_size)`` this process runs, if any, and in item mode
    what shapes each item's output (``None``: a map of batches; see
    :meth:`dpmethods.items.ItemOptions.identity`).

    Example:
        >>> import torch
        >>> a = Identity.of("generate", range(8), {"max_new_tokens": 20}, torch.nn.Linear(2, 2))
        >>> a.length, sorted(a.arguments), a.model["class"]
        (8, ['max_new_tokens'], 'torch.nn.modules.linear.Linear')
        >>> a.arguments == Identity.of("generate", range(8), {"max_new_tokens": 50}).arguments
        False
    """

    method: str
    arguments: dict[str, str] = dataclasses.field(default_factory=dict)
    model: dict[str, str] | None = None
    length: int | None = None
    shard: tuple[int, int] | None = None
    items: dict[str, Any] | None = None

    @classmethod
    def of(cls, method: str, batches: Iterable[Any], kwargs: Mapping[str, Any] | None = None,
           model: Any = None, shard: tuple[int, int] | None = None,
           items: Mapping[str, Any] | None = None) -> Identity:
        """The identity of a map of ``method`` over ``batches`` (``items``: in item mode,
        what shapes each item's output)."""
        try:
            length: int | None = len(batches)  # type: ignore[arg-type]
        except TypeError:
            length = None
        arguments = {k: f"{digest(v):08x}" for k, v in (kwargs or {}).items()}
        return cls(method, arguments, None if model is None else module_identity(model), length, shard,
                   None if items is None else dict(items))


class Record:
    """A map's checkpoint file, held by one live map: the map it records and the batches
    whose outputs were taken. Opening it checks the folder, takes the lock and refuses
    another map; the input is checked batch by batch with :meth:`check_batch` and
    :meth:`check_end`.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "map.json")
        >>> r = Record(path, Identity("encode", length=4))
        >>> for i in range(4): r.check_batch(i, 100 + i)
        >>> r.taken(0); r.taken(1); r.taken(3); r.close()
        >>> r = Record(path, Identity("encode", length=4)); sorted(r.done)
        [0, 1, 3]
        >>> r.check_batch(0, 999)
        Traceback (most recent call last):
        ValueError: map: checkpoint: '...map.json' records another input: its batch 0 differs ...
        >>> r.close()
    """

    def __init__(self, path: str | os.PathLike[str], identity: Identity) -> None:
        self.path = Path(path)  # as given, in messages
        self._file = self.path.absolute()  # the cwd may change while the map runs
        self.identity = identity
        self._rank, self._world = identity.shard or (0, 1)
        self.done: set[int] = set()
        self.digests = array.array("I")  # of this rank's batches, by position
        self.length: int | None = identity.length  # the input's len(), where it has one
        self.count: int | None = None  # the input's batches, counted when it ended
        self._expected: int | None = None  # the batches the record's input had, where known
        self.finished = False
        self.refused = False
        self._written = False
        self._lock = _Lock(self.path)  # checks the folder too
        try:
            self._original = self._file.read_text() if self._file.exists() else None
            if self._original is not None:
                self._load(_parse(self._original, self.path))
        except BaseException:
            self._lock.release()
            raise
        self._saved_at = time.monotonic()
        self._slow = 1.0  # the interval's multiple: a write's time over 1% of SAVE_EVERY_S

    def _load(self, record: dict[str, Any]) -> None:
        differences = _differences(record, self.identity)
        self.done = {i for start, end in record["done"] for i in range(start, end)}
        self.digests.frombytes(base64.b64decode(record["batches"]))
        if sys.byteorder != "little":
            self.digests.byteswap()
        if self.done and max(self.done) >= self.extent:
            raise ValueError(
                f"map: checkpoint: {str(self.path)!r} is not a map checkpoint of dpmethods: expected "
                f"the batches in \"done\" to be among the {self.extent} in \"batches\", got batch "
                f"{max(self.done)}"
            )
        self.count, self.finished = record["count"], record["finished"]
        if self.length is None:  # this input has no len(): the record's, and its end is checked by it
            self.length = self._expected = record["len"]
        if self.count is not None:
            self._expected = self.count
        n = self.identity.length
        if n is not None and n < self.extent:
            differences.append(f"the input has {n} batches, the record has read {self.extent}")
        if differences:
            self.refused = True
            raise self._refusal(f"records another map: {'; '.join(differences)}")

    @property
    def extent(self) -> int:
        """The batches of the input the record has read (all ranks' up to its last)."""
        return 0 if not self.digests else self._rank + (len(self.digests) - 1) * self._world + 1

    @property
    def checked(self) -> int:
        """The batches to read to check the input against all the record knows: those it
        read, and one past its input's end where that is known."""
        return self.extent if self._expected is None else max(self.extent, self._expected + 1)

    def check_batch(self, index: int, crc: int) -> None:
        """Check batch ``index`` (one of this rank's) against the record, or record it."""
        position = (index - self._rank) // self._world
        if position < len(self.digests):
            if self.digests[position] != crc:
                raise self.refuse(
                    f"records another input: its batch {index} differs from the record's batch "
                    f"{index} (another order: a DataLoader with shuffle=True reshuffles on every run "
                    f"unless given a seeded generator; or other data)"
                )
            return
        if self._expected is not None and index >= self._expected:
            raise self.refuse(f"records an input of {self._expected} batches, but this input has more")
        self.digests.append(crc)

    def check_end(self, count: int) -> None:
        """The input ended after ``count`` batches: check it against the record."""
        expected = self._expected
        if (expected is not None and count != expected) or count < self.extent:
            raise self.refuse(
                f"records an input of {max(expected or 0, self.extent)} batches, but this input "
                f"ended after {count}"
            )
        self.count = count

    def taken(self, index: int) -> None:
        """The consumer took batch ``index``'s output; written every ``SAVE_EVERY_S``, or
        less often where the write would take more than 1% of the time."""
        self.done.add(index)
        if time.monotonic() - self._saved_at >= SAVE_EVERY_S * self._slow:
            self.save()

    def save(self) -> None:
        """Write the record atomically: a reader sees the old file or the new one. A
        refused run writes nothing."""
        if self.refused:
            return
        digests = self.digests
        if sys.byteorder != "little":
            digests = array.array("I", digests)
            digests.byteswap()
        identity = self.identity
        record = {"version": _VERSION, "method": identity.method, "arguments": identity.arguments,
                  "model": identity.model, "items": identity.items, "len": self.length, "count": self.count,
                  "batches": base64.b64encode(digests.tobytes()).decode(),
                  "done": _ranges(self.done), "finished": self.finished}
        start = time.monotonic()
        self._write(json.dumps(record))
        self._written = True
        self._saved_at = time.monotonic()
        self._slow = max(1.0, (self._saved_at - start) / (_WRITE_SHARE * SAVE_EVERY_S or 1.0))

    def _write(self, text: str | None) -> None:
        if text is None:
            self._file.unlink(missing_ok=True)
            return
        tmp = self._file.with_name(f".{self._file.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, self._file)

    def refuse(self, reason: str) -> ValueError:
        """The error that refuses this run, naming the file and ``reason``; from now on
        nothing is written, and the file is put back as this run found it."""
        if not self.refused:
            self.refused = True
            if self._written:
                self._write(self._original)
        return self._refusal(reason)

    def _refusal(self, reason: str) -> ValueError:
        return ValueError(
            f"map: checkpoint: {str(self.path)!r} {reason}. It is not this map's record: pass "
            "another file, or delete it to start over"
        )

    def close(self, save: bool = True) -> None:
        """Write the record (unless refused, or ``save=False``) and release the lock."""
        try:
            if save:
                self.save()
        finally:
            self._lock.release()


def _ranges(indices: set[int]) -> list[list[int]]:
    ranges: list[list[int]] = []
    for i in sorted(indices):
        if ranges and ranges[-1][1] == i:
            ranges[-1][1] = i + 1
        else:
            ranges.append([i, i + 1])
    return ranges


def _differences(record: dict[str, Any], identity: Identity) -> list[str]:
    """What differs between the map ``record`` records and the map ``identity`` names."""
    found = []
    if record["method"] != identity.method:
        found.append(f"its method is {record['method']!r}, this map's {identity.method!r}")
    theirs, ours = record["arguments"], identity.arguments
    changed = sorted(k for k in {*theirs, *ours} if theirs.get(k) != ours.get(k))
    if changed:
        what = [f"{k} ({'new' if k not in theirs else 'not given' if k not in ours else 'another value'})"
                for k in changed]
        found.append(f"the method's keyword arguments differ: {', '.join(what)}")
    theirs, ours = record["model"] or {}, identity.model or {}
    if theirs and ours and theirs["class"] != ours["class"]:
        found.append(f"its model is a {theirs['class']}, this map's a {ours['class']}")
    elif theirs.keys() & ours.keys() >= {"tensors"} and theirs["tensors"] != ours["tensors"]:
        found.append("its model's parameters and buffers have other names, shapes or dtypes")
    elif theirs.keys() & ours.keys() >= {"values"} and theirs["values"] != ours["values"]:
        found.append("its model has other weights (a sample of its parameters' values differs)")
    if theirs.get("class") == ours.get("class") and theirs.keys() & ours.keys() >= {"settings"}:
        found += _setting_differences(theirs["settings"], ours["settings"])
    found += _item_differences(record.get("items"), identity.items, "items" in record)
    n, length, count = identity.length, record["len"], record["count"]
    known = length if length is not None else count
    if n is not None and known is not None and n != known:
        found.append(f"its input had {known} batches, this input has {n}")
    return found


def _setting_differences(theirs: str, ours: str) -> list[str]:
    """Which of the model's settings (``name=digest;...``, see
    :func:`dpmethods.types.digests.module_identity`) differ."""
    split = lambda text: dict(part.rpartition("=")[::2] for part in text.split(";") if part)  # noqa: E731
    a, b = split(theirs), split(ours)
    changed = sorted(k for k in {*a, *b} if a.get(k) != b.get(k))
    if not changed:
        return []
    what = [f"{k} ({'new' if k not in a else 'not held' if k not in b else 'another value'})" for k in changed]
    return [f"its model's settings differ: {', '.join(what)}"]


def _item_differences(theirs: dict[str, Any] | None, ours: dict[str, Any] | None, recorded: bool) -> list[str]:
    """What differs in what shapes each item's output (None: a map of batches)."""
    if theirs is None and ours is None:
        return []
    if theirs is None:
        earlier = "" if recorded else (" (or it is a record of an earlier dpmethods, which did not record "
                                       "a map of items as one)")
        return [f"its map read batches{earlier}, this map reads items (batch_size= or max_tokens=)"]
    if ours is None:
        return ["its map read items (batch_size= or max_tokens=), this map reads batches"]
    found = []
    if bool(theirs.get("trim")) != bool(ours.get("trim")):
        found.append("its items were trimmed (trim=True), this map's are not" if theirs.get("trim")
                     else "its items were not trimmed, this map's are (trim=True)")
    if theirs.get("collate") != ours.get("collate"):
        found.append(f"its items were collated by {_named(theirs.get('collate'), 'collate')}, this "
                     f"map's by {_named(ours.get('collate'), 'collate')}")
    elif theirs.get("length") != ours.get("length") and "length" in theirs and "length" in ours:
        found.append(f"its trimmed items' own positions came from {_named(theirs['length'], 'length')}, "
                     f"this map's from {_named(ours['length'], 'length')}")
    return found


def _named(name: str | None, what: str) -> str:
    return f"the default {what}" if name is None else f"{what}={name}"


_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "method": ("a str", lambda v: isinstance(v, str)),
    "arguments": ("an object of str digests", lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
    "model": ("null or an object of str", lambda v: v is None or (isinstance(v, dict) and "class" in v and all(isinstance(x, str) for x in v.values()))),
    "len": ("null or an int >= 0", lambda v: v is None or (type(v) is int and v >= 0)),
    "count": ("null or an int >= 0", lambda v: v is None or (type(v) is int and v >= 0)),
    "batches": ("a base64 str of 4-byte digests", lambda v: isinstance(v, str) and len(v) % 8 in (0, 4)),
    "done": ("a list of [start, end] index pairs with 0 <= start < end",
             lambda v: isinstance(v, list) and all(
                 isinstance(p, list) and len(p) == 2 and all(type(i) is int for i in p) and 0 <= p[0] < p[1]
                 for p in v)),
    "finished": ("a bool", lambda v: isinstance(v, bool)),
}
_OPTIONAL: dict[str, tuple[str, Callable[[Any], bool]]] = {  # absent in an earlier dpmethods' records
    "items": ("null or an object of bools, strs and nulls", lambda v: v is None or (isinstance(v, dict) and all(
        x is None or isinstance(x, (bool, str)) for x in v.values()))),
}


def _parse(text: str, path: Path) -> dict[str, Any]:
    """The record in ``text``, checked field by field; an error names the file and what
    was expected."""
    where = f"map: checkpoint: {str(path)!r} is not a map checkpoint of dpmethods"
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where}: it is not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if record.get("version") != _VERSION:
        raise ValueError(
            f"{where} of this version: expected \"version\": {_VERSION}, got {record.get('version')!r}"
            + (" (a record of an earlier dpmethods, which did not record which map it was; "
               "delete it to start over)" if record.get("version") == 1 else "")
        )
    for name, (expected, ok) in {**_FIELDS, **_OPTIONAL}.items():
        if name not in record:
            if name in _OPTIONAL:
                continue
            raise ValueError(f"{where}: expected a field \"{name}\" ({expected}), but it has none")
        if not ok(record[name]):
            value = record[name]
            raise ValueError(f"{where}: expected \"{name}\" to be {expected}, got "
                             f"{type(value).__name__} {json.dumps(value)[:60]}")
    try:
        digests = base64.b64decode(record["batches"], validate=True)
    except ValueError:
        digests = b"?"
    if len(digests) % 4:
        raise ValueError(f"{where}: expected \"batches\" to be {_FIELDS['batches'][0]}")
    return record


class _Lock:
    """``<record>.lock``, locked (``flock``) by one live map: a second is refused with the
    holder's pid, and a lock whose process died is free again (the kernel drops it)."""

    def __init__(self, record: Path) -> None:
        self.path = record.absolute().with_name(record.name + ".lock")  # the cwd may change
        self._fd: int | None = None
        _check_folder(record)
        if fcntl is None:  # pragma: no cover - not POSIX
            warn_once("map: checkpoint: this platform has no fcntl.flock, so a record used by two "
                      "live maps at once is not refused; run one map per record")
            return
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise type(exc)(exc.errno, f"map: checkpoint: cannot create the lock {str(self.path)!r} "
                                f"beside the record: {exc.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                raise RuntimeError(_in_use(record, pid)) from None
            except OSError as exc:  # a file system without locks (some network ones)
                os.close(fd)
                warn_once(f"map: checkpoint: {str(self.path)!r} cannot be locked ({exc.strerror}), so "
                          "a record used by two live maps at once is not refused; run one map per record")
                return
            try:  # its holder may have removed it between our open and our lock
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, b"%d\n" % os.getpid())
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            self.path.unlink(missing_ok=True)  # before unlocking: no one locks a removed file
            fcntl.flock(fd, fcntl.LOCK_UN)  # forked children may hold copies of the descriptor
            os.close(fd)


def _in_use(record: Path, pid: str) -> str:
    if pid == str(os.getpid()):
        return (f"map: checkpoint: {str(record)!r} is in use by another live map in this process "
                f"(pid {pid}): close that map first (close(), a with block, or dropping it)")
    holder = f"process {pid}" if pid.isdigit() else "another process"
    return (f"map: checkpoint: {str(record)!r} is in use by a live map in {holder}: two maps on "
            "one record would lose each other's work; wait for that map to end, or stop it")


def _check_folder(path: Path) -> None:
    if path.is_dir():
        raise IsADirectoryError(f"map: checkpoint: expected a file path, got the folder {str(path)!r}")
    if not path.parent.is_dir():
        raise FileNotFoundError(
            f"map: checkpoint: the folder {str(path.parent)!r} of {str(path)!r} does not exist; "
            "create it first"
        )
