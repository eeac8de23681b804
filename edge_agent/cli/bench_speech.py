"""``edge-agent bench asr``: the flags of the speech workloads, parsed into their options (``bench/options.py``)
and handed to the workload's ``run``."""

from __future__ import annotations

import argparse

from ..bench.options import AsrOptions, from_mapping
from ..models.ctc_lexicon import DECODERS


def _streams(text: str) -> list[int]:
    """An argparse type: one stream count, or a comma list of them."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--streams: {text!r} is not a number or a comma list (1,4)") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--streams: {text!r}: give counts of at least 1")
    return values


def add_asr(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "asr",
        help="benchmark streaming ASR with N concurrent streams against one-pass decoding",
        description="Replay speech on N concurrent streams in real time through the streaming ASR service "
        "(endpointing, dynamic batching) and decode the same utterances in one pass each; report "
        "first-partial / final / first-text percentiles and RTF side by side.",
    )
    p.add_argument(
        "--streams",
        type=_streams,
        default=[1],
        metavar="N[,N…]",
        help="concurrent streams (default 1; a comma list with --compare, e.g. 1,4)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="the fixed batching wait and whole first chunk (the previous behaviour) against the adaptive "
        "wait and early first step, in alternating rounds, side by side with ratios",
    )
    p.add_argument("--model", default=None, help="ASR demo model or folder (default: the top configured ASR tier)")
    p.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "openvino"))
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; medians reported (default 3)")
    p.add_argument("--audio", action="append", default=[], metavar="FILE", help="speech to replay (repeatable)")
    p.add_argument("--max-batch", type=int, default=None, help="default: batching.max_batch")
    p.add_argument("--batch-timeout-ms", type=float, default=None, help="default: batching.batch_timeout_ms")
    p.add_argument(
        "--decoder",
        choices=DECODERS,
        default="auto",
        help="CTC decoding; auto = the folder's lexicon + LM when it has them (default)",
    )
    p.add_argument("--json", dest="json_out", metavar="OUT", default=None, help="write the JSON report to OUT")
    p.add_argument("--plot", metavar="PNG", default=None, help="CDFs of final and first-text latency, RTF bars")
    p.add_argument("--config", metavar="FILE", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_asr)
    return p


def _asr(args: argparse.Namespace) -> int:
    from ..bench import asr

    return asr.run(from_mapping(AsrOptions, vars(args)))
