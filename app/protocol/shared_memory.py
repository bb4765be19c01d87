"""Triton's system shared-memory extension: regions a client on the same host registers, for tensors to travel in.

A client creates a POSIX shared-memory object (`shm_open`, a file under /dev/shm), registers a region of it
by name (its key, an offset and a byte size), then names the region in an input's or a requested output's
parameters (`shared_memory_region`, `shared_memory_byte_size`, `shared_memory_offset`): the server reads that
input from the region and writes that output into it, so neither crosses the socket.

Who may: registering, and naming a region in an inference request, are the same right, the shared-memory
group's (loopback clients only unless restricted_api grants it to a header, app/access.py); the data plane
checks it for every request that names a region (DataPlane.shared_memory_region). What may be registered: a
regular file under /dev/shm owned by the server's own user (unless shared_memory_same_owner is off), so a
client cannot have the server read or write, with its rights, an object another user made.

`SharedMemoryRegions` is the one owner of the server's open regions, as Triton's shared-memory manager is: a
region's object is opened once, at registration; each request that uses it holds it (`use`) until its answer
is written; unregistering takes the name away at once, and the descriptor is closed when the last request
holding it lets go, never under a request still reading or writing it. A region is read and written with
pread and pwrite on that descriptor, not through a mapping: a client that shrinks its object after
registering it then gets a 400 for a short read, where a mapped read past the object's end would end the
whole server with SIGBUS. That costs one copy of an input, which the batch's stacking would make anyway.
Thread-safe.
"""

from __future__ import annotations

import os
import re
import stat
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

from ..errors import InvalidBody

SHM_ROOT = "/dev/shm"  # where Linux keeps POSIX shared-memory objects: shm_open("/key") is SHM_ROOT/key
MAX_REGIONS = 256
# One POSIX shm name: no other slash, so no path outside SHM_ROOT. Both are matched whole (re.fullmatch: a `$`
# would let a trailing newline through).
_KEY = re.compile(r"/?[A-Za-z0-9._-]{1,250}")
# A region's name travels in HTTP paths (/v2/systemsharedmemory/region/<name>/...), so it has no slash, no space
# and nothing that needs escaping there: the one rule for both doors, so a name registered over gRPC can be
# read and unregistered over HTTP.
_NAME = re.compile(r"[A-Za-z0-9._:@+-]{1,256}")
NAME_RULE = "1 to 256 letters, digits and '.', '_', ':', '@', '+' or '-'"


@dataclass(eq=False)
class Region:
    """One registered region: [offset, offset + byte_size) of the object `key`, open on `_descriptor`."""

    name: str
    key: str
    offset: int
    byte_size: int
    _descriptor: int = field(repr=False)
    _users: int = 0
    _unregistered: bool = False

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def read(self, offset: int, byte_size: int, where: str) -> bytes:
        """The bytes [offset, offset + byte_size) of the region; InvalidBody past its end, or if the object was
        shrunk under it."""
        self.check_span(offset, byte_size, where)
        data = os.pread(self._descriptor, byte_size, self.offset + offset)
        if len(data) != byte_size:
            raise InvalidBody(f"{where}: shared-memory region {self.name!r} holds {len(data)} of the {byte_size} "
                              "bytes named: its object was made smaller after it was registered")
        return data

    def write(self, offset: int, data: bytes, room: int, where: str) -> None:
        """Write `data` at `offset`, within the `room` bytes the request gave it there."""
        self.check_room(offset, len(data), room, where)
        os.pwrite(self._descriptor, data, self.offset + offset)

    def check_room(self, offset: int, size: int, room: int, where: str) -> None:
        """Refuse, before any work, an output of `size` bytes that its `room` at `offset` cannot take."""
        self.check_span(offset, room, where)
        if size > room:
            raise InvalidBody(f"{where} needs {size} bytes but its shared-memory region {self.name!r} gives it "
                              f"{room} (shared_memory_byte_size)")

    def close(self) -> None:
        os.close(self._descriptor)

    def check_span(self, offset: int, byte_size: int, where: str) -> None:
        """Refuse a span [offset, offset + byte_size) that runs past the region's end."""
        if offset < 0 or byte_size < 0 or offset + byte_size > self.byte_size:
            raise InvalidBody(f"{where}: offset {offset} and byte size {byte_size} run past the end of shared-memory "
                              f"region {self.name!r}, which holds {self.byte_size} bytes")


