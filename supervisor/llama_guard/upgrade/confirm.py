"""Client 5xx answered by a build on probation, confirmed (or not) with llama-guard's own requests.

Every ``[front].hold_after_errors`` such answers (in a row or not: mixed traffic must not hide a broken
endpoint) are checked with llama-guard's own short requests
(:data:`~llama_guard.core.own_requests.OWN_REQUESTS`), never judged by themselves: a client's input that
the server rejects with 500 (an out-of-range token to ``/detokenize``, an image to a text model) would fail
the last good build too. One of llama-guard's requests failing as well marks the build failed and asks for
a drained restart, whose start rolls back to the last good build; all answered 2xx:
``upgrade_errors_not_confirmed``, the build stays. A proven build's 5xx stay the policy's business
(``server_http_errors``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llama_guard.core.client import RequestFailed, ServerClient
from llama_guard.core.own_requests import OWN_REQUESTS, own_requests_failure
from llama_guard.host.build import Build
from llama_guard.model.inputs import RestartRequest, UpstreamError
from llama_guard.model.types import RestartCause
from llama_guard.model.watcher import Context
from llama_guard.upgrade.lineage import Lineage


@dataclass(frozen=True)
class Confirm:
    """Confirm (or not) with llama-guard's own requests the client 5xx answered by server ``pid`` of
    ``build`` on probation: ``errors`` of them, the last ``status``, the last at ``at`` (monotonic s)."""

    build: Build
    pid: int
    errors: int
    status: int
    at: float


class ProbationErrors:
    """The client 5xx of the build on probation since the last confirmation, and the confirmation."""

    def __init__(self) -> None:
        self._count = 0
        self._confirming = False  # a Confirm is queued or running

    def reset(self) -> None:
        """A new build is on probation: its count starts from none."""
        self._count = 0

    def count(self, build: Build, error: UpstreamError, runs: int, at: float) -> Confirm | None:
        """One more client 5xx (``error``, at ``at``) by ``build`` on probation; the confirmation to run
        once ``runs`` (``[front].hold_after_errors``) came and none is under way, else None."""
        self._count += 1
        if self._count < runs or self._confirming:
            return None
        self._count, self._confirming = 0, True
        return Confirm(build, error.pid, runs, error.status, at)

    async def confirm(self, ctx: Context, job: Confirm, lineage: Lineage, ready_pid: Callable[[], int | None]) -> None:
        """Send llama-guard's own requests to the server of ``job`` (see the module docstring). No complete
        answer in time: no verdict (a server that does not answer is the liveness watch's to judge); the
        server gone (``ready_pid()`` another) or the build judged meanwhile: none either."""
        try:
            async with ServerClient(ctx.config.server.base_url, ctx.get_api_key) as client:
                failure = await own_requests_failure(client, ctx.config.upgrade.trial_timeout_s)
        except RequestFailed:
            return
        finally:
            self._confirming = False
        if job.pid != ready_pid() or not lineage.on_probation(job.build):
            return
        into = job.at - (lineage.since or job.at)
        errors = (f"{job.errors} client requests with HTTP 5xx (the last {job.status}) {into:.0f} s into its "
                  "probation ([front].hold_after_errors)")
        if not failure:
            ctx.emit("upgrade_errors_not_confirmed", build=job.build.short, errors=job.errors, status=job.status,
                     endpoints=", ".join(path for path, _ in OWN_REQUESTS))
            return
        cause = f"llama-server {job.build.short} answered {errors}, and llama-guard's own request too: {failure}"
        lineage.serving_failed(cause)
        ctx.post(RestartRequest(cause, cause=RestartCause.TRIAL))
