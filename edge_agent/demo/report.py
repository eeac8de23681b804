"""The demo's closing report: the summary table and the latency plot (PNG)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..metrics.window import nearest_rank


@dataclass
class Record:
    """What the demo observed: chat and speech latencies, failures, tiers over time and the fleet's view."""

    chats: list[tuple[float, float, float, str]] = field(default_factory=list)  # t, ttft ms, e2e ms, tier
    sent: int = 0  # chat requests sent: completed (chats) + refused + cancelled + failed
    refused: list[tuple[float, int, str, float]] = field(default_factory=list)  # t, HTTP status, reason, answer ms
    cancelled: int = 0  # chats still unanswered when the demo ended
    failed: list[str] = field(default_factory=list)
    speech: list[tuple[float, float, str, str]] = field(default_factory=list)  # t, final_ms, heard, said
    tiers: list[tuple[float, str]] = field(default_factory=list)
    fleet: list[tuple[float, float | None, float | None]] = field(default_factory=list)
    switches: list[dict] = field(default_factory=list)
    actions: list[dict] = field(default_factory=list)  # spoken commands turned into tool calls, judged
    replies: list[tuple[str, str]] = field(default_factory=list)  # chat prompts and the replies shown at the end
    load: dict = field(default_factory=dict)  # the chat rates and the capacity they were sized from


def _fmt(v) -> str:
    return "—" if v is None else f"{v:.0f}"


def summarize(rec: Record) -> dict:
    from ..metrics.wer import error_rates

    ttft = sorted(c[1] for c in rec.chats)
    e2e = sorted(c[2] for c in rec.chats)
    finals = sorted(s[1] for s in rec.speech)
    answered = sorted(r[3] for r in rec.refused)
    reasons: dict[str, int] = {}
    for _, status, reason, _ in rec.refused:
        reasons[f"{status} {reason}"] = reasons.get(f"{status} {reason}", 0) + 1
    out = {
        "chat_sent": rec.sent,
        "chat_requests": len(rec.chats),
        "refused": len(rec.refused),
        "refused_by": reasons,
        "refusal_ms": {p: nearest_rank(answered, q) for p, q in (("p50", 50), ("p95", 95))},
        "cancelled": rec.cancelled,
        "failed": len(rec.failed),
        "failures": rec.failed[:5],
        "ttft_ms": {p: nearest_rank(ttft, q) for p, q in (("p50", 50), ("p95", 95), ("p99", 99))},
        "e2e_ms": {p: nearest_rank(e2e, q) for p, q in (("p50", 50), ("p95", 95))},
        "spoken_commands": len(rec.speech),
        "asr_final_ms": {p: nearest_rank(finals, q) for p, q in (("p50", 50), ("p95", 95))},
        "tier_switches": len(rec.switches),
        "served_by": {m: sum(1 for c in rec.chats if c[3] == m) for m in sorted({c[3] for c in rec.chats})},
    }
    if rec.speech:
        out["asr_wer"] = error_rates((s[3], s[2]) for s in rec.speech)[0].rate
    turns = sorted(a["turn_ms"] for a in rec.actions if a["call"] is not None and a["turn_ms"] is not None)
    out["tool_calls"] = {
        "commands": len(rec.actions),
        "calls": len(turns),
        "right": sum(1 for a in rec.actions if a.get("right")),
        "turn_ms": {p: nearest_rank(turns, q) for p, q in (("p50", 50), ("p95", 95))},
        "wrong": [a for a in rec.actions if not a.get("right")][:10],
        "examples": [a for a in rec.actions if a.get("right")][:3],
    }
    out["switches"] = [
        {"t_s": sw.get("t_s"), "from": sw.get("from"), "to": sw.get("to"), "reason": sw.get("reason")}
        for sw in rec.switches
    ]
    out["chat_replies"] = rec.replies
    return out


def _shown(a: dict) -> str:
    if a.get("call"):
        return f"{a['call']['name']} {json.dumps(a['call']['arguments'])}"
    if a.get("error"):
        return f"no action ({a['error']})"
    text = a.get("text", "")
    return f"no action: {text if len(text) <= 60 else text[:60] + '…'!r}"


