"""Audio in: microphone, file replay and stdin sources, resampling, voice activity and endpointing.

Every source yields float32 mono blocks at the agent's rate (16 kHz) in [-1, 1]; conversion from
whatever the device or file has (rate, channels, sample format) happens at the source, once.
"""

from __future__ import annotations

TARGET_RATE = 16000
