"""Replaying a Mooncake-format trace (deployment/clients/trace.py): prompts from hash ids, scaling, the oracle's
hit rate, the replay's per-request figures over a fake server, and bad input."""

import asyncio
import json

import httpx
import pytest

from deployment.clients.loadgen import main as loadgen
from deployment.clients.trace import (
    Replay,
    Result,
    TraceRequest,
    block_text,
    percentile,
    read_trace,
    replay,
    scaled_length,
    summary,
)


def write(tmp_path, rows) -> str:
    f = tmp_path / "trace.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(f)


ROWS = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 80, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 1500, "output_length": 8, "hash_ids": [0, 1, 3]},
    {"timestamp": 4000, "input_length": 600, "output_length": 1, "hash_ids": [4, 5]},
]


def test_prompts_share_exactly_as_far_as_their_ids_agree(tmp_path):
    reqs = read_trace(write(tmp_path, ROWS), scale=0.125)  # a trace block is 64 tokens
    a, b, c = reqs
    assert [len(r.prompt) for r in reqs] == [138, 188, 75]
    assert [r.max_tokens for r in reqs] == [10, 1, 1]
    assert [r.at_s for r in reqs] == [0.0, 0.5, 3.0]  # from the first request, in seconds
    assert a.prompt[:128] == b.prompt[:128] == block_text(0, 64) + block_text(1, 64)
    assert a.prompt[128:131] != b.prompt[128:131]
    assert not c.prompt.startswith(block_text(0, 64)[:8])
    assert all(33 <= ord(ch) < 127 or ch == " " for ch in a.prompt)
    assert read_trace(write(tmp_path, ROWS), scale=0.125) == reqs  # the same id, the same text, every time
    assert len(read_trace(write(tmp_path, ROWS), limit=2)) == 2


@pytest.mark.parametrize("line,why", [("{\"timestamp\": 0}", "not a Mooncake trace line"),
                                      ("[1, 2]", "not a Mooncake trace line"), ("{nope", "not a Mooncake")])
def test_a_bad_line_is_named(tmp_path, line, why):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: {why}"):
        read_trace(str(f))
    with pytest.raises(ValueError, match="scale"):
        read_trace(str(f), scale=2)


def test_the_cli_says_why_it_cannot_replay(tmp_path, capsys):
    f = tmp_path / "bad.jsonl"
    f.write_text("{nope\n")
    assert loadgen(["--trace", str(f), "--url", "http://127.0.0.1:9"]) == 2
    assert "bad.jsonl:1: not a Mooncake trace line" in capsys.readouterr().err


def test_percentiles_and_summary():
    assert percentile([], 0.5) == 0.0
    assert percentile([3, 1, 2, 4], 0.5) == 2 and percentile(list(range(1, 101)), 0.99) == 99
    r = Replay([Result(0, 0.1, 0.01, 1.0, 10, 20), Result(0, 0.3, 0.03, 2.0, 10, 40), Result(0, error="500")], 2.0)
    s = summary(r)
    assert (s["requests"], s["failed"], s["output_tokens"], s["output_tok_s"]) == (3, 1, 60, 30.0)
    assert (s["ttft_p50_s"], s["ttft_p99_s"], s["itl_p90_s"]) == (0.1, 0.3, 0.03)


def fake_server(seen: list):
    """A /v1/completions that streams max_tokens chunks and the usage, or 429 for prompts starting with '!'."""
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if body["prompt"].startswith("!"):
            return httpx.Response(429, json={"error": {"message": "full"}})
        chunks = [{"choices": [{"text": "a"}]} for _ in range(body["max_tokens"])]
        chunks.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                "completion_tokens": body["max_tokens"]}})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(handle)


@pytest.mark.parametrize("mode", [{"speed": 100.0}, {"concurrency": 2}])
def test_a_replay_reports_each_request(mode):
    seen: list = []
    reqs = [TraceRequest(0.01 * i, f"prompt {i}", 3, (i,)) for i in range(5)] + [TraceRequest(0.05, "!x", 3, (9,))]
    out = asyncio.run(replay("http://fake", reqs, progress=False, transport=fake_server(seen), **mode))
    assert [b["prompt"] for b in seen] == [r.prompt for r in reqs]  # in trace order
    assert all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 3 for b in seen)
    ok, bad = out.results[:5], out.results[5]
    assert all(r.output_tokens == 3 and r.prompt_tokens == 8 and r.ttft_s > 0 and r.e2e_s >= r.ttft_s for r in ok)
    assert bad.error.startswith("429")
    assert summary(out)["failed"] == 1
    with pytest.raises(ValueError, match="speed"):
        asyncio.run(replay("http://fake", reqs, speed=0, progress=False))


def test_a_scaled_length_keeps_every_block_of_its_ids(tmp_path):
    # 10,750 tokens over 22 ids of 512: at 1/8 the length rounds to 1,344, exactly 21 blocks of 64, which would
    # drop the last id (AIPerf rejects such a line); it is kept at 21 blocks and one token
    assert scaled_length(10_750, 22, 64, 0.125) == 1345
    assert scaled_length(100, 1, 64, 1.0) == 64  # never past its ids' blocks
    assert scaled_length(1100, 3, 64, 0.125) == 138  # a length within them is as rounded
    row = {"timestamp": 0, "input_length": 10_750, "output_length": 8, "hash_ids": list(range(22))}
    (req,) = read_trace(write(tmp_path, [row]), scale=0.125)
    assert len(req.prompt) == 1345 and req.prompt.endswith(block_text(21, 64)[:1])
