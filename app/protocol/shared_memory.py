"""Triton's system shared-memory extension: regions a client on the same host registers, for tensors to travel in.

A client creates a POSIX shared-memory object (`shm_open`, a file under /dev/shm), registers a region of it
by name (its key, an offset and a byte size), then names the region in an input's or a requested output's
parameters (`shared_memory_region`, `shared_memory_byte_size`, `shared_memory_offset`): the server reads that
input from the region and writes that output into it, so neither crosses the socket.

`SharedMemoryRegions` is the one owner of the server's mappings, as Triton's shared-memory manager is: a
region is mapped once, at registration; each request that uses it holds it (`use`) until its answer is
written; unregistering takes the name away at once, and the mapping is closed when the last request holding
it lets go, never under a request still reading or writing it. Thread-safe.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

from ..errors import InvalidBody

SHM_ROOT = "/dev/shm"  # where Linux keeps POSIX shared-memory objects: shm_open("/key") is SHM_ROOT/key
MAX_REGIONS = 256
_KEY = re.compile(r"^/?[A-Za-z0-9._-]{1,250}$")  # one POSIX shm name: no other slash, so no path outside SHM_ROOT
_NAME = re.compile(r"^[^\x00-\x1f]{1,256}$")


@dataclass(eq=False)
class Region:
    """One registered region: its mapping of [offset, offset + byte_size) of the object `key`."""

    name: str
    key: str
    offset: int
    byte_size: int
    _mapping: mmap.mmap = field(repr=False)
    _users: int = 0
    _unregistered: bool = False

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def view(self, offset: int, byte_size: int, where: str) -> memoryview:
        """The bytes [offset, offset + byte_size) of the region, without a copy; InvalidBody past its end."""
        self._check_span(offset, byte_size, where)
        return memoryview(self._mapping)[self._start + offset:self._start + offset + byte_size]

    def write(self, offset: int, data: bytes, room: int, where: str) -> None:
        """Write `data` at `offset`, within the `room` bytes the request gave it there."""
        self._check_span(offset, room, where)
        if len(data) > room:
            raise InvalidBody(f"{where} needs {len(data)} bytes but its shared-memory region {self.name!r} gives it "
                              f"{room} (shared_memory_byte_size)")
        self._mapping[self._start + offset:self._start + offset + len(data)] = data

    def close(self) -> None:
        """Unmap the region; where an array made from it still lives, the unmapping waits for that array to go."""
        try:
            self._mapping.close()
        except BufferError:  # a view of it is still referenced: the mapping goes with the last one
            pass

    @property
    def _start(self) -> int:
        return self.offset % mmap.ALLOCATIONGRANULARITY  # the mapping begins at the page holding `offset`

    def _check_span(self, offset: int, byte_size: int, where: str) -> None:
        if offset < 0 or byte_size < 0 or offset + byte_size > self.byte_size:
            raise InvalidBody(f"{where}: offset {offset} and byte size {byte_size} run past the end of shared-memory "
                              f"region {self.name!r}, which holds {self.byte_size} bytes")


class SharedMemoryRegions:
    """The registered regions by name; the one owner of their mappings."""

    def __init__(self, root: str = SHM_ROOT):
        self._root = root
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map [offset, offset + byte_size) of the shared-memory object `key` as region `name`; InvalidBody naming
        what is wrong (a name taken, a key that does not exist, a span past the object's end)."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidBody("a shared-memory region needs a name: 1 to 256 printable characters")
        if not isinstance(key, str) or not _KEY.match(key):
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
                descriptor = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            except FileNotFoundError:
                raise InvalidBody(f"no shared-memory object has the key {key!r}: create it (shm_open) before "
                                  "registering it") from None
            except OSError as exc:
                raise InvalidBody(f"the shared-memory object {key!r} cannot be opened: {exc.strerror}") from None
            try:
                size = os.fstat(descriptor).st_size
                if offset + byte_size > size:
                    raise InvalidBody(f"offset {offset} and byte_size {byte_size} run past the end of shared-memory "
                                      f"object {key!r}, which holds {size} bytes")
                start = offset - offset % mmap.ALLOCATIONGRANULARITY
                mapping = mmap.mmap(descriptor, offset + byte_size - start, offset=start)
            finally:
                os.close(descriptor)
            self._regions[name] = Region(name, key, offset, byte_size, mapping)

    def unregister(self, name: Optional[str] = None) -> None:
        """Take region `name` (every region when None) away; its mapping closes once no request holds it. A name
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
        with self._lock:
            if name is not None and name not in self._regions:
                raise InvalidBody(f"no shared-memory region named {name[:100]!r} is registered")
            return [r.status() for n, r in sorted(self._regions.items()) if name is None or n == name]

    @contextmanager
    def use(self, name: str, where: str) -> Iterator[Region]:
        """Hold region `name` for one request: it stays mapped until the request lets go, even if unregistered."""
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
