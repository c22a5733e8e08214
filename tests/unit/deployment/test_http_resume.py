"""A streamed completion cut anywhere resumes with `Last-Event-ID` on any ingress replica: the same body POSTed
again gets exactly the chunks after the last one read, under the first response's id, sampled with its seed
(deployment/ingress/resume.py). Over a fake engine and the real routes under uvicorn (no Ray)."""

import json

import pytest

from deployment.ingress.sse import SSEDecoder

COMPLETION = {"prompt": "hi", "max_tokens": 7, "stream": True,
              "stream_options": {"include_usage": True, "resumable": True}, "temperature": 0.9}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
        "stream_options": {"resumable": True}, "temperature": 0}
ROUTES = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]


def _events(resp) -> list[tuple[str | None, str]]:
    assert resp.status_code == 200, resp.text
    dec, out = SSEDecoder(), []
    for line in resp.text.split("\n"):
        ev = dec.feed(line)
        if ev is not None:
            out.append((ev.id, ev.data))
    return out


def _post(http, path: str, body: dict, last_id: str | None = None):
    return http.post(path, json=body, headers={"Last-Event-ID": last_id} if last_id else {})


@pytest.mark.parametrize(("path", "body"), ROUTES, ids=["completions", "chat"])
def test_a_stream_cut_after_any_event_resumes_with_exactly_the_rest(http, server, path, body):
    full = _events(_post(http, path, body))
    assert full[-1][1] == "[DONE]" and all(i is not None for i, _ in full[:-1])
    assert len({i for i, _ in full[:-1]}) == len(full) - 1  # every chunk its own id
    first_seed = server.engine.seeds[-1]
    for cut in range(len(full) - 1):
        rest = _events(_post(http, path, body, full[cut][0]))
        # the same ids, the same chunks (response id and created included), then [DONE]
        assert rest[:-1] == full[cut + 1:-1] and rest[-1][1] == "[DONE]", cut
        assert server.engine.seeds[-1] == first_seed  # the resumed request sampled with the first one's seed
    if body["temperature"]:
        assert first_seed is not None  # picked by the route, so the ids can carry it


def test_a_sampled_request_without_a_seed_gets_its_own_seed_each_time(http, server):
    _post(http, "/v1/completions", COMPLETION)
    _post(http, "/v1/completions", COMPLETION)
    assert server.engine.seeds[-1] != server.engine.seeds[-2]


@pytest.mark.parametrize("bad", ["7", "cmpl-xyz.1.2.abcdefabcdef.3.0a0b0c0d", "x" * 500])
def test_a_last_event_id_that_names_no_stream_is_a_400(http, bad):
    r = _post(http, "/v1/completions", COMPLETION, bad)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_last_event_id", r.text
    assert _post(http, "/v1/completions", COMPLETION).status_code == 200  # and nothing is broken


