"""What may lead to a GPU reset: the values of ``[recovery].reset_on`` and the policy's triggers
(``gpu_reset``'s ``trigger``). The one definition, for the configuration and the policy."""

from __future__ import annotations

import enum


class ResetTrigger(str, enum.Enum):
    """What may lead to a GPU reset (``[recovery].reset_on``)."""

    GPU_LOST = "gpu_lost"
    XID = "xid"
    OOM = "oom"
    CUDA_ERROR = "cuda_error"

    def __str__(self) -> str:
        return self.value
