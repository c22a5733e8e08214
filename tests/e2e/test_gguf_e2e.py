"""SmolLM2-135M-Instruct through the whole Serve app, read with the `openai` client: greedy chat and
completions equal transformers' `generate(do_sample=False)` on the same GGUF file, token for token.

One extra app (dp 1, tp 1) beside the session's random-model app, under its own route prefix and engine id.
"""

import pytest

from tests.support.e2e_fixtures import start_app
from tests.support.gguf_support import hf_greedy

pytestmark = pytest.mark.slow

APP = "kvfleet-e2e-smollm2"
MODEL = "smollm2-135m-instruct"
SETTINGS = {"model": MODEL, "engine_id": "engine-smollm2", "dp": "1", "tp": "1", "num_cpus_per_rank": "1",
            "max_seq_len": "512"}
MAX_TOKENS = 24
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n   ", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def oai(ray_cluster, smollm2_path):
    import openai
    from ray import serve

    url = start_app(APP, SETTINGS, route_prefix="/smollm2")
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    serve.delete(APP)


def _expect(hf_model, hf_tokenizer, ids: list[int]) -> tuple[str, str, int]:
    out = hf_greedy(hf_model, ids, MAX_TOKENS)
    stopped = out[-1] == hf_tokenizer.eos_token_id
    return hf_tokenizer.decode(out, skip_special_tokens=True), "stop" if stopped else "length", len(out)


def test_greedy_chat_equals_transformers(oai, hf_model, hf_tokenizer):
    for chat in CHATS:
        text = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        want, reason, n = _expect(hf_model, hf_tokenizer, hf_tokenizer(text, add_special_tokens=False)["input_ids"])
        r = oai.chat.completions.create(model=MODEL, messages=chat, max_tokens=MAX_TOKENS, temperature=0)
        assert r.model == MODEL
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want, reason), chat
        assert r.usage.completion_tokens in (n, n - (reason == "stop")), "same number of tokens"
    assert oai.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=MAX_TOKENS, temperature=0
                                       ).choices[0].message.content == "The capital of France is Paris."


def test_greedy_completions_equal_transformers(oai, hf_model, hf_tokenizer):
    for prompt in PROMPTS:
        want, reason, n = _expect(hf_model, hf_tokenizer, hf_tokenizer(prompt)["input_ids"])
        r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, reason), prompt
        assert r.usage.completion_tokens in (n, n - (reason == "stop"))
        streamed = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want
