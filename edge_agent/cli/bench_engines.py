"""``edge-agent bench weight-only`` and ``bench inplace-kv``: the flags of the engine workloads (an engine's
weight precision, its in-place KV conversion), parsed into their options (``bench/options.py``) and handed to
the workload's ``run``; the command prints the report it returns and writes it with ``--json``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..bench.options import InplaceKvOptions, WeightOnlyOptions, from_mapping


class _Engines(argparse.Action):
    """``--engine LABEL=FOLDER``, repeatable: collected as a dict label -> folder (a later label wins)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        label, sep, folder = str(values).partition("=")
        if not sep or not label or not folder:
            parser.error(f"--engine {values!r}: LABEL=FOLDER")
        setattr(namespace, self.dest, {**getattr(namespace, self.dest), label: Path(folder).expanduser()})


def add_weight_only(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "weight-only",
        help="FP32 vs INT8 weight-only vs INT4: batch-1 decode tokens/s of a recipe's model",
        description="Weight-only decode benchmark: FP32 vs INT8 weight-only vs INT4, batch-1 decode tokens/s "
        "side by side.",
    )
    p.add_argument("--recipe", default="demo-phi3-small", help="recipe file or name (default demo-phi3-small)")
    p.add_argument("--backend", choices=["onnxruntime", "openvino"], default="onnxruntime")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts per round (default 4)")
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per prompt (default 64)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="also write the figures as JSON to OUT")
    p.add_argument(
        "--engine",
        dest="engines",
        action=_Engines,
        default={},
        metavar="LABEL=FOLDER",
        help="time this built engine folder (e.g. a cache entry's model/) instead of making int8w and int4",
    )
    p.set_defaults(func=_weight_only)
    return p


def _weight_only(args: argparse.Namespace) -> int:
    from ..bench import weight_only

    result = weight_only.run(from_mapping(WeightOnlyOptions, vars(args)))
    print(weight_only.render(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def add_inplace_kv(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "inplace-kv",
        help="batch-1 decode: a plain export vs its in-place KV conversion vs onnxruntime-genai",
        description="Batch-1 decode of a plain export vs its in-place KV conversion vs onnxruntime-genai's generator.",
    )
    p.add_argument("--model", default="demo-phi3-small", help="demo name or plain export folder")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per prompt")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--genai", help="an onnxruntime-genai builder folder of the same model ('none': skip)")
    p.add_argument("--json", dest="json_out", type=Path, metavar="JSON", help="write the figures here too")
    p.set_defaults(func=_inplace_kv)
    return p


def _inplace_kv(args: argparse.Namespace) -> int:
    from ..bench import inplace_kv

    opts = from_mapping(InplaceKvOptions, vars(args))
    report = inplace_kv.run(opts)
    print(inplace_kv.format_report(report, opts))
    if args.json_out:
        figures = {k: report[k] for k in ("median_tok_s", "rounds", "skipped")}
        Path(args.json_out).write_text(json.dumps(figures, indent=2) + "\n")
    return 0
