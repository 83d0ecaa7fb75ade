"""Which answers through the front door count as liveness progress (in process): only generations and
embeddings whose answers prove the server computed, read from a bounded head and tail of the body."""

from __future__ import annotations

import json

import pytest
from llama_guard.front.decoded import HEAD_BYTES, TAIL_BYTES, Witness
from llama_guard.front.endpoints import Work, replayable, work_of


def _decoded(method: str, target: str, body: bytes, chunk: int = 7) -> bool:
    work = work_of(method, target)
    if work is None:
        return False
    witness = Witness(work)
    for i in range(0, len(body), chunk):
        witness.feed(body[i:i + chunk])
    return witness.decoded()


def _completion(predicted: int, content: str = "Hello there") -> bytes:
    timings = {"prompt_n": 4, "prompt_ms": 3.1, "predicted_n": predicted, "predicted_ms": 9.5}
    return json.dumps({"content": content, "tokens_predicted": predicted, "stop": True,
                       "generation_settings": {"n_predict": predicted}, "timings": timings}).encode()


def _chat(predicted: int) -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": "Hi"}}], "object": "chat.completion",
                       "usage": {"completion_tokens": predicted, "prompt_tokens": 9, "total_tokens": 9 + predicted},
                       "timings": {"prompt_n": 9, "predicted_n": predicted}}).encode()


def _stream(tokens: int, chat: bool) -> bytes:
    events = []
    for i in range(tokens):
        events.append({"choices": [{"delta": {"content": f"t{i}"}}]} if chat else {"content": f"t{i}", "stop": False})
    final = ({"choices": [{"delta": {}, "finish_reason": "length"}], "usage": {"completion_tokens": tokens},
              "timings": {"predicted_n": tokens}} if chat
             else {"content": "", "stop": True, "tokens_predicted": tokens, "timings": {"predicted_n": tokens}})
    events.append(final)
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + ("data: [DONE]\n\n" if chat else "")
    return text.encode()


@pytest.mark.parametrize("target", ["/completion", "/completions", "/v1/completions", "/infill"])
def test_a_completion_that_predicted_tokens_is_progress_and_one_that_predicted_none_is_not(target: str) -> None:
    assert _decoded("POST", target, _completion(3))
    assert not _decoded("POST", target, _completion(0))


@pytest.mark.parametrize("target", ["/v1/chat/completions", "/chat/completions"])
def test_a_chat_completion_counts_by_its_usage_and_timings(target: str) -> None:
    assert _decoded("POST", target, _chat(5))
    assert not _decoded("POST", target, _chat(0))


@pytest.mark.parametrize(("target", "chat"), [("/completion", False), ("/v1/chat/completions", True)])
def test_a_stream_counts_by_its_final_event_and_a_long_one_is_read_in_a_bounded_window(target: str,
                                                                                       chat: bool) -> None:
    assert _decoded("POST", target, _stream(3, chat))
    long = _stream(5000, chat)  # far more than the head and the tail together
    assert len(long) > 10 * (HEAD_BYTES + TAIL_BYTES)
    witness = Witness(Work.GENERATION)
    for i in range(0, len(long), 4096):
        witness.feed(long[i:i + 4096])
    assert witness.decoded()
    cut = _stream(5000, chat).rsplit(b"data: {", 1)[0]  # no final event: the count never came
    assert not _decoded("POST", target, cut, 4096)


def test_generated_text_cannot_forge_a_count() -> None:
    # The model was asked to write the key: inside a JSON string the quotes are escaped.
    assert not _decoded("POST", "/completion", _completion(0, content='"predicted_n": 99, "completion_tokens": 7'))
    # A client's echoed setting before the server's own timings: the last count decides.
    echoed = json.dumps({"generation_settings": {"json_schema": {"predicted_n": 5}},
                         "timings": {"predicted_n": 0}}).encode()
    assert not _decoded("POST", "/completion", echoed)


@pytest.mark.parametrize("target", ["/embedding", "/embeddings", "/v1/embeddings"])
def test_an_embedding_counts_by_its_vector(target: str) -> None:
    vector = [0.125 * i - 3 for i in range(2000)]  # longer than the head: only its start is read
    oai = json.dumps({"data": [{"embedding": vector, "index": 0, "object": "embedding"}], "object": "list"})
    native = json.dumps([{"index": 0, "embedding": [vector]}])
    assert _decoded("POST", target, oai.encode()) and _decoded("POST", target, native.encode())
    assert not _decoded("POST", target, json.dumps({"data": [], "object": "list"}).encode())


@pytest.mark.parametrize(("method", "target"), [
    ("GET", "/health"), ("GET", "/v1/models"), ("GET", "/models"), ("GET", "/props"), ("POST", "/props"),
    ("GET", "/slots"), ("POST", "/slots?action=erase"), ("GET", "/metrics"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("POST", "/apply-template"), ("GET", "/completion"), ("PUT", "/completion"),
    ("POST", "/lora-adapters"), ("POST", "/unknown"), ("POST", "/v1/chat/completions/x"),
])
def test_no_other_path_or_method_counts_whatever_its_body_says(method: str, target: str) -> None:
    assert not _decoded(method, target, _completion(7) + _chat(7))


def test_the_query_string_is_not_part_of_the_path() -> None:
    assert work_of("POST", "/completion?x=1") is Work.GENERATION
    assert work_of("POST", "/slots?action=save") is None


@pytest.mark.parametrize(("method", "target", "safe"), [
    ("POST", "/completion", True), ("POST", "/v1/chat/completions", True), ("POST", "/v1/embeddings", True),
    ("POST", "/tokenize", True), ("POST", "/detokenize", True), ("POST", "/apply-template", True),
    ("GET", "/health", True), ("HEAD", "/v1/models", True), ("GET", "/slots", True),
    ("POST", "/slots?action=erase", False), ("POST", "/slots?action=restore", False), ("POST", "/lora-adapters", False),
    ("POST", "/props", False), ("POST", "/unknown", False), ("DELETE", "/completion", False),
    ("PUT", "/completion", False),
])
def test_only_safe_methods_and_inference_posts_are_replayable(method: str, target: str, safe: bool) -> None:
    assert replayable(method, target) is safe
