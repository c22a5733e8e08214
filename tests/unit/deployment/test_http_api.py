"""The OpenAI routes over a fake engine, served by real uvicorn (no Ray).

Covers the request checks (every bad input is a 4xx in OpenAI's shape, followed by a request that still
works), generation with stop strings and streaming, clean engine errors, and that a client that goes away
aborts its engine request.
"""

import json
import time
import types
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from deployment.ingress.api.protocol import MAX_CACHE_SALT_CHARS, SamplingRequest
from deployment.ingress.api.routes import create_api
from deployment.ingress.sse import SSEDecoder
from deployment.ingress.stats.mirror import StatsMirror
from deployment.settings import Settings
from tests.support.http_support import REPLY, FakeEngine, FakeStats, _assert_openai_error


def test_completion(http):
    r = http.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == REPLY[:5]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}  # BOS + "hi"


def test_completion_token_ids_and_default_max_tokens(http):
    r = http.post("/v1/completions", json={"prompt": [104, 105]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8  # max_tokens_default


def test_eos_is_not_text(http):
    r = http.post("/v1/completions", json={"prompt": "EOS", "max_tokens": 50})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == REPLY


def test_stop_string_cuts_text_and_aborts_engine_request(server, http):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "stop": ["is w"]})
    body = r.json()
    assert body["choices"][0] == {"index": 0, "text": "The cache ", "logprobs": None, "finish_reason": "stop"}
    assert body["id"].removeprefix("cmpl-") and any(rid == body["id"] for rid in server.engine.aborted)


def test_chat_completion(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                "max_completion_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY[:3]}
    assert body["usage"]["prompt_tokens"] == 1 + len("<|user|>\nhi\n<|assistant|>\n")


def _sse_data(text: str) -> list[str]:
    dec, out = SSEDecoder(), []
    for line in text.split("\n"):
        ev = dec.feed(line)
        if ev is not None:
            out.append(ev.data)
    return out


def test_streaming_completion_and_chat(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 6, "stream": True,
                                           "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    data = _sse_data(r.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == REPLY[:6]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6

    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 4, "stream": True})
    chunks = [json.loads(d) for d in _sse_data(r.text)[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == REPLY[:4]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_response_is_created_at_its_request_and_the_model_at_start(monkeypatch):
    clock = types.SimpleNamespace(time=lambda: 1_796_000_000.0)
    monkeypatch.setattr("deployment.ingress.api.generation.time", clock)
    api = create_api(FakeEngine(), StatsMirror(FakeStats()), Settings(model="random", served_model_name="m"))
    clock.time = lambda: 1_796_003_600.0  # the server has run an hour
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    with TestClient(api) as c:
        streamed = [json.loads(d) for d in _sse_data(c.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}).text)[:-1]]
        streamed += [json.loads(d) for d in _sse_data(c.post("/v1/chat/completions", json={
            **chat, "stream": True}).text)[:-1]]
        whole = [c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json(),
                 c.post("/v1/chat/completions", json=chat).json()]
        model = c.get("/v1/models").json()["data"][0]
    assert {r["created"] for r in streamed + whole} == {1_796_003_600}
    assert model["created"] == 1_796_000_000


def test_models(http):
    body = http.get("/v1/models").json()
    assert [m["id"] for m in body["data"]] == ["fake-model"]


