"""The seam between a served model (app.models.served) and its registry (app.models.registry).

One lock, shared on purpose, owned by the registry: `ModelHost.lock`, a threading.Condition. It guards
every field of every ServedModel (its VersionChoice included) together with the registry's own state
(closing, the budget kept for a restart, the preloaded models, the reservation count). It is one lock,
not one per model, because the registry's decisions read several models at once with its own state
(the idle model to evict, the supervisor's tick, the budget a crashed worker keeps for its restart,
/models) and must see them hold still, and because a model's waiters wake on any change, the
registry's close included. The registry creates it; a model takes it one way only, as the host it was
built with hands it over. Nothing slow (starting or stopping a worker, a load, a drain, NVML) runs
under it. Order: this lock first; a worker's, the ledger's, the pool's and a queue's locks may be taken
while it is held, and none of them is held while it is taken.

What each side may call of the other:
- a model, of its registry: only what ModelHost names below;
- the registry, of a model: only its public methods, and its public fields read under the lock; the
  registry never sets them.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Optional, Protocol

if TYPE_CHECKING:
    from ..metrics import ServiceMetrics
    from ..settings import Settings
    from ..supervision import RestartRule
    from .repository import ModelVersion
    from .served import ServedModel
    from .member import Member


class ModelHost(Protocol):
    """What a ServedModel may use of its registry, and nothing else; ModelRegistry is the one host."""

    lock: threading.Condition  # the shared lock above
    closing: bool  # the server is shutting down: no load starts (read under the lock)
    settings: Settings  # the service's settings (request_deadline_s)
    metrics: Optional[ServiceMetrics]
    restart_rule: RestartRule  # when a crashed worker restarts, and when its model is given up

    def start_worker(self, model: ServedModel, version: ModelVersion, evict: bool) -> Member:
        """Reserve the model's budget (evicting idle models if `evict`), start a worker, load `version` in it.

        A member of a worker group loads into its group's worker where one runs; the budget is the group's.

        Called outside the lock, in the thread that loads; raises the load's DetectError.
        """

    def release_kept_budget(self, model: ServedModel) -> None:
        """Give back the budget kept for the model's restart, if one is kept; called under the lock."""
