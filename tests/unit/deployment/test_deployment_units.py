"""Pure pieces of deployment/: stop-string streaming, the SSE writer/reader pair, request models, errors."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from deployment.ingress.api.detokenize import TextStream
from deployment.ingress.api.errors import validation_message
from deployment.ingress.api.protocol import ChatCompletionRequest, CompletionRequest
from deployment.ingress.sse import SSEDecoder, format_comment, format_event
from workers.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _stream(text: str, stop: list[str]) -> tuple[list[str], str, bool]:
    ts = TextStream(TOK.detokenizer(), stop)
    deltas = [ts.add(t) for t in TOK.encode(text, add_special_tokens=False)]
    if ts.stopped:
        return deltas, "".join(deltas), True
    deltas.append(ts.finish())
    return deltas, "".join(deltas), False


def test_text_stream_without_stop_is_the_decode():
    text = "héllo → wörld 🙂"
    deltas, joined, stopped = _stream(text, [])
    assert joined == text and not stopped
    assert all("\ufffd" not in d for d in deltas), "a split UTF-8 character leaked as U+FFFD"


def test_stop_string_is_cut_and_never_sent():
    deltas, joined, stopped = _stream("one two STOP three", ["STOP"])
    assert stopped and joined == "one two "
    assert not any("S" in d for d in deltas)


def test_text_resembling_a_stop_prefix_is_released_at_the_end():
    _, joined, stopped = _stream("ends with ST", ["STOP"])
    assert not stopped and joined == "ends with ST"


def test_earliest_of_several_stops_wins():
    _, joined, stopped = _stream("abcXYdefZZ", ["ZZ", "XY"])
    assert stopped and joined == "abc"


@given(st.text(alphabet="abcST🙂 ", max_size=40), st.lists(st.text(alphabet="abST", min_size=1, max_size=3),
                                                          max_size=3))
def test_text_stream_matches_reference(text, stops):
    """Generation stops as soon as any stop string is complete (it cannot wait for a longer one that starts
    earlier but might never finish): cut at the earliest stop found in the shortest prefix that has one."""
    _, joined, stopped = _stream(text, stops)
    for n in range(1, len(text) + 1):
        hits = [i for i in (text[:n].find(s) for s in stops) if i != -1]
        if hits:
            assert stopped and joined == text[: min(hits)]
            return
    assert not stopped and joined == text


def test_a_stop_that_completes_first_wins_over_a_longer_one_starting_earlier():
    _, joined, stopped = _stream("TSS", ["S", "TSS"])
    assert stopped and joined == "T"


def test_sse_writer_and_reader_agree():
    payload = json.dumps({"iter": 7, "x": "a\nb"})
    wire = format_comment("keepalive") + format_event(payload, id=7, event="stats") + format_event("two\nlines")
    dec, events = SSEDecoder(), []
    for line in wire.split("\n"):
        ev = dec.feed(line)
        if ev:
            events.append(ev)
    assert [(e.event, e.id, e.data) for e in events] == [("stats", "7", payload), ("message", "7", "two\nlines")]
    assert dec.last_event_id == "7"


def test_sse_reader_handles_crlf_and_no_space():
    dec = SSEDecoder()
    out = [dec.feed(x) for x in ["id:3\r", "data:x\r", "retry: 500", ""]]
    assert out[-1].data == "x" and out[-1].id == "3" and out[-1].retry == 500


def test_completion_request_defaults_and_token_prompt():
    r = CompletionRequest(prompt=[[1, 2, 3]])
    assert r.prompt == [1, 2, 3] and r.max_tokens is None and r.stop_strings == [] and not r.stream
    assert CompletionRequest(prompt="x", stop="END").stop_strings == ["END"]
    assert CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": True}).include_usage


@pytest.mark.parametrize("body", [
    {"prompt": "x", "n": 3}, {"prompt": "x", "logprobs": 2}, {"prompt": "x", "echo": True},
    {"prompt": "x", "best_of": 2}, {"prompt": "x", "presence_penalty": 2.5}, {"prompt": "x", "top_p": 0},
    {"prompt": "x", "stop": [""]}, {"prompt": "x", "stream_options": {"include_usage": True}},
    {"prompt": [True, 1]}, {"prompt": {"path": "/tmp/model"}}, {"prompt": "x", "model_path": "/tmp"},
])
def test_completion_request_rejects(body):
    with pytest.raises(ValidationError) as exc:
        CompletionRequest(**body)
    message, _, _ = validation_message(exc.value.errors())
    assert message and "Value error," not in message


CHAT = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(("model", "body", "field"), [
    (CompletionRequest, {"max_tokens": True}, "max_tokens"), (CompletionRequest, {"max_tokens": "3"}, "max_tokens"),
    (CompletionRequest, {"max_tokens": 2.0}, "max_tokens"), (CompletionRequest, {"temperature": "0.5"}, "temperature"),
    (CompletionRequest, {"temperature": True}, "temperature"), (CompletionRequest, {"top_p": "1"}, "top_p"),
    (CompletionRequest, {"top_k": True}, "top_k"), (CompletionRequest, {"seed": True}, "seed"),
    (CompletionRequest, {"stream": "yes"}, "stream"), (CompletionRequest, {"ignore_eos": 1}, "ignore_eos"),
    (CompletionRequest, {"n": True}, "n"), (CompletionRequest, {"stop": 5}, "stop"),
    (CompletionRequest, {"stop": ["a", 1]}, "stop"), (CompletionRequest, {"logprobs": True}, "logprobs"),
    (CompletionRequest, {"echo": 0}, "echo"), (CompletionRequest, {"cache_salt": 5}, "cache_salt"),
    (CompletionRequest, {"best_of": "1"}, "best_of"), (CompletionRequest, {"user": 1}, "user"),
    (CompletionRequest, {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages.0.name"),
    (ChatCompletionRequest, {"messages": CHAT, "logprobs": 0}, "logprobs"),
    (ChatCompletionRequest, {"messages": CHAT, "top_logprobs": False}, "top_logprobs"),
    (ChatCompletionRequest, {"messages": CHAT, "max_completion_tokens": "2"}, "max_completion_tokens"),
    (ChatCompletionRequest, {"messages": CHAT, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_wrong_json_types_are_refused_not_coerced(model, body, field):
    body = body if model is ChatCompletionRequest else {"prompt": "x", **body}
    with pytest.raises(ValidationError) as exc:
        model(**body)
    message, param, _ = validation_message(exc.value.errors())
    assert param == field and message.startswith(field + ":"), message


def test_integers_are_taken_as_numbers_and_empty_prompts_have_the_engines_code():
    r = CompletionRequest(prompt="x", temperature=1, top_p=1, presence_penalty=0)
    assert r.temperature == 1.0 and isinstance(r.temperature, float)
    for empty in ("", [], [""], [[]]):
        with pytest.raises(ValidationError) as exc:
            CompletionRequest(prompt=empty)
        assert validation_message(exc.value.errors())[1:] == ("prompt", "empty_prompt")


def test_chat_request_text_parts_and_token_alias():
    r = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}],
                              max_completion_tokens=5)
    assert r.chat_messages() == [{"role": "user", "content": "ab"}] and r.max_tokens == 5
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_validation_message_names_the_field():
    with pytest.raises(ValidationError) as exc:
        CompletionRequest(prompt="x", max_tokens=-4)
    message, param, code = validation_message(exc.value.errors())
    assert param == "max_tokens" and "max_tokens" in message and code == "greater_than_equal"


def test_error_handlers_shape_unexpected_and_actor_failures():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from ray.exceptions import RayActorError

    from deployment.ingress.api.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/bug")
    async def bug():
        raise KeyError("x")

    @app.get("/down")
    async def down():
        raise RayActorError()

    c = TestClient(app, raise_server_exceptions=False)
    r = c.get("/bug")
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    r = c.get("/down")
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
    r = c.post("/bug")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
