"""``edge-agent generate``: text from a prompt, streaming tokens as they come."""

from __future__ import annotations

import argparse
import sys
import time

from ..errors import InputError
from .common import add_common, emit_json


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streaming tokens as they come")
    add_common(p)
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


def cmd_generate(args: argparse.Namespace) -> int:
    from ..backends import SessionOptions
    from ..config import load_settings
    from ..models.catalog import resolve_model
    from ..models.llm import DecoderLM
    from ..models.sampling import SamplingParams
    from ..models.tokenizer import Message
    from ..progress import Progress
    from ..serving.llm.scheduler import Limits, LLMScheduler

    settings = load_settings(args.config)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=0.0 if args.greedy else args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    if not args.prompt.strip():
        raise InputError("the prompt is empty")
    tier = settings.models.llm[0]
    model = args.model or tier.model
    backend = args.backend or (tier.backend if not args.model else "onnxruntime")
    device = args.device or (tier.device if not args.model else "cpu")
    with Progress("preparing demo weights", unit="MB", enabled=not args.json) as bar:
        ref = resolve_model(
            model, settings.models.cache_dir, progress=lambda done, total: bar.update(done / 1e6, total / 1e6)
        )
    t_load = time.perf_counter()
    options = SessionOptions(device=device, threads=settings.device.threads, cache_dir=settings.engines.cache_dir)
    lm = DecoderLM.open(ref, backend, options)
    load_ms = (time.perf_counter() - t_load) * 1e3
    tok = lm.tokenizer
    chat = not args.raw and tok.chat_template
    ids = tok.encode_chat([Message("user", args.prompt)]) if chat else tok.encode(args.prompt)
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
        "model": ref.name,
        "backend": backend,
        "device": device,
        "text": done.text,
        "token_ids": list(done.token_ids),
        "finish_reason": done.finish_reason,
        "prompt_tokens": len(ids),
        "new_tokens": t.tokens_out,
        "ttft_ms": _ms(t.ttft_ms),
        "e2e_ms": _ms(t.e2e_ms),
        "tpot_ms": _ms(t.tpot_ms),
        "queue_ms": _ms(t.queue_ms),
        "prefill_ms": _ms(t.prefill_ms),
        "decode_tokens_per_s": round(decode_tps, 1) if decode_tps else None,
        "load_ms": round(load_ms, 1),
    }
    if args.json:
        emit_json(result)
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
