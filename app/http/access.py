"""Which restricted-API group each HTTP route falls in; the policy itself is app/access.py, shared with gRPC."""

from __future__ import annotations

import re
from typing import Optional

from ..access import (
    HEALTH, INFERENCE, LOGGING, METADATA, MODEL_CONFIG, MODEL_REPOSITORY, SHARED_MEMORY, STATISTICS, TRACE, Restriction,
    group_refusal,
)
from ..errors import Forbidden
from .paths import inference_target

# Paths by group, after the inference routes (paths.inference_target: /detect, /models/<name>/detect, v2 infer,
# v1 predict); whatever matches none is metadata (the page, /models, /gpu, model metadata, /openapi.json).
_GROUP_PATTERNS = (
    (MODEL_REPOSITORY, re.compile(r"^/v2/repository(/|$)")),
    (STATISTICS, re.compile(r"^/metrics$|^/v2/models/stats$|^/v2/models/[^/]+(/versions/[^/]+)?/stats$")),
    (SHARED_MEMORY, re.compile(r"^/v2/(system|cuda)sharedmemory(/|$)")),
    (MODEL_CONFIG, re.compile(r"^/v2/models/[^/]+(/versions/[^/]+)?/config$")),
    (TRACE, re.compile(r"^/v2(/models/[^/]+)?/trace/setting$")),
    (LOGGING, re.compile(r"^/v2/logging$")),
    (HEALTH, re.compile(r"^/(healthz|readyz)$|^/v2/health/(live|ready)$|^/v2/models/[^/]+(/versions/[^/]+)?/ready$")),
)


def route_group(path: str) -> str:
    """Return the restricted-API group a request path belongs to."""
    if inference_target(path) is not None:
        return INFERENCE
    for group, pattern in _GROUP_PATTERNS:
        if pattern.match(path):
            return group
    return METADATA


def refusal(path: str, headers, remote_address: Optional[str],
            restrictions: tuple[Restriction, ...]) -> Optional[Forbidden]:
    """Return why this request may not use its route (a Forbidden to raise), or None if it may."""
    return group_refusal(route_group(path), headers, remote_address, restrictions)
