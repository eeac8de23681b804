"""The voice turn: a stream's transcripts to one LLM reply, early (``turn.VoiceTurn``)."""
