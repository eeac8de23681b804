"""A voice-activity detector that says what a test scripted, frame by frame (20 ms frames at 16 kHz): the
endpointer and the ASR service driven in stream time, with no audio analysis and no sleeps."""

from __future__ import annotations

RATE, FRAME = 16000, 320  # 20 ms frames


class Script:
    """Frame k is speech when ``voiced[k]`` (silence past its end)."""

    frame_samples = FRAME

    def __init__(self, voiced: list[bool]) -> None:
        self.voiced, self.i = voiced, 0

    def is_speech(self, frame) -> bool:
        v = self.voiced[self.i] if self.i < len(self.voiced) else False
        self.i += 1
        return v

    def reset(self) -> None:
        pass


def frames(ms: int) -> int:
    """Frames in ``ms`` milliseconds."""
    return ms // 20