def format_summary(s: dict) -> str:
    f = _fmt
    lines = [
        "",
        "summary",
        f"  chat requests      {s['chat_sent']} sent: {s['chat_requests']} admitted and completed, "
        f"{s['refused']} refused, {s['cancelled']} cancelled, {s['failed']} failed",
        f"  refused            {s['refused_by'] or 'none'}; answered in P50 {f(s['refusal_ms']['p50'])} · "
        f"P95 {f(s['refusal_ms']['p95'])} ms",
        f"  chat TTFT          P50 {f(s['ttft_ms']['p50'])} · P95 {f(s['ttft_ms']['p95'])} · "
        f"P99 {f(s['ttft_ms']['p99'])} ms (admitted chats, as clients saw it)",
        f"  chat e2e           P50 {f(s['e2e_ms']['p50'])} · P95 {f(s['e2e_ms']['p95'])} ms",
        f"  served by          {s['served_by']}",
        f"  tier switches      {s['tier_switches']}",
        f"  spoken commands    {s['spoken_commands']}, final P50 {f(s['asr_final_ms']['p50'])} · "
        f"P95 {f(s['asr_final_ms']['p95'])} ms from end of speech"
        + (f", WER {s['asr_wer'] * 100:.1f} %" if "asr_wer" in s else ""),
    ]
    calls = s["tool_calls"]
    if calls["commands"]:
        lines.append(
            f"  voice → tool call  {calls['right']} of {calls['commands']} right (name and arguments); "
            f"{calls['calls']} calls, turn P50 {f(calls['turn_ms']['p50'])} · P95 {f(calls['turn_ms']['p95'])} ms "
            "(end of speech → complete call)"
        )
        for a in calls["examples"]:
            lines.append(f"    right: {a['heard']!r} → {_shown(a)}")
        for a in calls["wrong"]:
            want = (
                f"{a['expected']['name']} {json.dumps(a['expected']['arguments'])}" if a.get("expected") else "no call"
            )
            lines.append(f"    wrong: said {a.get('said', '')!r}, heard {a['heard']!r} → {_shown(a)}; expected {want}")
    for sw in s.get("switches", []):
        lines.append(f"  switch at {sw['t_s']} s  {sw['from']} → {sw['to']}: {sw['reason']}")
    for prompt, reply in s.get("chat_replies", []):
        lines.append(f"  chat  {prompt!r} → {reply!r}")
    for failure in s["failures"]:
        lines.append(f"  failure: {failure}")
    return "\n".join(lines)


def plot(rec: Record, path: Path) -> Path:
    from ..bench.plot import pyplot

    plt = pyplot()
    fig, (ax, ax_tier) = plt.subplots(2, 1, figsize=(12, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.scatter([c[0] for c in rec.chats], [c[1] for c in rec.chats], s=10, label="admitted chat TTFT (client)")
    if rec.refused:
        ax.scatter(
            [r[0] for r in rec.refused],
            [max(r[3], 1.0) for r in rec.refused],
            s=14,
            marker="x",
            color="red",
            label="refused chat (time to its 429)",
        )
    if rec.speech:
        ax.scatter([s[0] for s in rec.speech], [s[1] for s in rec.speech], s=25, marker="^", label="ASR final latency")
    fleet = [(t, p) for t, p, _ in rec.fleet if p is not None]
    if fleet:
        ax.plot(
            [t for t, _ in fleet],
            [p for _, p in fleet],
            color="black",
            linewidth=1,
            label="fleet TTFT P95 (MQTT histograms)",
        )
    ax.axhline(387, color="red", linestyle="--", linewidth=1, label="SLA 387 ms")
    for sw in rec.switches:
        ax.axvline(sw["t_s"], color="gray", linestyle=":")
    ax.set_yscale("log")
    ax.set_ylabel("ms (log)")
    ax.legend(loc="upper left", fontsize=8)
    names = sorted({t for _, t in rec.tiers})
    ax_tier.step([t for t, _ in rec.tiers], [names.index(x) for _, x in rec.tiers], where="post")
    ax_tier.set_yticks(range(len(names)), names)
    ax_tier.set_xlabel("seconds")
    ax_tier.set_ylabel("LLM tier")
    fig.suptitle("edge-agent demo: latency under a chat burst and spoken commands")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