BAD_INPUTS = [
    ("invalid json", "/v1/completions", b'{"prompt": "hi", ', 400, "invalid_json"),
    ("not an object", "/v1/completions", b'[1, 2]', 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "missing"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "empty_prompt"),
    ("empty token list", "/v1/completions", {"prompt": []}, 400, "empty_prompt"),
    ("bool max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "int_type"),
    ("numeric string max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": "3"}, 400, "int_type"),
    ("string temperature", "/v1/completions", {"prompt": "hi", "temperature": "0.5"}, 400, "float_type"),
    ("string stream", "/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "bool_type"),
    ("bool seed", "/v1/completions", {"prompt": "hi", "seed": True}, 400, "int_type"),
    ("chat numeric content", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "string_type"),
    ("batched prompt", "/v1/completions", {"prompt": ["a", "b"]}, 400, None),
    ("negative token id", "/v1/completions", {"prompt": [1, -3]}, 400, None),
    ("token id outside vocab", "/v1/completions", {"prompt": [1, 9999]}, 400, "invalid_token_id"),
    ("engine validation", "/v1/completions", {"prompt": "REJECT me"}, 400, "engine_rejected"),
    ("prompt too long", "/v1/completions", {"prompt": "x" * 200}, 400, "context_length_exceeded"),
    ("prompt fills the context", "/v1/completions", {"prompt": "x" * 128}, 400, "context_length_exceeded"),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, None),
    ("zero max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, None),
    ("absurd max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 10**15}, 400,
     "context_length_exceeded"),
    ("string max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, None),
    ("unknown model", "/v1/completions", {"prompt": "hi", "model": "/etc/passwd"}, 404, "model_not_found"),
    ("n > 1", "/v1/completions", {"prompt": "hi", "n": 2}, 400, None),
    ("unknown field", "/v1/completions", {"prompt": "hi", "modle_path": "x"}, 400, None),
    ("temperature out of range", "/v1/completions", {"prompt": "hi", "temperature": 9}, 400, None),
    ("five stop strings", "/v1/completions", {"prompt": "hi", "stop": list("abcde")}, 400, None),
    ("chat without messages", "/v1/chat/completions", {"messages": []}, 400, None),
    ("chat bad role", "/v1/chat/completions", {"messages": [{"role": "god", "content": "x"}]}, 400, None),
    ("chat unknown model", "/v1/chat/completions",
     {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model_not_found"),
    ("prompt lone surrogate", "/v1/completions", b'{"prompt": "hi \\udfff"}', 400, None),
    ("model lone surrogate", "/v1/completions", b'{"prompt": "hi", "model": "\\udfff"}', 400, None),
    ("field named with a lone surrogate", "/v1/completions", b'{"prompt": "hi", "\\udfff": 1}', 400, None),
    ("stop lone surrogate", "/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"]}', 400, None),
    ("chat content lone surrogate", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}', 400, None),
    ("repetition_penalty 0", "/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, None),
    ("presence_penalty out of range", "/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, None),
    ("min_p above 1", "/v1/completions", {"prompt": "hi", "min_p": 1.5}, 400, None),
    ("min_tokens above max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400,
     "invalid_sampling_params"),
    ("beam search", "/v1/completions", {"prompt": "hi", "use_beam_search": True}, 400, None),
    ("special tokens as text", "/v1/completions", {"prompt": "hi", "skip_special_tokens": False}, 400, None),
    ("negative stop token id", "/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, None),
    ("chat max tokens disagree", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 3}, 400, None),
]


@pytest.mark.parametrize("name,path,body,status,code", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_generation_input_is_4xx_then_service_continues(server, http, name, path, body, status, code):
    started = len(server.engine.started)
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    err = _assert_openai_error(r, status, code)
    assert err["type"] in ("invalid_request_error", "not_found_error")
    assert len(server.engine.started) == started, "a bad request reached the engine"
    ok = http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == REPLY[:2]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
])
def test_cache_salt_longer_than_the_limit_is_a_400_naming_it(server, http, path, body):
    """Each distinct salt costs every rank a root keyed by the salt while its blocks are cached: a salt of any
    length let one client pin arbitrarily large strings in the ranks."""
    started = len(server.engine.started)
    err = _assert_openai_error(http.post(path, json={**body, "cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)}),
                               400, "string_too_long")
    assert err["param"] == "cache_salt" and "cache_salt" in err["message"]
    assert len(server.engine.started) == started, "a bad request reached the engine"
    ok = http.post(path, json={**body, "cache_salt": "s" * MAX_CACHE_SALT_CHARS})
    assert ok.status_code == 200, ok.text
    assert server.engine.salts[-1] == "s" * MAX_CACHE_SALT_CHARS


def test_the_cache_salt_limit_is_documented():
    doc = (Path(__file__).resolve().parents[3] / "docs" / "http-api.md").read_text()
    assert f"a string of 1 to {MAX_CACHE_SALT_CHARS} characters" in doc
    assert f"1 to {MAX_CACHE_SALT_CHARS} characters" in SamplingRequest.model_fields["cache_salt"].description


def test_integers_are_numbers(http):
    """Strict types still take a JSON integer where a number is expected, as OpenAI does."""
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 1, "top_p": 1,
                                           "presence_penalty": 0})
    assert r.status_code == 200, r.text


def test_models_advertise_the_limit_the_routes_enforce(http):
    (model,) = http.get("/v1/models").json()["data"]
    limit = model["max_model_len"]
    ok = http.post("/v1/completions", json={"prompt": [65] * (limit - 4), "max_tokens": 4})
    assert ok.status_code == 200, ok.text
    _assert_openai_error(http.post("/v1/completions", json={"prompt": [65] * (limit - 4), "max_tokens": 5}),
                         400, "context_length_exceeded")


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failures_are_clean_errors(http, stream):
    """A down group is 503 engine_unavailable, a failed request 500 request_failed: one line, no colour
    codes or traceback; in-band as an SSE error event once a stream has started."""
    expected = {"DOWN": (503, "engine_unavailable"), "FAIL": (500, "request_failed")}
    for word, (status, code) in expected.items():
        body = {"prompt": f"{word} now", "max_tokens": 5, "stream": stream}
        if not stream:
            err = _assert_openai_error(http.post("/v1/completions", json=body), status, code)
        else:
            with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                dec, events = SSEDecoder(), []
                for line in resp.iter_lines():
                    ev = dec.feed(line)
                    if ev is not None:
                        events.append(ev.data)
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert err["code"] == code
        assert "\x1b" not in err["message"] and "Traceback" not in err["message"], err
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_disconnect_aborts_non_streaming_request(server):
    started = len(server.engine.started)
    with httpx.Client(base_url=server.url, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json={"prompt": "SLOW", "max_tokens": 100})
    rid = server.engine.started[started]
    deadline = time.monotonic() + 10
    while rid not in server.engine.aborted:
        assert time.monotonic() < deadline, "the engine request was not aborted after the client left"
        time.sleep(0.02)
    assert rid not in server.engine.finished


def test_disconnect_aborts_streaming_request(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        with c.stream("POST", "/v1/completions",
                      json={"prompt": "SLOW", "max_tokens": 100, "stream": True}) as resp:
            dec = SSEDecoder()
            for line in resp.iter_lines():
                ev = dec.feed(line)
                if ev is not None:
                    rid = json.loads(ev.data)["id"]
                    break
    deadline = time.monotonic() + 10
    while rid not in server.engine.aborted:
        assert time.monotonic() < deadline, "the engine request was not aborted after the client left"
        time.sleep(0.02)
    assert rid not in server.engine.finished


def test_what_vllms_benchmark_clients_send_is_taken_and_reaches_the_engine(server, http):
    """`vllm bench serve --backend openai` sends repetition_penalty 1.0 (it once got 400 for every request);
    vLLM's other sampling extensions are implemented, so their values reach the engine as sent."""
    r = http.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 4, "logprobs": None,
                                           "repetition_penalty": 1.0, "ignore_eos": True, "temperature": 0.0,
                                           "top_p": 1.0, "top_k": -1, "min_p": 0.0, "best_of": 1})
    assert r.status_code == 200, r.text
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4, "repetition_penalty": 1.3,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "min_p": 0.1, "min_tokens": 2,
            "stop_token_ids": [7], "skip_special_tokens": True, "use_beam_search": False}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    p = server.engine.params[-1]
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_p, p.min_tokens,
            p.stop_token_ids) == (1.3, 0.5, -0.5, 0.1, 2, (7,))


def test_a_wrong_sampling_value_names_its_field(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "min_tokens": 3})
    assert _assert_openai_error(r, 400, "invalid_sampling_params")["param"] == "min_tokens"


