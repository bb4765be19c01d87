"""The listening socket at shutdown: close it without resetting the connections the kernel queued.

The kernel completes a client's handshake on its own and queues the connection until the server accepts
it. Closing a listening socket resets every connection still in that queue, so a client that connected
and sent its request in the moment before the close gets a reset instead of an answer: a chaos soak's
SIGTERM under traffic caught 3 such clients. On Linux a socket filter that drops every packet, attached
to the listening socket, stops new handshakes from completing (a new client's SYN goes unanswered; it
sends it again a second later and, the port closed by then, is refused, which says plainly that nothing
was taken); the server then accepts what was queued, answers it, and the close resets nothing.

Elsewhere, or where the kernel refuses the filter, `seal` returns False and the close is as before.
"""

from __future__ import annotations

import ctypes
import socket
import struct
import sys
from typing import Optional

SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)  # Linux's value; Python does not name it
_DROP_EVERY_PACKET = struct.pack("HBBI", 0x06, 0, 0, 0)  # classic BPF: BPF_RET | BPF_K, return 0 bytes
_TCP_INFO_UNACKED = 24  # struct tcp_info: 8 one-byte fields, then rto, ato, snd_mss, rcv_mss, unacked


def seal(listener: socket.socket) -> bool:
    """Stop new connections from completing on `listener`, which stays open; True if it is sealed."""
    if not sys.platform.startswith("linux"):
        return False
    program = ctypes.create_string_buffer(_DROP_EVERY_PACKET)  # the kernel copies it while attaching
    try:
        listener.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER,
                            struct.pack("@HP", 1, ctypes.addressof(program)))  # struct sock_fprog
    except OSError:
        return False
    return True


def queued(listener: socket.socket) -> Optional[int]:
    """Return how many connections the kernel holds for `listener` not yet accepted, or None if unknown.

    For a listening socket Linux reports its accept queue's length as tcp_info's `unacked`.
    """
    try:
        info = listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except (OSError, AttributeError):
        return None
    if len(info) < _TCP_INFO_UNACKED + 4:
        return None
    return struct.unpack_from("I", info, _TCP_INFO_UNACKED)[0]
