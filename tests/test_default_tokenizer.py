"""The tokenizer of the converted default model (SmolLM2-135M-Instruct from its GGUF).

The first run converts the GGUF into the user cache (about 15 s on 2 cores); later runs reuse it.
"""

from __future__ import annotations

import unicodedata

import pytest
from tokenizers import Tokenizer

from offload_engine.formats.default_model import default_model_dir, find_default_gguf

pytestmark = pytest.mark.slow
import transformers  # noqa: E402  (a test dependency: the reference implementation)

TEXTS = [
    "The capital of France is Paris.",
    "Hello, world! How are you doing today?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * 2; }",
    "Numbers: 12345, 3.14159, 1,000,000 and 2024-06-30 at 23:59.",
    "x = 007 + 99999999999",
    "Unicode: café, naïve, Straße, Ελληνικά, русский, 日本語, 中文, 한국어",
    "Emoji: 🎉🚀👍🏽 and ❤️ and 👨‍👩‍👧",
    "Whitespace:   three spaces,\ttab,\t\ttwo tabs,    four spaces",
    "  leading and trailing  ",
    "Lines\n\nwith\n\n\nblank lines\r\nand CRLF\n",
    "Contractions: don't, I'll, we've, they're, it's, She'D",
    "Superscripts and fractions: x² ½ ३ ٣",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def folder():
    return default_model_dir()


@pytest.fixture(scope="module")
def fast(folder):
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def chat_text(hf):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12 * 34? Answer in one line."},
        {"role": "assistant", "content": "12 * 34 = 408."},
        {"role": "user", "content": "Thanks! 🙏"},
    ]
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_chat_template_renders(chat_text):
    assert chat_text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert chat_text.endswith("<|im_start|>assistant\n")


def test_tokenizers_and_transformers_agree(fast, hf, chat_text):
    for text in TEXTS + [chat_text]:
        assert fast.encode(text, add_special_tokens=False).ids == hf(text, add_special_tokens=False).input_ids, text
    # SmolLM2's GGUF says add_bos_token = false: nothing is added around the text.
    assert hf("hi").input_ids == fast.encode("hi").ids == fast.encode("hi", add_special_tokens=False).ids


def test_every_digit_is_its_own_token(fast):
    # llama.cpp's "smollm" pre-tokenizer splits \p{N} characters one by one before the GPT-2 regex.
    for text in TEXTS:
        enc = fast.encode(text, add_special_tokens=False)
        pieces = [text[a:b] for a, b in enc.offsets]
        for piece in pieces:
            if any(unicodedata.category(c).startswith("N") for c in piece):
                assert len(piece) == 1, (text, pieces)
    assert len(fast.encode("12345", add_special_tokens=False).ids) == 5
    assert len(fast.encode(" 3.14159", add_special_tokens=False).ids) == 8  # " ", 3, ".", 1, 4, 1, 5, 9


def test_control_tokens(fast):
    assert fast.encode("<|im_start|>", add_special_tokens=False).ids == [1]
    assert fast.encode("<|im_end|>", add_special_tokens=False).ids == [2]
    ids = fast.encode("<|im_start|>assistant\nok<|im_end|>", add_special_tokens=False).ids
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1 and ids.count(2) == 1
    assert fast.token_to_id("<|endoftext|>") == 0


def test_decode_inverts_encode(fast, chat_text):
    for text in TEXTS + [chat_text]:
        assert fast.decode(fast.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


def _has_number(text: str) -> bool:
    return any(unicodedata.category(c).startswith("N") for c in text)


def test_matches_transformers_gguf_reader(fast, hf):
    """transformers' own tokenizer built from the GGUF metadata (an independent implementation).

    It does not know the "smollm" pre-tokenizer name and falls back to a plain byte-level split,
    so it is compared on texts without Unicode numbers (category N) only. Known disagreement on
    the others (seen with transformers 5.x): SmolLM2's vocabulary has no token joining an ASCII
    digit to anything, so digit runs still come out one digit per token, but for " ½" it merges
    the space with the first byte of "½" ("ĠÂ", "½") where llama.cpp's rule, and Hugging Face's
    SmolLM2 tokenizer.json (Digits(individual_digits=True)), isolate "½" first (" ", "Â½").
    """
    gguf_path = find_default_gguf()
    theirs = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    chat = hf.apply_chat_template([{"role": "user", "content": "Say hello, twice!"},
                                   {"role": "assistant", "content": "Hello! Hello!"}], tokenize=False)
    texts = [t for t in TEXTS + [chat] if not _has_number(t)]
    assert len(texts) >= 10
    for text in texts:
        assert theirs(text, add_special_tokens=False).input_ids == fast.encode(text, add_special_tokens=False).ids, text
