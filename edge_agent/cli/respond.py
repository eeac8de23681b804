"""``listen --respond``: the voice turn, a stream's transcripts → the LLM through the serving scheduler.

Each audio stream gets a ``VoiceTurn`` (``serving/doors/voice/turn.py``): stable partials are prefilled
into the prefix cache while the user speaks (``[audio] prefill_ahead``), the final's reply follows,
and an early end's reply is cancelled if the utterance continues. Without tools the reply streams to
the terminal and ``turn_ms`` runs from the end of speech to the first token; with ``--tools`` the
reply is one tool call constrained to the tools' schemas and ``turn_ms`` runs to the complete call.
"""

from __future__ import annotations

import json
import sys

from ..serving.doors.voice.turn import TurnResult, VoiceTurn, chat_submit, turn_limits, turn_options, turn_pause_ms


class Responder:
    """The LLM of the voice turn (one scheduler) and one ``VoiceTurn`` per audio stream."""

    def __init__(self, args, settings, tools: list[dict] | None = None) -> None:
        from ..backends import SessionOptions
        from ..models.catalog import resolve_model
        from ..models.llm import DecoderLM
        from ..serving.llm.scheduler import LLMScheduler

        tier = settings.models.llm[0]
        ref = resolve_model(args.llm_model or tier.model, settings.models.cache_dir)
        backend = tier.backend if not args.llm_model else "onnxruntime"
        options = SessionOptions(
            device=tier.device if not args.llm_model else "cpu",
            threads=settings.device.threads,
            cache_dir=settings.engines.cache_dir,
        )
        self.lm = DecoderLM.open(ref, backend, options)
        self.scheduler = LLMScheduler(self.lm, turn_limits(settings)).start()
        self.tools, self.mode = tools, args.tool_choice
        self.max_new_tokens = args.max_new_tokens or (160 if tools else 48)
        self.options = turn_options(settings.audio)
        if getattr(args, "no_prefill_ahead", False):
            self.options.update(prefill_ahead=False, respond_ahead=False)
        self.pause_ms = turn_pause_ms(settings.audio, self.options)  # the streams' pause partials
        self._turns: dict[int, VoiceTurn] = {}

    def turn(self, stream: int) -> VoiceTurn:
        """The voice turn of ``stream`` (made on first use)."""
        vt = self._turns.get(stream)
        if vt is None:
            vt = self._turns[stream] = VoiceTurn(
                chat_submit(self.scheduler, self.lm.tokenizer),
                self.tools,
                tool_choice=self.mode,
                max_new_tokens=self.max_new_tokens,
                **self.options,
            )
        return vt

    def respond(self, event, speech_end_s: float | None, quiet: bool) -> TurnResult:
        """The reply to a final ``event`` (blocks); printed unless ``quiet``."""
        stream_text = None if quiet or self.tools else _write
        result = self.turn(event.stream).on_final(event, speech_end_s, on_token=stream_text)
        if not quiet:
            if self.tools:
                call = result.call
                shown = f"{call['name']} {json.dumps(call['arguments'])}" if call else f"(no call) {result.reply}"
                if result.delivered:
                    _write(f"→ {shown}")
                elif result.repeated:
                    _write(f"(not repeated: {shown}, made before the utterance went on)")
                else:
                    _write("(cancelled: the utterance went on)")
            ms = result.turn_complete_ms if self.tools else result.turn_first_token_ms
            _write(f"\n[turn {ms:.0f} ms]\n" if ms is not None else "\n")
        return result

    def close(self) -> None:
        for vt in self._turns.values():
            vt.close()
        self.scheduler.stop()
        self.lm.close()


def _write(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()
