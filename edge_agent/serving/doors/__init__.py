"""The front doors: how clients reach the serving layer, each on an asyncio loop of its own.

http/       the OpenAI-compatible HTTP API (server.py: ApiServer; llm_routes.py, speech_routes.py,
            voice_session.py: the speech WebSocket's respond option; errors.py, guard.py,
            transcription_request.py, transcript_formats.py)
wyoming/    the Wyoming server for Home Assistant (server.py: WyomingServer; session.py: one connection;
            protocol.py, audio.py, info.py)
voice/      the voice turn (turn.py: VoiceTurn; command_check.py), used by the HTTP door's respond option,
            ``listen --respond`` and ``bench voice``
openai/     the OpenAI shapes (schema.py: the requests; output.py: grammar, tool calls, logprobs, timings)
ladders.py  what a door reads from and asks of the LLM and speech ladders (LlmLadder, SpeechLadder: protocols)
host.py     what every door runs on: its asyncio loop on a thread (LoopThread), the mailboxes that hand
            device threads' events to it (Mailbox)
"""
