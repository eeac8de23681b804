"""One measured walk of ``bench grammar``: matchers follow schema-valid documents token by token.

At every step the engine writes the masks of all rows, each row's next real token (the document's, or EOS
once the document is complete) must be allowed by its mask (else ``TokenRejected``: the correctness check),
and then each row consumes its token. A row that finishes a document starts the next one on a fresh matcher,
so the batch stays full until the first row runs out of documents. Only the mask and consume calls are timed.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .grammar_engines import TokenRejected


def allowed(bitmask: np.ndarray, row: int, token: int) -> bool:
    """Whether ``token`` is allowed in row ``row`` of an int32 token bitmask."""
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def allocate(rows: int, n_logits: int) -> np.ndarray:
    """A C-contiguous int32 bitmask of ``rows`` rows for ``n_logits`` logits, all bits set."""
    return np.full((rows, (n_logits + 31) // 32), -1, dtype=np.int32)


@dataclass
class WalkResult:
    """Timings of one walk: per step, the batch's mask call and its rows' consume calls (µs)."""

    rows: int
    mask_us: list[float] = field(default_factory=list)
    consume_us: list[float] = field(default_factory=list)
    documents: int = 0


class _Row:
    def __init__(self, engine: Any, compiled: Any, docs: list[list[int]], eos: int) -> None:
        self.engine, self.compiled, self.docs, self.eos = engine, compiled, docs, eos
        self.doc_index = -1
        self.pos = 0
        self.doc: list[int] = []
        self.matcher: Any = None

    def next_document(self) -> bool:
        self.doc_index += 1
        if self.doc_index >= len(self.docs):
            return False
        self.doc, self.pos = self.docs[self.doc_index], 0
        self.matcher = self.engine.matcher(self.compiled)
        return True

    def expected(self) -> int:
        return self.doc[self.pos] if self.pos < len(self.doc) else self.eos


def walk(
    engine: Any,
    compiled: Any,
    docs_per_row: list[list[list[int]]],
    n_logits: int,
    eos: int,
    label: str = "",
) -> WalkResult:
    """Walk ``docs_per_row[r]`` on row ``r`` of a batch, all rows stepping together; see the module doc."""
    rows = [_Row(engine, compiled, docs, eos) for docs in docs_per_row]
    for row in rows:
        if not row.next_document():
            raise ValueError("every row needs at least one document")
    bitmask = allocate(len(rows), n_logits)
    result = WalkResult(rows=len(rows), documents=len(rows))
    clock = time.perf_counter
    while True:
        matchers = [row.matcher for row in rows]
        t0 = clock()
        engine.fill(matchers, bitmask)
        t1 = clock()
        result.mask_us.append((t1 - t0) * 1e6)
        for r, row in enumerate(rows):
            token = row.expected()
            if not allowed(bitmask, r, token):
                what = "EOS at the end of" if token == eos else f"token {token} at position {row.pos} of"
                raise TokenRejected(
                    f"{label}: the mask leaves out {what} document {row.doc_index} on row {r} "
                    f"(tokens so far {row.doc[max(0, row.pos - 8) : row.pos]})"
                )
        spent = 0.0
        for row in rows:
            if row.pos < len(row.doc):
                t0 = clock()
                engine.consume(row.matcher, row.doc[row.pos])
                spent += clock() - t0
                row.pos += 1
            elif not row.next_document():  # this step checked EOS: the document is done
                result.consume_us.append(spent * 1e6)
                return result
            else:
                result.documents += 1
        result.consume_us.append(spent * 1e6)


def apply_mask(logits: np.ndarray, bitmask: np.ndarray) -> None:
    """Set the logits of tokens a bitmask leaves out to -inf, in place (``logits``: float32 ``[rows, n]``)."""
    n = logits.shape[1]
    # bit t % 32 of word t // 32: in little-endian bytes, byte k of word w holds tokens 32w + 8k …
    words = bitmask if bitmask.dtype.byteorder == "<" or sys.byteorder == "little" else bitmask.astype("<i4")
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=n, bitorder="little")
    np.copyto(logits, np.float32(-np.inf), where=bits == 0)