def test_resuming_with_another_body_another_route_or_another_seed_is_a_400(http):
    full = _events(_post(http, "/v1/completions", {**COMPLETION, "seed": 5}))
    last = full[2][0]
    for path, body in [("/v1/completions", {**COMPLETION, "seed": 5, "prompt": "ho"}),
                       ("/v1/completions", {**COMPLETION, "seed": 6}),
                       ("/v1/completions", {**COMPLETION, "seed": 5, "max_tokens": 8}),
                       ("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 7, "seed": 5, "temperature": 0.9})]:
        r = _post(http, path, body, last)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_last_event_id", (body, r.text)
    rest = _events(_post(http, "/v1/completions", {**COMPLETION, "seed": 5}, last))
    assert [d for _, d in rest] == [d for _, d in full[3:]]
    # the seed may be left out of the body: the id carries it
    assert [d for _, d in _events(_post(http, "/v1/completions", COMPLETION, last))] == [d for _, d in full[3:]]


def test_a_resumed_stream_that_makes_other_chunks_ends_with_an_error_instead_of_splicing(http):
    """The id chains a hash of the chunks up to it: an engine that drew other tokens this time (here: an id whose
    hash is not of these chunks) makes the resumed stream end with an in-band error, not another answer's tail."""
    full = _events(_post(http, "/v1/completions", COMPLETION))
    last = full[2][0]
    forged = last[:-8] + ("0" * 8 if not last.endswith("0" * 8) else "1" * 8)
    rest = _events(_post(http, "/v1/completions", COMPLETION, forged))
    assert len(rest) == 2 and rest[-1][1] == "[DONE]"
    assert json.loads(rest[0][1])["error"]["code"] == "stream_diverged"
    beyond = ".".join(last.split(".")[:4] + [str(len(full) + 5), last.split(".")[5]])  # past this stream's end
    rest = _events(_post(http, "/v1/completions", COMPLETION, beyond))
    assert json.loads(rest[0][1])["error"]["code"] == "stream_diverged"


def test_the_chunks_of_a_resumed_stream_carry_the_first_response_id(http):
    full = _events(_post(http, "/v1/completions", COMPLETION))
    rest = _events(_post(http, "/v1/completions", COMPLETION, full[0][0]))
    ids = {json.loads(d)["id"] for _, d in full[:-1] + rest[:-1]}
    assert len(ids) == 1


def test_stream_completion_resumes_a_cut_stream_and_retries_a_refusal(server):
    """The client's side: a 500 before any response (Serve's proxy, when the ingress replica it routed to
    died), then a stream cut after 3 chunks: the client retries, resumes with Last-Event-ID, and reads the
    chunks of one uncut stream."""
    import httpx

    from deployment.clients.client import stream_completion

    body = {**COMPLETION, "seed": 11}
    with httpx.Client(base_url=server.url, timeout=10) as real:
        expected = [json.loads(d) for _, d in _events(real.post("/v1/completions", json=body))[:-1]]
        calls: list[str | None] = []

        def handler(request: httpx.Request) -> httpx.Response:
            calls.append(request.headers.get("last-event-id"))
            if len(calls) == 1:
                return httpx.Response(500, text="Internal Server Error")
            resp = real.send(real.build_request("POST", "/v1/completions", content=request.content,
                                                headers=dict(request.headers)), stream=True)
            if len(calls) == 3:
                return httpx.Response(resp.status_code, headers=resp.headers, stream=httpx.ByteStream(resp.read()))

            def cut():  # the first 3 events, then the connection breaks
                events = resp.read().split(b"\n\n")
                yield b"\n\n".join(events[:3]) + b"\n\n"
                raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

            return httpx.Response(200, headers=resp.headers, stream=_Iter(cut()))

        got = stream_completion(server.url, body, transport=httpx.MockTransport(handler))
    assert [c["choices"] for c in got.chunks] == [c["choices"] for c in expected]
    assert len({c["id"] for c in got.chunks}) == 1 and got.retried == 1 and got.resumed == 1
    assert got.text == "".join(c["choices"][0]["text"] for c in expected if c["choices"])
    assert calls[0] is None and calls[1] is None and calls[2].split(".")[4] == "2"  # resumed after chunk 2


class _Iter(__import__("httpx").SyncByteStream):
    def __init__(self, it) -> None:
        self._it = it

    def __iter__(self):
        yield from self._it


def test_a_plain_stream_has_only_data_lines_as_line_based_readers_expect(http):
    """vLLM's and SGLang's serving benchmarks strip "data: " from every line and parse the rest: ids only for
    those who ask (stream_options.resumable), and a Last-Event-ID without it is a 400."""
    plain = {**COMPLETION, "stream_options": {"include_usage": True}}
    text = http.post("/v1/completions", json=plain).text
    assert all(line.startswith("data: ") for line in text.split("\n") if line), text
    r = _post(http, "/v1/completions", plain, _events(_post(http, "/v1/completions", COMPLETION))[1][0])
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_last_event_id"


def test_a_long_resume_says_it_is_alive_while_it_makes_again_what_the_client_has(http, monkeypatch):
    from deployment.ingress.api import generation

    monkeypatch.setattr(generation, "RESUME_COMMENT_S", 0.0)
    full = _events(_post(http, "/v1/completions", COMPLETION))
    resp = _post(http, "/v1/completions", COMPLETION, full[4][0])
    assert resp.text.count(": resuming") == 5  # chunks 0-4 (the last one read) made again
    assert _events(resp)[:-1] == full[5:-1]


def test_stream_completion_will_not_splice_a_cut_stream_it_cannot_resume_and_retries_a_429():
    """A server that sends no event ids (an older one): a cut after chunks is an error, not a second answer
    appended to the first; a 429 before any response is retried as OpenAI's client does."""
    import httpx

    from deployment.clients.client import StreamError, stream_completion

    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        if len(calls) == 1:
            return httpx.Response(429, headers={"retry-after": "0"}, json={"error": {"message": "busy"}})

        def cut():
            yield b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'
            raise httpx.RemoteProtocolError("peer closed connection")

        return httpx.Response(200, stream=_Iter(cut()))

    with pytest.raises(StreamError) as err:
        stream_completion("http://x", {"prompt": "hi"}, transport=httpx.MockTransport(handler))
    assert err.value.code == "not_resumable" and len(err.value.streamed.chunks) == 1 and len(calls) == 2
    assert calls[0]["stream_options"] == {"resumable": True} and calls[0]["stream"] is True
