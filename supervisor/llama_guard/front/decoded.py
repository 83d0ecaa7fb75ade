"""Whether an answer relayed by the front door proves that llama-server computed: liveness progress.

A 2xx answer alone proves nothing: ``/health``, ``/props``, ``/slots``, ``/metrics`` or ``/v1/models``
answer while a decode is wedged. Only these count (:meth:`Witness.decoded`):

- a generation (completion, chat completion, infill, messages; :data:`~.endpoints.INFERENCE`) whose
  answer says it predicted at least one token. The count is llama-server's own: the last
  ``"predicted_n"`` (its ``timings`` object), ``"completion_tokens"`` (OpenAI ``usage``),
  ``"output_tokens"`` (Anthropic ``usage``) or ``"tokens_predicted"`` in the answer's last
  :data:`TAIL_BYTES` — the end of a JSON answer, or the final event of a stream (the one that carries
  ``timings``, then ``data: [DONE]``). Inside a JSON string every ``"`` is escaped, so generated text
  cannot forge a key: only the server's own keys match.
- an embedding (or rerank) whose answer holds a vector: ``"embedding"`` followed by a number in its
  first :data:`HEAD_BYTES`.

Parsing is bounded: the witness keeps the first :data:`HEAD_BYTES` and the last :data:`TAIL_BYTES` of the
body, never the whole of it. A compressed answer (``Content-Encoding`` other than identity) proves
nothing (the liveness rounds' canary then judges). Shapes: llama.cpp's ``tools/server/server-task.cpp``
(``to_json_non_oaicompat``, ``to_json_oaicompat_chat``, their ``_stream`` forms, ``timings.to_json``)
and ``format_embeddings_response_oaicompat``.
"""

from __future__ import annotations

import re

from llama_guard.front.endpoints import Work

HEAD_BYTES = 4096
TAIL_BYTES = 8192
_COUNT = re.compile(rb'"(?:predicted_n|completion_tokens|output_tokens|tokens_predicted)"\s*:\s*(\d+)')
_VECTOR = re.compile(rb'"embedding"\s*:\s*\[[\s\[]*-?\d')


class Witness:
    """Reads one answer's body as it passes (``feed``), for ``work``; ``decoded`` once it ended."""

    def __init__(self, work: Work) -> None:
        self.work = work
        self._head = bytearray()
        self._tail = bytearray()

    def feed(self, chunk: bytes) -> None:
        """The next bytes of the body (any size; kept: at most HEAD_BYTES + TAIL_BYTES)."""
        if len(self._head) < HEAD_BYTES:
            self._head += chunk[:HEAD_BYTES - len(self._head)]
        if len(chunk) >= TAIL_BYTES:
            self._tail = bytearray(chunk[-TAIL_BYTES:])
        else:
            self._tail += chunk
            del self._tail[:-TAIL_BYTES]

    def decoded(self) -> bool:
        """Whether the whole body proves that the server computed (see the module's rules)."""
        if self.work is Work.EMBEDDING:
            return _VECTOR.search(self._head) is not None
        if self.work is Work.GENERATION:
            counts = _COUNT.findall(self._tail)
            return bool(counts) and int(counts[-1]) > 0
        return False
