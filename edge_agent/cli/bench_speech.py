"""``edge-agent bench asr``, ``bench voice`` and ``bench calls``: the flags of the speech workloads, parsed
into their options (``bench/options.py``) and handed to the workload's ``run``."""

from __future__ import annotations

import argparse

from ..bench.options import AsrOptions, CallsOptions, VoiceOptions, from_mapping
from ..bench.voice import UTTERANCES
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


def add_voice(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "voice",
        help="the voice turn end to end (speech in real time → ASR → end of turn → tool call), "
        "default settings against the latency features off",
        description="Replay synthesised spoken commands in real time through the configured ASR tier and the "
        "top LLM tier with the home tools, on the default settings and on a baseline with the prefix cache, "
        "prefill-ahead, the reply ahead, the early end of turn and jump-forward decoding off, interleaved; "
        "report end of speech → end of turn, first "
        "token and complete tool call, false cuts and duplicated calls, with ratios.",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds over the utterances; medians reported (default 3)")
    p.add_argument(
        "--utterances",
        type=int,
        default=None,
        metavar="N",
        help=f"the first N of the {len(UTTERANCES)} commands (default all)",
    )
    p.add_argument("--asr-model", default=None, help="ASR demo model or folder (default: the top configured ASR tier)")
    p.add_argument("--llm-model", default=None, help="LLM demo model or folder (default: the top configured LLM tier)")
    p.add_argument("--tools", default=None, metavar="FILE", help="OpenAI function tools (default: home tools)")
    p.add_argument("--max-new-tokens", type=int, default=160, help="the tool call's token budget (default 160)")
    p.add_argument(
        "--tool-choice",
        choices=("auto", "required"),
        default="required",
        help="required (default): always a call; auto: a call or words, as the demo asks",
    )
    p.add_argument(
        "--voices",
        default="standard",
        help="who speaks the commands, in turn (engines/voices.py): standard (Piper joe ×3, flite ×4, "
        "espeak-ng en-us), natural, stress, specs (piper:joe:0.85, flite:slt), or 'own': espeak-ng in each "
        "command's own voice",
    )
    p.add_argument("--json", dest="json_out", metavar="OUT", default=None, help="write the JSON report to OUT")
    p.add_argument("--plot", metavar="PNG", default=None, help="turn-time distributions, default vs baseline")
    p.add_argument("--config", metavar="FILE", default=None, help="TOML config (default: the daemon's)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_voice)
    return p


def _voice(args: argparse.Namespace) -> int:
    from ..bench import voice

    return voice.run(from_mapping(VoiceOptions, vars(args)))


def add_calls(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calls",
        help="home commands (text, and speech with --speech) → tool calls: how many exactly right",
        description="Run the demo's and the held-out home commands through the agent's voice-turn request "
        "and score each reply's call (name and arguments) against the expected one.",
    )
    p.add_argument("--llm-model", default="gemma-3-270m-home", help="model name or folder (an engine's too)")
    p.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "openvino"))
    p.add_argument("--sets", default="demo,held-out,unseen,dev", help="comma-separated: demo, held-out, unseen, dev")
    p.add_argument("--speech", action="store_true", help="also speak each command and score what the ASR heard")
    p.add_argument("--asr-model", default=None, help="ASR model (default: the top configured ASR tier)")
    p.add_argument(
        "--voices",
        default="standard",
        help="who speaks the commands, in turn: standard, natural, stress or specs (piper:joe:0.85, flite:slt, …)",
    )
    p.add_argument(
        "--every-voice", action="store_true", help="every command spoken by every voice of --voices, not in turn"
    )
    p.add_argument(
        "--context",
        choices=("on", "off", "both"),
        default="on",
        help="the ASR told the tools' words and [asr] prompt_words (Whisper's initial prompt): on, off or both",
    )
    p.add_argument("--tool-choice", choices=("auto", "required"), default="auto")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: the configured device threads)")
    p.add_argument("--json", dest="json_out", metavar="OUT", default=None, help="write the JSON report to OUT")
    p.add_argument("--config", metavar="FILE", default=None, help="TOML config (default: the daemon's)")
    p.set_defaults(func=_calls)
    return p


def _calls(args: argparse.Namespace) -> int:
    from ..bench import calls

    return calls.run(from_mapping(CallsOptions, vars(args)))
