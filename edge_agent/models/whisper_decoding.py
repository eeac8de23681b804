"""Whisper's greedy decoding, as every Whisper recogniser makes it (CPU batches, the NPU's fixed cache).

A decode continues a prompt (``[<|startofprev|> context] <|startoftranscript|> <|lang|> <|task|>
<|notimestamps|>``) over encoder states: forced tokens first (a partial's commits), then the argmax with
the suppressed tokens out, until the end of text, the token budget or the decoder's last position. With
``guard`` (what the recognisers serve; without, plain greedy as a reference decoder makes it) two guards
keep it from saying what was not said:

- **nothing heard**: when the model's probability of ``<|nocaptions|>`` after a lone
  ``<|startoftranscript|>`` (no context: words given to expect pull it down) is at least ``NO_SPEECH``, a
  row with nothing forced decodes to no tokens. Whisper given its context over silence or music says the
  context back ("Set a room's light, set timer, …") until its budget.
- **a runaway repetition** (``repeat_cut``): the output's tail is the same block of tokens over and over
  (``bathroom, bathroom, …``) or it starts over from its first words (a short encoder window makes Whisper
  base say the utterance again to fill it): it is cut after the first copy and the decode stops there.

``drafts`` (the last pass's tokens) are verified in the decode's first call: kept as far as greedy
decoding agrees, the cache cut there; the result is the decode without a draft, for fewer decoder calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from ..backends import Session
from ..errors import InputError
from ..graphs.builder import LOGITS_TO_KEEP

log = logging.getLogger(__name__)
# P(<|nocaptions|>) after a lone <|startoftranscript|> from which a decode hears nothing. On the natural-voice
# set (docs/asr.md, the final's window of audio + 6 s) speech gave at most 0.47 (0.39 at 8 kHz, 0.26 clipped);
# silence, noise, a hum, clicks and synthesised music 0.585-0.89. faster-whisper's 0.6 let a sustained chord
# through (0.585), which Whisper given the tools' words heard as those words.
NO_SPEECH = 0.55
RESTART_TOKENS = 4  # an output whose last tokens are its first this many starts over
MAX_BLOCK = 32  # the longest block a repetition is looked for in


def repeat_cut(out: Sequence[int], start: int = 0) -> int | None:
    """The length to cut ``out`` to when its last token made it a runaway repetition, else None: its tail
    is ``k`` copies of one block of ``L`` tokens (``k`` >= 2 for ``L`` >= 4, 4 for 2-3 tokens, 6 for one),
    cut to the first copy; or its last ``RESTART_TOKENS`` tokens are its first ones (it starts over), cut
    before them. Tokens before ``start`` (forced) are never cut."""
    n = len(out)
    r = RESTART_TOKENS
    if n >= 2 * r and n - r >= start and list(out[n - r :]) == list(out[:r]):
        return n - r
    tail = list(out[-min(n, 2 * MAX_BLOCK) :])
    m = len(tail)
    for size in range(1, min(MAX_BLOCK, m // 2) + 1):
        block = tail[m - size :]
        if tail[m - 2 * size : m - size] != block:
            continue
        copies = 2
        while (copies + 1) * size <= n and list(out[n - (copies + 1) * size : n - copies * size]) == block:
            copies += 1
        if copies >= (2 if size >= 4 else 4 if size >= 2 else 6) and n - (copies - 1) * size >= start:
            return n - (copies - 1) * size
    return None


class WhisperDecoding:
    """Greedy decoding over a Whisper decoder (with a KV cache), shared by the recognisers (a mixin: the
    recogniser holds the sessions and the token ids it reads)."""

    name: str
    eot: int
    sot: int
    max_positions: int
    decoder: Session | None
    decoder_past: Session | None
    _suppress_mask: np.ndarray
    _begin_mask: np.ndarray
    _prompt_len: int  # <|startoftranscript|> to <|notimestamps|>: the prompt after any context
    no_speech_id: int | None  # <|nocaptions|> (or v3's <|nospeech|>); None: no such token, nothing is judged
    keeps_logits: tuple[bool, bool] = (False, False)  # whether decoder, decoder_past take ``logits_to_keep``

    def _last(self, past: bool, k: int) -> dict[str, np.ndarray]:
        """The feed that asks the decoder (``past``: the one with a cache) for the logits of its last ``k``
        positions only; nothing where its graph has no such input (it computes them all)."""
        return {LOGITS_TO_KEEP: np.array(k, np.int64)} if self.keeps_logits[past] else {}

    def decode(
        self,
        hidden: np.ndarray,
        prompts: Sequence[Sequence[int]],
        forced: Sequence[Sequence[int]],
        max_new: Sequence[int],
        suppress: bool = True,
        stop_at_eot: bool = True,
        drafts: Sequence[Sequence[int]] | None = None,
        guard: bool = False,
    ) -> list[list[int]]:
        """Greedy, batched in lockstep. Returns per row the generated ids (forced ones included, no EOT).
        ``drafts``: per row, tokens a greedy decode is likely to produce (the last partial's, beyond the
        forced ones): checked in the first decoder call, the longest prefix the model agrees with is kept
        and decoding goes on from there; the result is exactly the greedy decode without a draft.
        ``guard``: a row with nothing forced where the model hears no speech gives no tokens, and a runaway
        repetition is cut (the module doc)."""
        assert self.decoder is not None and self.decoder_past is not None  # None only on the NPU, its own decode
        if drafts is not None and any(len(d) > len(f) for d, f in zip(drafts, forced)):
            # rows verify drafts of their own lengths: one at a time
            return [
                self._decode_draft(
                    hidden[r : r + 1], prompts[r], forced[r], max_new[r], d, suppress, stop_at_eot, guard
                )
                for r, d in enumerate(drafts)
            ]
        if len({len(p) for p in prompts}) != 1:
            raise InputError("rows of one decode batch need prompts of the same length")
        # The forced tokens every row has go in with the prompt: one decoder call instead of one each.
        common = min(min(len(f) for f in forced), min(max_new) - 1, self.max_positions - len(prompts[0]) - 2)
        common = max(0, common)
        out: list[list[int]] = [[int(t) for t in f[:common]] for f in forced]
        first = [list(p) + o for p, o in zip(prompts, out)]
        rows, res = self._first(hidden, first, [guard and not f for f in forced], keep=1)
        if not rows:
            return out
        past = _past(res)
        logits = res["logits"][:, -1]
        while rows:
            tokens, keep = [], []
            for j, r in enumerate(rows):
                token = self._choose(logits[j], len(out[r]), forced[r], suppress)
                if stop_at_eot and token == self.eot and len(out[r]) >= len(forced[r]):
                    continue
                out[r].append(token)
                if not self._stop(out[r], len(prompts[r]), len(forced[r]), max_new[r], guard):
                    keep.append(j)
                    tokens.append(token)
            if not keep:
                break
            if len(keep) < len(rows):  # finished rows leave the batch: slice every cache on the batch axis
                idx = np.asarray(keep)
                past = {k: v[idx] for k, v in past.items()}
            rows = [rows[j] for j in keep]
            res = self.decoder_past.run({"input_ids": np.asarray(tokens, np.int64)[:, None], **past})
            past.update(_past(res))
            logits = res["logits"][:, -1]
        return out

    def _decode_draft(
        self,
        hidden: np.ndarray,
        prompt: Sequence[int],
        forced: Sequence[int],
        max_new: int,
        draft: Sequence[int],
        suppress: bool,
        stop_at_eot: bool,
        guard: bool = False,
    ) -> list[int]:
        """One row: the prompt, the forced tokens and the draft in one decoder call; the draft kept up to the
        first token greedy decoding would not choose (or an end of text), the cache cut there, then greedy."""
        assert self.decoder is not None and self.decoder_past is not None
        room = min(max_new, self.max_positions - len(prompt) - 2)
        if list(draft[: len(forced)]) != list(forced):
            draft = forced  # a draft that does not extend the forced tokens is no draft
        draft = [int(t) for t in draft[:room]]
        # the logits read: the prompt's last position's and the draft's (row j: the token after draft[:j])
        heard, res = self._first(hidden, [[*prompt, *draft]], [guard and not forced], keep=len(draft) + 1)
        if not heard:
            return []
        after = res["logits"][0, -(len(draft) + 1) :]
        base = len(prompt)
        keep = min(len(forced), len(draft))
        while keep < len(draft) and self._choose(after[keep], keep, forced, suppress) == draft[keep]:
            keep += 1
            cut = repeat_cut(draft[:keep], len(forced)) if guard else None
            if cut is not None:
                return draft[:cut]
        end = base + keep
        past = {k: v[:, :, :end] if ".decoder." in k else v for k, v in _past(res).items()}
        step_session = self.decoder_past

        def feed(token: int) -> np.ndarray:
            step = step_session.run({"input_ids": np.asarray([[token]], np.int64), **past})
            past.update(_past(step))
            return step["logits"][0, -1]

        return self._greedy(after[keep], draft[:keep], len(prompt), forced, max_new, feed, suppress, stop_at_eot, guard)

    def _choose(self, logits: np.ndarray, t: int, forced: Sequence[int], suppress: bool) -> int:
        """The token at output position ``t``: the forced one while there is one, else the argmax of ``logits``
        with the suppressed tokens out (``begin_suppress_tokens`` too at the first position)."""
        if t < len(forced):
            return int(forced[t])
        if suppress:
            logits = np.where(self._begin_mask if t == 0 else self._suppress_mask, -np.inf, logits)
        return int(np.argmax(logits))

    def _first(
        self, hidden: np.ndarray, ids: Sequence[Sequence[int]], judge: Sequence[bool], keep: int
    ) -> tuple[list[int], dict[str, np.ndarray]]:
        """The decoder's first call on ``ids`` (rows of one length) over ``hidden``: the rows that go on and
        its outputs for them (the logits of at least the last ``keep`` positions, the caches). A row to
        ``judge`` goes on only if the model hears speech (``_silent``): judged on a lone
        ``<|startoftranscript|>``, without the context that pulls "no speech" down. That call's cross-attention
        keys and values then serve the first call, run on the decoder with an empty cache of its own: the
        judgement costs one decoder token."""
        assert self.decoder is not None and self.decoder_past is not None
        if not any(judge):
            feeds = {"input_ids": np.asarray(ids, np.int64), "encoder_hidden_states": hidden, **self._last(False, keep)}
            return list(range(len(ids))), self.decoder.run(feeds)
        lone = self.decoder.run(
            {"input_ids": np.full((len(ids), 1), self.sot, np.int64), "encoder_hidden_states": hidden}
        )
        rows = [r for r in range(len(ids)) if not (judge[r] and self._silent(lone["logits"][r, 0]))]
        if not rows:
            return rows, {}
        cross = {k: v[rows] for k, v in lone.items() if ".encoder." in k}
        empty = {k: v[rows, :, :0] for k, v in _past(lone).items() if ".decoder." in k}
        feeds = {
            "input_ids": np.asarray([ids[r] for r in rows], np.int64),
            **empty,
            **_past(cross),
            **self._last(True, keep),
        }
        res = self.decoder_past.run(feeds)
        return rows, {**res, **cross}

    def _silent(self, sot_logits: np.ndarray) -> bool:
        """Whether the model hears no speech: P(``<|nocaptions|>``) after a lone ``<|startoftranscript|>``
        (``sot_logits``) at least ``NO_SPEECH``."""
        if self.no_speech_id is None:
            return False
        x = np.asarray(sot_logits, np.float64)
        top = float(x.max())
        return float(np.exp(x[self.no_speech_id] - top) / np.exp(x - top).sum()) >= NO_SPEECH

    def _stop(self, out: list[int], prompt_len: int, start: int, max_new: int, guard: bool) -> bool:
        """After a token was added to ``out``: whether the row takes no further token. With ``guard`` a runaway
        repetition is cut off ``out`` (``repeat_cut``, never into the first ``start`` tokens); ``max_new``
        tokens or the decoder's last position also end it (that one said in the log: its text is cut)."""
        cut = repeat_cut(out, start) if guard and len(out) > start else None
        if cut is not None:
            del out[cut:]
            return True
        if len(out) >= max_new:
            return True
        if prompt_len + len(out) < self.max_positions:
            return False
        log.warning(
            "%s: a decode stopped at %d tokens: the decoder's cache holds %d positions",
            self.name,
            len(out),
            self.max_positions,
        )
        return True

    def _greedy(
        self,
        logits: np.ndarray,
        out: list[int],
        prompt_len: int,
        forced: Sequence[int],
        max_new: int,
        feed: Callable[[int], np.ndarray],
        suppress: bool,
        stop_at_eot: bool,
        guard: bool = False,
    ) -> list[int]:
        """One row's greedy decode on from ``logits`` (the next token's, after the prompt and ``out``): the
        forced tokens, then the suppressed argmax, until the end of text, a runaway repetition, ``max_new``
        tokens or the decoder's last position; ``feed(token)`` runs the decoder on one token and returns the
        next token's logits."""
        while len(out) < max_new:
            token = self._choose(logits, len(out), forced, suppress)
            if stop_at_eot and token == self.eot and len(out) >= len(forced):
                break
            out.append(token)
            if self._stop(out, prompt_len, len(forced), max_new, guard):
                break
            logits = feed(token)
        return out


def _past(res: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A decoder run's ``present.*`` outputs under the ``past_key_values.*`` names the next run takes."""
    return {k.replace("present.", "past_key_values.", 1): v for k, v in res.items() if k != "logits"}
