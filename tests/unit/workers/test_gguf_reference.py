"""The packaged SmolLM2-135M-Instruct GGUF against transformers' own GGUF loader on the same file: the same
token ids, the same logits (fp32, 1e-3) through chunked prefill and paged decode, the same greedy tokens.

Slow: transformers dequantizes the file itself (~15 s on 2 cores), once per session (gguf_support's fixtures,
registered in conftest.py).
"""

import pytest
import torch

from tests.support.gguf_support import hf_greedy
from tests.support.model_support import greedy, make_manager, teacher_forced_logits
from workers.loader import load_model
from workers.model_setting import load_tokenizer

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CORPUS = [
    "What is the capital of France?",
    "Hello, world! It's 2026-12-01; 3.14159 x 1e-5 = 0.0000314159.",
    "naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어, عربى, हिन्दी",
    "emoji: 👍🏽 🇫🇷 👨‍👩‍👧‍👦 ❤️‍🔥 🤖",
    "def f(x):\n\treturn {'a': [x ** 2, x // 3]}  # comment\n\n\nclass A(B):\n    pass\n",
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\nnewlines\r\n\r\nand    runs      of     spaces",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n<|endoftext|>",
    "1234567890 12 345 6789",
    "",
    " ",
    "\n\n\n",
]


@pytest.fixture(scope="module")
def ours():
    return load_model(MODEL, max_seq_len=512)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def test_token_ids_equal_transformers(tok, hf_tokenizer):
    assert tok.eos_token_id == 2 and 2 in tok.eos_token_ids and tok.bos_token_id == 1
    assert tok.vocab_size == len(hf_tokenizer) == 49152
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids == hf_tokenizer(text)["input_ids"], text  # SmolLM2 adds no BOS
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text
        if "<|" not in text:  # special tokens are dropped on decode, as in transformers
            assert tok.decode(ids) == text


def test_streamed_decoding_round_trips(tok):
    for text in CORPUS:
        d = tok.detokenizer()
        pieces = [d.step(i) for i in tok.encode(text)] + [d.flush()]
        assert "".join(pieces) == tok.decode(tok.encode(text)), text


def test_chat_template_equals_transformers(tok, hf_tokenizer):
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."}],
    ]
    for chat in chats:
        want = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(chat) == want
        assert tok.encode_chat(chat) == hf_tokenizer(want, add_special_tokens=False)["input_ids"]


def _prompt(tok, n_words: int) -> list[int]:
    words = "the paged cache keeps every block of every rank in one pool and reuses shared prefixes".split()
    text = " ".join(words[i % len(words)] for i in range(n_words))
    return tok.encode_chat([{"role": "user", "content": f"Summarise: {text}"}])


def test_logits_equal_transformers_through_chunked_prefill_and_paged_decode(ours, tok, hf_model):
    model, cfg = ours
    ids = _prompt(tok, 60)
    ref_ids = ids + hf_greedy(hf_model, ids, 24)  # real continuations, not random tokens
    with torch.no_grad():
        ref = hf_model(torch.tensor([ref_ids])).logits[0].float()
    assert len(ref_ids) > 100
    mgr = make_manager(cfg, tokens_per_block=16, max_seq_len=512, kv_cache_bytes=16 << 20)
    got = teacher_forced_logits(model, mgr, ref_ids, [7, 33, 40])  # then one token per step
    diff = (got - ref).abs().max().item()
    print(f"SmolLM2 fp32 logits, {len(ref_ids)} positions: max |ours - transformers| = {diff:.2e}")
    assert got.shape == ref.shape and diff <= 1e-3


def test_greedy_generation_equals_transformers(ours, tok, hf_model):
    model, cfg = ours
    mgr = make_manager(cfg, tokens_per_block=16, max_seq_len=512, kv_cache_bytes=16 << 20)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.encode_chat(chat)
    want = hf_greedy(hf_model, ids, 16)
    assert want[-1] in tok.eos_token_ids
    assert greedy(model, mgr, ids, len(want), chunk=8) == want
    assert tok.decode(want) == "The capital of France is Paris."
