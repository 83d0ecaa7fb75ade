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

The same kept bytes give :meth:`Witness.reuse`: the answer's ``timings.cache_n`` and ``prompt_n``
(the last of each in the tail) and ``"id_slot"`` (native answers; the first in the head, else the last
in the tail), with which the slots watcher checks a restored slot's first client request.

Parsing is bounded: the witness keeps the first :data:`HEAD_BYTES` and the last :data:`TAIL_BYTES` of the
body, never the whole of it. A compressed answer (``Content-Encoding`` other than identity) proves
nothing (the liveness rounds' canary then judges). Shapes: llama.cpp's ``tools/server/server-task.cpp``
(``to_json_non_oaicompat``, ``to_json_oaicompat_chat``, their ``_stream`` forms, ``timings.to_json``)
and ``format_embeddings_response_oaicompat``.
"""

from __future__ import annotations

import re

from llama_guard.core.inputs import CacheReuse
from llama_guard.front.endpoints import Work

HEAD_BYTES = 4096
TAIL_BYTES = 8192
_COUNT = re.compile(rb'"(?:predicted_n|completion_tokens|output_tokens|tokens_predicted)"\s*:\s*(\d+)')
_VECTOR = re.compile(rb'"embedding"\s*:\s*\[[\s\[]*-?\d')
_CACHE_N = re.compile(rb'"cache_n"\s*:\s*(\d+)')
_PROMPT_N = re.compile(rb'"prompt_n"\s*:\s*(\d+)')
_ID_SLOT = re.compile(rb'"id_slot"\s*:\s*(\d+)')


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

    def reuse(self) -> CacheReuse | None:
        """A generation's ``timings.cache_n``/``prompt_n`` and its ``id_slot`` (None when the answer
        has no timings in its tail)."""
        if self.work is not Work.GENERATION:
            return None
        cache_n, prompt_n = _CACHE_N.findall(self._tail), _PROMPT_N.findall(self._tail)
        if not cache_n or not prompt_n:
            return None
        head = _ID_SLOT.search(self._head)
        slots = [head.group(1)] if head is not None else _ID_SLOT.findall(self._tail)
        return CacheReuse(int(cache_n[-1]), int(prompt_n[-1]), int(slots[-1]) if slots else None)
