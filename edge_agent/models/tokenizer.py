"""Tokenizers and chat templates for exported LLM folders.

The tokenizer is the export's own ``tokenizer.json`` (HF ``tokenizers``). Chat prompts are
rendered with the model's own template (``chat_template`` in ``tokenizer_config.json``, or
``chat_template.jinja``), as transformers does; the built-in Phi-3 and Gemma templates are only a
fallback for exports that carry none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, ModelError
from ..heap import release_freed_heap

PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
FALLBACK_TEMPLATES = {
    "phi3": PHI3_TEMPLATE,
    "gemma": GEMMA_TEMPLATE,
    "gemma2": GEMMA_TEMPLATE,
    "gemma3_text": GEMMA_TEMPLATE,
}
ROLES = ("system", "user", "assistant")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message (role and content), as the chat template takes it."""

    role: str
    content: str


def _token_text(value: object) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode, decode (incrementally, for streaming) and render chat prompts."""

    def __init__(self, folder: Path, model_type: str = "") -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"{folder}: no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelError(f"{path}: unreadable tokenizer ({exc})") from exc
        # Parsing Gemma 3's (262,144 tokens, 514,906 merges, 33 MB of JSON) peaks at ~370 MB and leaves ~300 MB
        # resident, two thirds of it freed parse buffers: trimmed, ~100 MB stay (what the tokenizer uses).
        release_freed_heap()
        cfg_path = folder / "tokenizer_config.json"
        try:
            self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except json.JSONDecodeError as exc:
            raise ModelError(f"{cfg_path}: not valid JSON (line {exc.lineno}: {exc.msg})") from exc
        template = self.config.get("chat_template")
        if isinstance(template, list):  # a list of named templates: take "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if not template and jinja_file.is_file():
            template = jinja_file.read_text()
        self.chat_template: str | None = template or FALLBACK_TEMPLATES.get(model_type)
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self._add_bos = bool(self.config.get("add_bos_token", False))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def id_limit(self) -> int:
        """One past the largest id this tokenizer defines (a model may have more logits than that)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what llguidance builds its vocabulary from)."""
        return self._tok.to_str()

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works and encode does not: a long prompt must not
        # stall every other thread of the agent (the API loop, the watchdog, MQTT) while it tokenizes.
        try:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError as exc:  # e.g. a lone UTF-16 surrogate: text that cannot be UTF-8
            if isinstance(text, str) and _SURROGATE.search(text):
                raise InputError("the text contains a lone UTF-16 surrogate (not valid Unicode)") from exc
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        if not messages:
            raise InputError("a chat needs at least one message")
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                raise InputError(f"messages[{i}].role: {m.role!r} is not one of {ROLES}")
            if not isinstance(m.content, str):
                raise InputError(f"messages[{i}].content: must be text")
        if not self.chat_template:
            raise ModelError(
                "this model has no chat template (tokenizer_config.json chat_template); send a plain prompt"
            )
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise InputError(f"chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise ModelError(f"the model's chat template failed: {exc}") from exc

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        # The rendered template already carries BOS where the family wants it: don't add another.
        return self.encode(self.render_chat(messages), add_special_tokens=False)


class StreamDecoder:
    """Turns generated ids into text pieces as they arrive, holding back incomplete UTF-8.

    The tokenizers library's own incremental decoder (``tokenizers.decoders.DecodeStream``) does the work:
    each push decodes a short window in Rust (the tokens since the last piece plus the few before them, so a
    tokenizer that strips a leading space or merges bytes across tokens still sees its context), constant
    work per token however long the output. A character split across tokens comes out with its last token.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._emitted = ""
        self._held = 0  # trailing ids whose text is not out yet (an incomplete character)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        piece = self._stream.step(self._tok._tok, token_id)
        if not piece:
            if piece is None or self._held:  # None: part of a character; "": no text (a skipped special token)
                self._held += 1
            return ""
        self._emitted += piece
        self._held = 0
        return piece

    @property
    def text(self) -> str:
        """The decoded text of every token pushed so far (an incomplete character as U+FFFD, as a one-pass
        decode gives it)."""
        return self._tok.decode(self._ids) if self._held else self._emitted
