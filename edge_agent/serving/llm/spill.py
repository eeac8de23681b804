"""The spill decision: whether a one-sequence tier (the NPU's LLM mode) takes a request or the tier loaded
beside it does. Pure: the caller passes whether the tier is busy, the request's predicted first-token time
on it (``serving.tiers.admission.predict_ttft_ms`` over the tier's own measured rates, which age out) and the
threshold in force.

- An idle tier (nothing waiting, running or being prefilled) takes every request it can hold: a slow
  request never retires it, since its next request measures it again.
- A busy tier takes a request only when its predicted first token is within ``threshold_ms``. With no
  recent rates (none measured yet, or stale) a busy tier's wait cannot be told, and the request goes beside.
- ``threshold_ms`` None: the tier takes what it can hold, queueing behind what it runs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether the one-sequence tier takes the request; why not (the handle's ``spill`` reason) when it does not."""

    take: bool
    expected_ms: float | None = None  # the predicted first-token time on the tier, when one was predicted
    reason: str | None = None


def decide(busy: int, predicted_ms: float | None, threshold_ms: float | None) -> Verdict:
    """Whether the one-sequence tier takes a request, with ``busy`` sequences on it (see the module doc)."""
    if not busy or threshold_ms is None:
        return Verdict(True, predicted_ms)
    if predicted_ms is None:
        return Verdict(False, None, f"queue: {busy} request(s) ahead and no recent timing to wait on")
    if predicted_ms > threshold_ms:
        return Verdict(
            False, predicted_ms, f"queue: expected first token in {predicted_ms:.0f} ms > {threshold_ms:.0f} ms"
        )
    return Verdict(True, predicted_ms)
