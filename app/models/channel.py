"""The wire between the HTTP process and a model's worker: framed messages, arrays, descriptors, shared memory.

A message is a 4-byte big-endian length, a JSON header, and then the raw bytes of each array the
header's "arrays" list names (`{"name", "dtype", "shape"}`). Nothing is pickled: the HTTP process
never unpickles what a worker sends, so a worker running a hostile model cannot run code in it that
way. Descriptors (a lane's socket and buffer) travel with a header as SCM_RIGHTS.

Pixels never travel on a socket. Each lane has a SharedBuffer, a memfd that the HTTP process stacks a
batch into (the one copy, which stacking needs anyway) and the worker reads in place. A memfd is
anonymous memory: it needs no /dev/shm (64 MiB in a default Docker container), leaves no file behind,
and is freed when both processes have closed it.

The lifetime of a mapping: a SharedBuffer never unmaps explicitly. Every array it hands out holds the
mapping (numpy keeps the mmap object as the array's base), so the mapping goes when the buffer has let
go of it and the last array over it is gone, never under a thread still copying into it. Closing the
buffer closes its descriptor only, which no mapping needs. Only the file's size can still hurt a reader
(SIGBUS past its end): the writer changes it only between calls, and the reader checks it first.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import select
import socket
import struct
import threading
from typing import Optional, Sequence

import numpy as np

_LENGTH = struct.Struct(">I")
MAX_HEADER_BYTES = 1 << 20
MAX_FDS = 64
PAGE = mmap.PAGESIZE


class ChannelClosed(EOFError):
    """The other end closed the socket or went away."""


class NothingYet(TimeoutError):
    """No message arrived within a receive's timeout; the channel is still in step."""


class Channel:
    """One end of a socket of framed messages; `send` is thread-safe, receiving belongs to one thread."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._send_lock = threading.Lock()

    @classmethod
    def pair(cls) -> tuple["Channel", socket.socket]:
        """Return this side's Channel and the other side's socket, to hand to the worker."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return cls(mine), theirs

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, header: dict, arrays: Optional[dict[str, np.ndarray]] = None, fds: Sequence[int] = ()) -> None:
        """Send one message; raise ChannelClosed if the other end is gone."""
        arrays = arrays or {}
        header = dict(header)
        if arrays:
            header["arrays"] = [{"name": name, "dtype": a.dtype.str, "shape": list(a.shape)} for name, a in arrays.items()]
        body = json.dumps(header, separators=(",", ":")).encode()
        frame = _LENGTH.pack(len(body)) + body
        try:
            with self._send_lock:
                if fds:
                    sent = socket.send_fds(self._sock, [frame], list(fds))
                    if sent < len(frame):
                        self._sock.sendall(frame[sent:])
                else:
                    self._sock.sendall(frame)
                for array in arrays.values():
                    self._sock.sendall(memoryview(np.ascontiguousarray(array)).cast("B"))
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise ChannelClosed(f"the channel is closed: {exc}") from None

    def receive(self, timeout_s: Optional[float] = None) -> tuple[dict, dict[str, np.ndarray], list[int]]:
        """Read one message: its header, its arrays and the descriptors that came with it.

        With `timeout_s`, raise NothingYet if no byte of a message arrives in that time; nothing has been
        read then, so a later receive reads the message whole. Once it begins, a message is read whole.
        """
        if timeout_s is not None and not self._readable(timeout_s):
            raise NothingYet(f"no message within {timeout_s:.3f} s")
        first, fds = self._receive_with_fds(_LENGTH.size)
        length = _LENGTH.unpack(first + self._read_exact(_LENGTH.size - len(first)))[0]
        if length > MAX_HEADER_BYTES:
            raise ChannelClosed(f"a header of {length} bytes is over the limit; the channel is out of step")
        header = json.loads(self._read_exact(length))
        arrays = {}
        for spec in header.pop("arrays", ()):
            array = np.empty(spec["shape"], dtype=np.dtype(spec["dtype"]))
            self._read_into(memoryview(array).cast("B") if array.nbytes else memoryview(b""))
            arrays[spec["name"]] = array
        return header, arrays, fds

    def _readable(self, timeout_s: float) -> bool:
        poller = select.poll()  # not select(): a busy server's descriptors pass 1024
        try:
            poller.register(self._sock, select.POLLIN)
            return bool(poller.poll(max(0, math.ceil(timeout_s * 1000))))
        except (OSError, ValueError):  # closed under us: let the read say so
            return True

    def _receive_with_fds(self, size: int) -> tuple[bytes, list[int]]:
        # Descriptors ride on the first bytes of the message they came with: read those with recvmsg.
        try:
            data, ancillary, _, _ = self._sock.recvmsg(size, socket.CMSG_SPACE(MAX_FDS * 4))
        except (ConnectionResetError, OSError) as exc:
            raise ChannelClosed(f"the channel is closed: {exc}") from None
        if not data:
            raise ChannelClosed("the other end closed the channel")
        fds: list[int] = []
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(np.frombuffer(payload[: len(payload) - len(payload) % 4], dtype=np.intc).tolist())
        return data, fds

    def _read_exact(self, size: int) -> bytes:
        buffer = bytearray(size)
        self._read_into(memoryview(buffer))
        return bytes(buffer)

    def _read_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                count = self._sock.recv_into(view[got:])
            except (ConnectionResetError, OSError) as exc:
                raise ChannelClosed(f"the channel is closed: {exc}") from None
            if count == 0:
                raise ChannelClosed("the other end closed the channel")
            got += count

    def close(self) -> None:
        """Close the socket; called by the thread that receives on it, once no send can be under way.

        The send lock is held so that no sender is between reading the descriptor's number and using
        it: a number closed under it could already name another file.
        """
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with self._send_lock:
            self._sock.close()


