"""Byte and tokenizer.json tokenizers: round trips, special tokens, chat templates, streaming detokenization."""

import json

import pytest

from workers.model_setting import load_tokenizer
from workers.tokenizer import ByteTokenizer, HFTokenizer, role_tag_template

TEXT = "héllo, wörld — 你好 🙂!"


def test_byte_round_trip_and_specials():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len(TEXT.encode())
    assert tok.decode(ids) == TEXT
    assert tok.encode("a", add_special_tokens=False) == [97]
    assert tok.decode([97, tok.eos_token_id]) == "a"
    assert tok.decode([97, tok.eos_token_id], skip_special_tokens=False) == "a<|eos|>"
    assert tok.vocab_size == 258 and tok.eos_token_ids == (257,)


def test_streaming_never_emits_a_split_character():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    det = tok.detokenizer()
    deltas = [det.step(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + det.flush() == TEXT
    # the 4-byte emoji arrives byte by byte: three empty deltas, then the whole character
    start = len("héllo, wörld — 你好 ".encode())
    assert deltas[start:start + 4] == ["", "", "", "🙂"]


def test_streaming_flushes_an_incomplete_tail():
    tok = ByteTokenizer()
    det = tok.detokenizer()
    assert det.step(ord("a")) == "a"
    assert det.step(0xE4) == ""  # first byte of a 3-byte character
    assert det.flush() == "\ufffd"
    # an invalid byte in the middle is emitted once the next character completes
    det = tok.detokenizer()
    out = "".join(det.step(i) for i in [0xFF, ord("b")]) + det.flush()
    assert out == "\ufffdb"


def test_role_tag_template():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert role_tag_template(msgs) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert ByteTokenizer().apply_chat_template(msgs, add_generation_prompt=False).endswith("<|user|>\nhi\n")
    assert ByteTokenizer().encode_chat(msgs) == ByteTokenizer().encode(role_tag_template(msgs))
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert role_tag_template(parts) == "<|user|>\nab\n<|assistant|>\n"


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"content": "x"}], "'role' must be a non-empty string"),
    ([{"role": "user", "content": 3}], "'content' must be a string"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "only text content parts"),
])
def test_bad_messages_are_rejected(messages, message):
    with pytest.raises(ValueError, match=message):
        ByteTokenizer().apply_chat_template(messages)


@pytest.fixture
def hf_dir(tmp_path):
    """A word-level tokenizer.json with special tokens, built locally (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4, "!": 5, "<|im_end|>": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {{ eos_token }} {% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 6]}))
    return tmp_path


def test_hf_tokenizer_from_dir(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world !") == [0, 3, 4, 5]
    assert tok.encode("hello", add_special_tokens=False) == [3]
    assert tok.decode([0, 3, 4, 1]) == "hello world"
    assert tok.eos_token_id == 1 and tok.eos_token_ids == (1, 6) and tok.bos_token_id == 0
    assert tok.vocab_size == 7
    det = tok.detokenizer()
    assert "".join(det.step(i) for i in [3, 4, 5]) + det.flush() == "hello world !"


def test_hf_chat_template_is_rendered(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    out = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert out == "[user] hello </s> [assistant] "
    assert tok.encode_chat([{"role": "user", "content": "hello"}]) == tok.encode(out)  # BOS added once
    assert tok.encode_chat([{"role": "user", "content": "hello"}])[0] == tok.bos_token_id


def test_hf_chat_template_that_writes_bos_gets_no_second_one(hf_dir):
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(str(hf_dir))
    assert tok.encode_chat([{"role": "user", "content": "hello world"}]) == [0, 3, 4]


def test_hf_without_template_or_eos(tmp_path, hf_dir):
    (hf_dir / "tokenizer_config.json").write_text("{}")
    (hf_dir / "generation_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no EOS token"):
        HFTokenizer.from_dir(hf_dir)
    (hf_dir / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    tok = HFTokenizer.from_dir(hf_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|user|>\nx\n<|assistant|>\n"
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        HFTokenizer.from_dir(tmp_path / "nowhere")


@pytest.mark.parametrize("template", [
    "{{ messages[0].content | no_such_filter }}",  # TemplateAssertionError at compile time
    "{{ messages[0].content.__class__.__mro__ }}",  # SecurityError from the sandbox
    "{{ undefined_thing.attr }}",  # UndefinedError at render time
    "{% for m in messages %}",  # TemplateSyntaxError
])
def test_a_chat_template_that_fails_is_a_value_error(hf_dir, template):
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="chat template"):
        load_tokenizer(str(hf_dir)).apply_chat_template([{"role": "user", "content": "hello"}])


def test_text_that_is_not_unicode_is_a_value_error(hf_dir):
    for tok in (load_tokenizer(str(hf_dir)), ByteTokenizer()):
        with pytest.raises(ValueError):
            tok.encode("hello \udfff")
