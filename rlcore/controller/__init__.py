"""Worker groups: how the single controller calls role workers.

`WorkerGroup` is the interface (`wg.method(batch)`, `call`, `call_async`, `shutdown`);
`InProcessWorkerGroup` runs workers in this process (optionally on a thread of their own),
`SubprocessWorkerGroup` one worker in a child process; a Ray backend implements the same interface.
Worker methods declare how their arguments are spread over ranks with `@register(dispatch=...)`.
"""

from rlcore.controller.dispatch import Dispatch, MethodSpec, balanced_partitions, register
from rlcore.controller.errors import WorkerError
from rlcore.controller.group import GroupFuture, RoleView, WorkerGroup
from rlcore.controller.inprocess import InProcessWorkerGroup
from rlcore.controller.ray_backend import RayWorkerGroup, WorkerDiedError, WorkerTimeoutError
from rlcore.controller.ray_placement import ResourcePool
from rlcore.controller.subprocess_group import SubprocessWorkerGroup
from rlcore.controller.worker import ColocatedWorker, Worker

__all__ = [
    "ColocatedWorker",
    "Dispatch",
    "GroupFuture",
    "InProcessWorkerGroup",
    "MethodSpec",
    "RayWorkerGroup",
    "ResourcePool",
    "RoleView",
    "SubprocessWorkerGroup",
    "Worker",
    "WorkerDiedError",
    "WorkerError",
    "WorkerTimeoutError",
    "WorkerGroup",
    "balanced_partitions",
    "register",
]