class SharedMemoryRegions:
    """The registered regions by name; the one owner of their mappings."""

    def __init__(self, root: str = SHM_ROOT, same_owner: bool = True):
        self._root = root
        self._same_owner = same_owner  # refuse objects another user owns (shared_memory_same_owner)
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map [offset, offset + byte_size) of the shared-memory object `key` as region `name`; InvalidBody naming
        what is wrong (a name taken, a key that does not exist, an object that is not a regular file or that
        another user owns, a span past the object's end)."""
        check_name(name)
        if not isinstance(key, str) or not _KEY.fullmatch(key) or key.strip("/") in (".", ".."):
            raise InvalidBody(f"the shared-memory key {str(key)[:60]!r} is not a POSIX shared-memory name "
                              "(\"/name\": letters, digits, '.', '_' and '-')")
        for what, value in (("offset", offset), ("byte_size", byte_size)):
            if type(value) is not int or value < 0:
                raise InvalidBody(f"the shared-memory region's {what} must be a whole number of bytes, not "
                                  f"{value!r:.40}")
        if byte_size == 0:
            raise InvalidBody("the shared-memory region's byte_size must be at least 1")
        path = os.path.join(self._root, key.lstrip("/"))
        with self._lock:
            if name in self._regions:
                raise InvalidBody(f"a shared-memory region named {name!r} is registered already; unregister it first")
            if len(self._regions) >= MAX_REGIONS:
                raise InvalidBody(f"{MAX_REGIONS} shared-memory regions are registered, the most this server holds")
            try:
                # Non-blocking: a FIFO made in /dev/shm must not hold this thread; it is refused below.
                descriptor = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                raise InvalidBody(f"no shared-memory object has the key {key!r}: create it (shm_open) before "
                                  "registering it") from None
            except OSError as exc:
                raise InvalidBody(f"the shared-memory object {key!r} cannot be opened: {exc.strerror}") from None
            try:
                size = self._check_object(descriptor, key)  # of what was opened, not of the path: no race
                if offset + byte_size > size:
                    raise InvalidBody(f"offset {offset} and byte_size {byte_size} run past the end of shared-memory "
                                      f"object {key!r}, which holds {size} bytes")
            except InvalidBody:
                os.close(descriptor)
                raise
            self._regions[name] = Region(name, key, offset, byte_size, descriptor)

    def _check_object(self, descriptor: int, key: str) -> int:
        """Refuse an object that is not a regular file, or that another user owns (unless allowed); its size."""
        found = os.fstat(descriptor)
        if not stat.S_ISREG(found.st_mode):
            raise InvalidBody(f"the shared-memory object {key!r} is not a regular file")
        if self._same_owner and found.st_uid != os.geteuid():
            raise InvalidBody(f"the shared-memory object {key!r} belongs to user {found.st_uid}, not to the server's "
                              f"user ({os.geteuid()}): only its own are registered (shared_memory_same_owner)")
        return found.st_size

    def unregister(self, name: Optional[str] = None) -> None:
        """Take region `name` (every region when None) away; its descriptor closes once no request holds it. A name
        not registered is no error, as Triton has it: clients unregister before they register, to start clean."""
        with self._lock:
            if name is None:
                regions = list(self._regions.values())
            else:
                regions = [self._regions[name]] if name in self._regions else []
            for region in regions:
                del self._regions[region.name]
                region._unregistered = True
                if region._users == 0:
                    region.close()

    def status(self, name: Optional[str] = None) -> list[dict]:
        """The registered regions (or the one named), as Triton lists them: name, key, offset, byte_size."""
        if name is not None:
            check_name(name)
        with self._lock:
            if name is not None and name not in self._regions:
                raise InvalidBody(f"no shared-memory region named {name[:100]!r} is registered")
            return [r.status() for n, r in sorted(self._regions.items()) if name is None or n == name]

    @contextmanager
    def use(self, name: str, where: str) -> Iterator[Region]:
        """Hold region `name` for one request: it stays open until the request lets go, even if unregistered."""
        with self._lock:
            region = self._regions.get(name)
            if region is None:
                raise InvalidBody(f"{where} names shared-memory region {name[:100]!r}, which is not registered")
            region._users += 1
        try:
            yield region
        finally:
            with self._lock:
                region._users -= 1
                if region._unregistered and region._users == 0:
                    region.close()

    def close(self) -> None:
        """Unregister every region (at shutdown)."""
        self.unregister(None)


def check_name(name) -> None:
    """Refuse a region name outside the one rule both doors share (NAME_RULE), matched whole."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidBody(f"a shared-memory region's name must be {NAME_RULE}, not {str(name)[:60]!r}")
