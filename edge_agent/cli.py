"""The ``edge-agent`` command line.

Every command that reports takes ``--json``; a failure prints one line on stderr (a traceback
only with ``--debug``) and exits non-zero: 2 for bad usage or config, 1 for everything else.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from . import __version__
from .errors import ConfigError, EdgeAgentError, InputError

log = logging.getLogger("edge_agent")

# Modules that add their own subcommands: each has ``add_commands(subparsers)`` (top level) or
# ``add_parser(bench_subparsers)`` (under ``edge-agent bench``). Their heavy imports stay inside handlers.
COMMAND_MODULES: list[str] = [".telemetry.fleet", ".eval_asr", ".asr_commands", ".agent", ".demo", ".build_commands"]
BENCH_MODULES: list[str] = [".bench.llm", ".bench.tiers", ".bench.asr", ".bench.telemetry"]


def _add_common(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config (default /etc/edge-agent/agent.toml if present)")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-agent",
        description="Edge inference agent: builds engines, serves ASR and LLMs, measures latency, reports over MQTT.",
    )
    parser.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    parser.add_argument("--debug", action="store_true", help="verbose logs and tracebacks")
    parser.add_argument("--log-format", choices=["text", "json"], default=None,
                        help="text, or one JSON object per line (time, level, logger, message) for journald/Loki; "
                        "`run` defaults to logging.format")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None,
                        help="default: warning (`run`: logging.level, info)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("check-config", help="validate the configuration and print every problem")
    _add_common(p)
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("doctor", help="what runtimes, devices and versions this machine has")
    _add_common(p)
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("models", help="demo and configured models")
    msub = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    q = msub.add_parser("list", help="list demo models and the configured tiers")
    _add_common(q)
    q.set_defaults(func=cmd_models_list)

    p = sub.add_parser("generate", help="generate text from a prompt, streaming tokens as they come")
    _add_common(p)
    p.add_argument("prompt", help="the user's message (rendered with the model's chat template unless --raw)")
    p.add_argument("--model", help="demo model name or model folder (default: the top configured LLM tier)")
    p.add_argument("--backend", choices=["onnxruntime", "openvino", "tensorrt"], help="default: the tier's backend")
    p.add_argument("--device", help="device for the backend (cpu, cuda, tensorrt, CPU, GPU, NPU, AUTO)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="greedy decoding (same as --temperature 0)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="makes sampling reproducible")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop before this text (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    p.set_defaults(func=cmd_generate)

    for module in COMMAND_MODULES:
        importlib.import_module(module, __package__).add_commands(sub)

    p = sub.add_parser("bench", help="benchmarks that print figures measured side by side")
    bsub = p.add_subparsers(dest="bench_command", metavar="WORKLOAD", required=True)
    for module in BENCH_MODULES:
        importlib.import_module(module, __package__).add_parser(bsub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .logsetup import configure

    configure("debug" if args.debug else (args.log_level or "warning"), args.log_format or "text")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ConfigError as exc:
        if args.debug:
            raise
        print(f"edge-agent: {exc}", file=sys.stderr)
        return 2
    except EdgeAgentError as exc:
        if args.debug:
            raise
        print(f"edge-agent: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("edge-agent: interrupted", file=sys.stderr)
        return 130


def _emit_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def cmd_check_config(args: argparse.Namespace) -> int:
    from .config import resolve_config_path
    from .preflight import config_problems

    source = resolve_config_path(args.config)
    problems = config_problems(args.config)
    if args.json:
        _emit_json({"ok": not problems, "source": str(source) if source else None,
                    "problems": [{"path": p, "message": m} for p, m in problems]})
    else:
        for path, msg in problems:
            print(f"{path}: {msg}")
        if not problems:
            print(f"configuration OK ({source or 'built-in defaults'} + EDGE_AGENT_* environment)")
        else:
            print(f"{len(problems)} problem(s) in {source or 'built-in defaults'} + EDGE_AGENT_* environment",
                  file=sys.stderr)
    return 2 if problems else 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import doctor

    report = doctor.collect()
    if args.json:
        _emit_json(report)
    else:
        print(doctor.render_table(report))
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from .config import load_settings
    from .models.catalog import DEMO_MODELS, demo_status

    settings = load_settings(args.config)
    cache = settings.models.cache_dir
    demos = [{"name": m.name, "kind": m.kind, "status": demo_status(m, cache), "description": m.description}
             for m in DEMO_MODELS.values()]
    tiers = {w: [t.model_dump() for t in getattr(settings.models, w)] for w in ("llm", "asr")}
    if args.json:
        _emit_json({"demo_models": demos, "tiers": tiers})
        return 0
    print(f"{'NAME':<18} {'KIND':<12} {'STATUS':<26} DESCRIPTION")
    for d in demos:
        print(f"{d['name']:<18} {d['kind']:<12} {d['status']:<26} {d['description']}")
    print("\nconfigured tiers (heaviest first):")
    for workload, items in tiers.items():
        for t in items:
            print(f"  {workload}: {t['name']:<8} {t['model']:<18} {t['backend']} {t['device']} {t['precision']}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from .backends import SessionOptions
    from .config import load_settings
    from .models.catalog import resolve_model
    from .models.llm import DecoderLM
    from .models.sampling import SamplingParams
    from .models.tokenizer import Message
    from .progress import Progress
    from .serving.scheduler import LLMScheduler, Limits

    settings = load_settings(args.config)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
        top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
        seed=args.seed, stop=tuple(args.stop),
    )
    if not args.prompt.strip():
        raise InputError("the prompt is empty")
    tier = settings.models.llm[0]
    model = args.model or tier.model
    backend = args.backend or (tier.backend if not args.model else "onnxruntime")
    device = args.device or (tier.device if not args.model else "cpu")
    with Progress("preparing demo weights", unit="MB", enabled=not args.json) as bar:
        ref = resolve_model(model, settings.models.cache_dir,
                            progress=lambda done, total: bar.update(done / 1e6, total / 1e6))
    t_load = time.perf_counter()
    options = SessionOptions(device=device, threads=settings.device.threads, cache_dir=settings.engines.cache_dir)
    lm = DecoderLM.open(ref, backend, options)
    load_ms = (time.perf_counter() - t_load) * 1e3
    tok = lm.tokenizer
    ids = tok.encode(args.prompt) if args.raw or not tok.chat_template else tok.encode_chat([Message("user", args.prompt)])
    scheduler = LLMScheduler(lm, Limits(max_batch=1, batch_timeout_ms=0)).start()
    try:
        handle = scheduler.submit(ids, params)
        for event in handle:
            if event.text and not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
        done = handle.result()
    finally:
        scheduler.stop()
        lm.close()
    t = done.timing
    decode_tps = 1e3 / (sum(t.itl_ms) / len(t.itl_ms)) if t.itl_ms else None
    result = {
        "model": ref.name, "backend": backend, "device": device, "text": done.text,
        "token_ids": list(done.token_ids), "finish_reason": done.finish_reason,
        "prompt_tokens": len(ids), "new_tokens": t.tokens_out,
        "ttft_ms": _ms(t.ttft_ms), "e2e_ms": _ms(t.e2e_ms), "tpot_ms": _ms(t.tpot_ms),
        "queue_ms": _ms(t.queue_ms), "prefill_ms": _ms(t.prefill_ms),
        "decode_tokens_per_s": round(decode_tps, 1) if decode_tps else None, "load_ms": round(load_ms, 1),
    }
    if args.json:
        _emit_json(result)
    else:
        sys.stdout.write("\n")
        print(
            f"[{ref.name} · {backend}/{device}] prompt {len(ids)} tok · TTFT {result['ttft_ms']} ms · "
            f"{t.tokens_out} tok in {result['e2e_ms']} ms · decode {result['decode_tokens_per_s']} tok/s · "
            f"{done.finish_reason} · load {load_ms:.0f} ms",
            file=sys.stderr,
        )
    return 0


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
