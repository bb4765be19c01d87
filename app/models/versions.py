"""Which version of a model to load: the newest on disk, less those that failed as their folders are now.

A version that fails to load is remembered with its folder's fingerprint and not tried again until the
folder changes; a new version is offered only once its folder has stopped changing between two polls
(a copy in progress is not loaded half-written). Not thread-safe: its ServedModel calls it under the
registry's lock, as it does for the rest of its state.
"""

from __future__ import annotations

from typing import Optional

from .repository import ModelSource, ModelVersion, fingerprint


class VersionChoice:
    """One model's choice of version: what to load, what is new, what failed."""

    def __init__(self, source: ModelSource):
        self.source = source
        self._failed: dict[str, tuple[tuple, str]] = {}  # version -> (fingerprint, reason)
        self._seen: dict[str, tuple] = {}  # version -> fingerprint at the last poll

    def to_load(self) -> Optional[ModelVersion]:
        """Return the newest version on disk that has not failed to load as it is now.

        A corrupt version that failed to take over keeps failing while its folder is unchanged: a model
        unloaded since (idle, evicted) loads the newest good one instead. If every version failed, the latest.
        """
        versions = self.source.versions()
        for version in reversed(versions):
            failed = self._failed.get(version.version)
            if failed is None or failed[0] != fingerprint(version.path):
                return version
        return versions[-1] if versions else None

    def settled_latest(self, serving: Optional[str]) -> Optional[ModelVersion]:
        """Return the latest version on disk unless it is `serving`, once its folder has stopped changing.

        A version that failed to load is not offered again while its folder is unchanged.
        """
        latest = self.source.latest()
        if latest is None or latest.version == serving:
            return None
        now_print = fingerprint(latest.path)
        settled = self._seen.get(latest.version) == now_print
        self._seen = {latest.version: now_print}
        failed = self._failed.get(latest.version)
        if not settled or (failed is not None and failed[0] == now_print):
            return None
        return latest

    def failed(self, version: ModelVersion, reason: str) -> None:
        """Remember that `version` failed to load, as its folder is now."""
        self._failed[version.version] = (fingerprint(version.path), reason)

    def loaded(self, version: ModelVersion) -> None:
        """Forget a failure of `version`: it loaded."""
        self._failed.pop(version.version, None)

    def failure(self, number: str) -> Optional[str]:
        """Return why version `number` failed to load, or None if it has not."""
        failed = self._failed.get(number)
        return failed[1] if failed is not None else None