class SharedBuffer:
    """A growable block of shared memory (a memfd) holding one batch at a time.

    The HTTP process creates it and writes batches; the worker maps the same descriptor and reads them.
    One lane uses it at a time, and a lane belongs to one thread at a time (the one that took it), so it
    needs no lock. `nbytes` is the file's size, which only the writer changes, between calls; each side
    maps as much as it has needed so far.
    """

    def __init__(self, name: str, fd: Optional[int] = None):
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC) if fd is None else fd
        self._map: Optional[mmap.mmap] = None
        self.nbytes = os.fstat(self.fd).st_size

    def array(self, shape: Sequence[int], dtype=np.uint8, grow: bool = False) -> np.ndarray:
        """Return an array of `shape` over the buffer; the writer passes grow=True to make room first.

        The reader gets BufferTooSmall, not SIGBUS, when the file is smaller than `shape` needs.
        """
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if grow and size > self.nbytes:
            self.nbytes = _round_up(size)
            os.ftruncate(self.fd, self.nbytes)
        elif not grow:
            self.nbytes = os.fstat(self.fd).st_size
            if size > self.nbytes:
                raise BufferTooSmall(f"a batch of {size} bytes does not fit the lane's {self.nbytes}-byte buffer")
        if self._map is None or len(self._map) < size:
            self._map = mmap.mmap(self.fd, max(_round_up(size), self.nbytes if grow else 0) or PAGE)
        return np.ndarray(tuple(shape), dtype=dtype, buffer=self._map)

    def shrink(self, keep_bytes: int) -> None:
        """Give the memory of a large batch back, keeping at most `keep_bytes` (the writer, between calls)."""
        if self.nbytes > keep_bytes:
            self._map = None
            self.nbytes = 0
            try:
                os.ftruncate(self.fd, 0)
            except OSError:  # closed with its worker
                pass

    def close(self) -> None:
        """Close the descriptor; the mapping stays while an array over it lives (the module's docstring)."""
        self._map = None
        try:
            os.close(self.fd)
        except OSError:
            pass


class BufferTooSmall(ValueError):
    """A lane's message asks for more bytes than its shared buffer holds."""


def _round_up(size: int, step: int = 1 << 20) -> int:
    return max(step, -(-size // step) * step)