def test_a_streamed_chat_sends_nothing_before_its_first_token(server):
    """The role chunk goes out with the first token (as vLLM's), not at admission: tools time TTFT from the
    first chunk. The engine holds its first token; no line of the stream may arrive meanwhile."""
    import threading

    eng = server.engine
    eng.hold.clear()
    body = {"messages": [{"role": "user", "content": "HOLD"}], "max_tokens": 2, "stream": True}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c, c.stream("POST", "/v1/chat/completions",
                                                                          json=body) as resp:
            assert resp.status_code == 200  # admitted: the status is sent before any chunk
            lines = (line for line in resp.iter_lines() if line)
            got: list[str] = []
            reader = threading.Thread(target=lambda: got.append(next(lines)))
            reader.start()
            reader.join(0.5)  # nothing may come while the engine holds the first token
            assert not got, got
            eng.hold.set()
            reader.join(30)
            first = json.loads(got[0].removeprefix("data: "))
            assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            rest = [line for line in lines]
            assert rest[-1] == "data: [DONE]"
    finally:
        eng.hold.set()


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats (GuideLLM sends it on every streamed request)."""
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_completion_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "stop": None, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    used = [ch["usage"]["completion_tokens"] for ch in chunks]
    assert used == sorted(used) and used[-1] == 3 and all("usage" in ch for ch in chunks)
    assert chunks[0]["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] > 0
