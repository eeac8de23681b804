"""``listen --respond``: the voice turn, a final transcript → the LLM through the serving scheduler.

Without tools the reply streams to the terminal and ``turn_ms`` runs from the end of speech to the
first token; with ``--tools`` the reply is one tool call constrained to the tools' schemas and
``turn_ms`` runs to the complete call.
"""

from __future__ import annotations

import json
import sys

from ..serving.openai_output import tool_call, with_tools


class Responder:
    """The voice turn: a final transcript → the LLM through the serving scheduler."""

    def __init__(self, args, settings, tools: list[dict] | None = None) -> None:
        from ..backends import SessionOptions
        from ..models.catalog import resolve_model
        from ..models.llm import DecoderLM
        from ..serving.llm.scheduler import Limits, LLMScheduler

        tier = settings.models.llm[0]
        ref = resolve_model(args.llm_model or tier.model, settings.models.cache_dir)
        backend = tier.backend if not args.llm_model else "onnxruntime"
        options = SessionOptions(
            device=tier.device if not args.llm_model else "cpu",
            threads=settings.device.threads,
            cache_dir=settings.engines.cache_dir,
        )
        self.lm = DecoderLM.open(ref, backend, options)
        self.scheduler = LLMScheduler(self.lm, Limits(max_batch=1, batch_timeout_ms=0)).start()
        self.tools, self.mode = tools, args.tool_choice
        self.max_new_tokens = args.max_new_tokens or (160 if tools else 48)
        self.grammar = None
        if tools:
            from ..models import grammar

            self.grammar = grammar.tool_call_grammar(tools) if self.mode == "required" else None
            self.grammar = self.grammar or grammar.tool_or_text_grammar(tools)

    def call_of(self, reply: str) -> dict | None:
        """The tool call in ``reply`` as {"name", "arguments"} (None: words, or cut short)."""
        call = tool_call(reply)
        return (
            {"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])} if call else None
        )

    def respond(self, text: str, speech_end_at_s: float | None, quiet: bool) -> tuple[str, float | None]:
        from ..models.sampling import SamplingParams
        from ..models.tokenizer import Message

        tok = self.lm.tokenizer
        chat = [Message("user", text)]
        if self.tools:
            chat = with_tools(chat, self.tools, self.mode)
        ids = tok.encode_chat(chat) if tok.chat_template else tok.encode(chat[0].content)
        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0, grammar=self.grammar)
        handle = self.scheduler.submit(ids, params)
        turn_ms = None
        for event in handle:
            if turn_ms is None and speech_end_at_s is not None and not self.tools:
                # The scheduler's clock is time.monotonic, like the ASR service's.
                turn_ms = (event.time_s - speech_end_at_s) * 1e3
            if event.text and not quiet and not self.tools:
                sys.stderr.write(event.text)
                sys.stderr.flush()
        done = handle.result(120.0)
        if self.tools and speech_end_at_s is not None and done.timing.token_times_s:
            turn_ms = (done.timing.token_times_s[-1] - speech_end_at_s) * 1e3  # to the complete call
        if not quiet and self.tools:
            call = self.call_of(done.text)
            shown = f"{call['name']} {json.dumps(call['arguments'])}" if call else f"(no call) {done.text}"
            sys.stderr.write(f"→ {shown}")
        if not quiet:
            sys.stderr.write(f"\n[turn {turn_ms:.0f} ms]\n" if turn_ms is not None else "\n")
        return done.text, turn_ms

    def close(self) -> None:
        self.scheduler.stop()
        self.lm.close()
