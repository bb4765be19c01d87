"""Who may use what: Triton's restricted-API groups, and the loopback default for the model repository.

Plain policy that both front doors apply: HTTP names a request's group from its path (app/http/access.py),
gRPC from its method (app/grpc/calls.py), and both ask `group_refusal`. A `restricted_api` entry, in Triton's
`--http-restricted-api` form `<group>[,<group>...]:<header>=<value>`, makes its groups answer only
requests that carry that header with that value; entries are separated by `;`. The model-repository
group (load, unload, index) changes what the server runs, and a model folder is code, so without an
entry of its own it answers only requests from loopback addresses; so does the shared-memory group, whose
regions only a client on the same host can share: its routes, and every inference request that names a region
(the data plane asks it then, app/protocol/plane.py). Values are compared in constant time and never appear in
a message, a log line or a repr.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Optional

from .errors import Forbidden

MODEL_REPOSITORY, METADATA, STATISTICS, INFERENCE, HEALTH = (
    "model-repository", "metadata", "statistics", "inference", "health")
SHARED_MEMORY, MODEL_CONFIG, TRACE, LOGGING = "shared-memory", "model-config", "trace", "logging"
# Triton's groups, every one: a restriction may name a group whose routes this server does not implement yet.
GROUPS = (MODEL_REPOSITORY, METADATA, STATISTICS, INFERENCE, HEALTH, SHARED_MEMORY, MODEL_CONFIG, TRACE, LOGGING)
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")  # an HTTP token


@dataclass(frozen=True)
class Restriction:
    """Requests to `groups` must carry `header` with `value` (hidden from repr)."""

    groups: frozenset
    header: str
    value: str = field(repr=False)

    def admits(self, headers) -> bool:
        given = headers.get(self.header)
        return given is not None and hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                                         self.value.encode("utf-8"))


def parse_restricted_api(text) -> tuple[Restriction, ...]:
    """Parse `group[,group...]:header=value[;...]`; raise ValueError naming the problem, never the value."""
    restrictions, seen = [], set()
    for entry in (part.strip() for part in str(text).split(";")):
        if not entry:
            continue
        groups_text, colon, credential = entry.partition(":")
        header, equals, value = credential.partition("=")
        groups = {g.strip() for g in groups_text.split(",") if g.strip()}
        if not colon or not equals or not groups:
            raise ValueError("each entry must be <group>[,<group>...]:<header>=<value>")
        unknown = sorted(groups - set(GROUPS))
        if unknown:
            raise ValueError(f"unknown group {unknown[0][:40]!r}; groups are {', '.join(GROUPS)}")
        if not _HEADER_NAME.match(header.strip()):
            raise ValueError(f"groups {', '.join(sorted(groups))}: the header name must be an HTTP token")
        if not value:
            raise ValueError(f"groups {', '.join(sorted(groups))}: the value must not be empty")
        twice = sorted(groups & seen)
        if twice:
            raise ValueError(f"group {twice[0]} is restricted twice")
        seen |= groups
        restrictions.append(Restriction(frozenset(groups), header.strip().lower(), value))
    return tuple(restrictions)


def is_loopback(address: Optional[str]) -> bool:
    """Whether `address` is a loopback address, an IPv4 one written as IPv6 (::ffff:127.0.0.1) too."""
    try:
        parsed = ipaddress.ip_address((address or "").split("%")[0])
    except ValueError:
        return False
    mapped = getattr(parsed, "ipv4_mapped", None)
    return (mapped or parsed).is_loopback


def group_refusal(group: str, headers, remote_address: Optional[str],
                  restrictions: tuple[Restriction, ...]) -> Optional[Forbidden]:
    """Return why a request to `group` may not run (a Forbidden to raise), or None; `headers` maps lowercase names.

    HTTP asks it with the request's headers, gRPC with the call's metadata, as Triton applies its
    restricted-API check to both.
    """
    for restriction in restrictions:
        if group in restriction.groups:
            if restriction.admits(headers):
                return None
            return Forbidden(f"the {group} routes are restricted: this request lacks the header they require "
                             f"({restriction.header}) or its value is wrong")
    if group == MODEL_REPOSITORY and not is_loopback(remote_address):
        return Forbidden("the model-repository routes (load, unload, index) answer only loopback clients unless "
                         "restricted_api grants them to a header; see SECURITY.md")
    if group == SHARED_MEMORY and not is_loopback(remote_address):
        return Forbidden("shared memory (registering a region, or naming one in an inference request) is for "
                         "loopback clients only unless restricted_api grants the shared-memory group to a header; "
                         "see SECURITY.md")
    return None
