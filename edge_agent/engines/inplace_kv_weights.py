"""The weights and architecture of a plain Phi-3 / Gemma / Gemma-2 / Gemma 3 decoder export, recovered without torch.

A plain export (``optimum-cli export onnx`` / ``torch.onnx.export``) names its nodes after the
PyTorch modules (``/model/model/layers.0/self_attn/q_proj/MatMul``, optimum: ``/model/layers.0/…``);
its Linear weights are transposed ``MatMul`` initializers (often ``onnx::MatMul_123``), and norm
weights may be shared between norms, reached through ``Identity`` nodes, or folded with Gemma's
``1 + w``. So each weight is found by the module of the node that consumes it and read as the value
that node actually multiplies with (constant subgraphs are evaluated), which covers the usual
variants: fused ``qkv_proj`` / ``gate_up_proj`` (Phi-3) or separate q/k/v and gate/up (Gemma), tied
embeddings (``MatMul(x, Transpose(table))``), Gemma's embedding scale (the ``Mul`` after the
``Gather``), Gemma 3's per-head q/k norms (weights of the head size) and four norms per layer. The
architecture (heads, rope bases per layer, soft-caps, sliding windows) comes from ``config.json``
(``gemma3``'s multimodal config: its ``text_config``);
what this converter cannot reproduce is refused with a ``ModelError`` naming the key or the module.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ModelError

_LAYER = re.compile(r"^layers\.(\d+)$")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_ACTIVATIONS.update({"gelu_fast": "gelu_tanh", "gelu": "gelu"})
FAMILIES = ("phi3", "gemma", "gemma2", "gemma3_text", "gemma3")
GEMMA3 = ("gemma3_text", "gemma3")
SANDWICH = ("gemma2", *GEMMA3)  # post-attention, pre- and post-feed-forward norms around each block
GEMMA3_SLIDING_PATTERN = 6  # before layer_types: every 6th layer attends globally (transformers' Gemma3TextConfig)


@dataclass(frozen=True, slots=True)
class Arch:
    """What the in-place graph needs from ``config.json`` (validated: unsupported keys are refused)."""

    family: str  # one of FAMILIES
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    activation: str  # silu | gelu_tanh | gelu
    rope_thetas: tuple[float, ...]  # per layer (Gemma 3: a local base on sliding layers, the global one on full)
    rotary_dim: int
    context: int
    scale: float  # attention logit scale
    attn_softcap: float  # 0 = none
    final_softcap: float  # 0 = none
    windows: tuple[int, ...]  # per layer: sliding window in tokens (its own key included), -1 = global

    @property
    def qk_norm(self) -> bool:
        """Per-head RMS norms of the queries and keys before the rotary embedding (Gemma 3)."""
        return self.family in GEMMA3

    @property
    def sandwich(self) -> bool:
        """Norms after the attention and the MLP as well as before them (Gemma-2, Gemma 3)."""
        return self.family in SANDWICH


@dataclass(slots=True)
class DecoderWeights:
    """Float32 weights in ``x @ W`` orientation ([in, out]), keyed the way the graph builder reads them."""

    embed: np.ndarray  # [vocab, hidden]
    embed_scale: float | None  # Gemma: the Mul after the Gather (sqrt(hidden)); None: no scaling
    lm_head: np.ndarray  # [hidden, vocab]
    final_norm: np.ndarray
    layers: list[dict[str, np.ndarray]] = field(default_factory=list)  # qkv, o, gate_up, down, norms


def read_arch(folder: Path) -> Arch:
    """The architecture from ``folder/config.json``; unsupported settings raise ``ModelError`` naming the key."""
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: cannot read the model config ({exc})") from exc
    family = cfg.get("model_type")
    if family == "gemma3" and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "model_type": family}  # Gemma3ForConditionalGeneration: the text decoder's
    if family not in FAMILIES:
        raise ModelError(f"{path}: model_type {family!r} has no in-place KV conversion (supported: {FAMILIES})")
    try:
        heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        vocab, eps = int(cfg["vocab_size"]), float(cfg["rms_norm_eps"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"{path}: missing or bad key {exc}") from exc
    act_key = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    act = _ACTIVATIONS.get(str(cfg.get(act_key)))
    if act is None:
        raise ModelError(
            f"{path}: {act_key} = {cfg.get(act_key)!r} is not supported (supported: {sorted(_ACTIVATIONS)})"
        )
    rope = dict(cfg.get("rope_parameters") or {})
    # transformers 5 keeps Gemma 3's two rotary embeddings apart: rope_parameters.{full,sliding}_attention
    by_type = {t: dict(rope.pop(t) or {}) for t in ("full_attention", "sliding_attention") if t in rope}
    for key, params in [("rope_parameters", rope)] + [(f"rope_parameters.{t}", p) for t, p in by_type.items()]:
        _default_rope_only(path, f"{key}.rope_type", params.get("rope_type"))
    scaling = cfg.get("rope_scaling") or {}
    _default_rope_only(path, "rope_scaling", scaling.get("rope_type") or scaling.get("type"))
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    theta = float(by_type.get("full_attention", {}).get("rope_theta", theta))
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    scale = head_dim**-0.5
    if family in SANDWICH:
        scale = float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5
    windows = _windows(cfg, family, layers, path)
    thetas = (theta,) * layers
    if family in GEMMA3:  # sliding layers rotate with the local base (transformers' rotary_emb_local)
        local = float(by_type.get("sliding_attention", {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        thetas = tuple(local if w > 0 else theta for w in windows)
    return Arch(
        family=family,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        eps=eps,
        activation=act,
        rope_thetas=thetas,
        rotary_dim=rotary_dim,
        context=int(cfg.get("max_position_embeddings", 4096)),
        scale=scale,
        attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        windows=windows,
    )


def _default_rope_only(path: Path, key: str, rope_type: str | None) -> None:
    if (rope_type or "default") != "default":
        raise ModelError(
            f"{path}: {key} = {rope_type!r}: only the default rotary embedding is converted to the in-place KV "
            f"layout (longrope/su/linear/dynamic scaling is not); serve the plain export as it is"
        )


def _windows(cfg: dict, family: str, layers: int, path: Path) -> tuple[int, ...]:
    window = cfg.get("sliding_window")
    if not window:
        return (-1,) * layers
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != layers:
            raise ModelError(f"{path}: layer_types has {len(types)} entries for {layers} layers")
        return tuple(int(window) if t == "sliding_attention" else -1 for t in types)
    if family == "gemma2":  # before layer_types: even layers slide (Gemma2DecoderLayer.is_sliding)
        return tuple(int(window) if i % 2 == 0 else -1 for i in range(layers))
    if family in GEMMA3:
        pattern = int(cfg.get("sliding_window_pattern") or GEMMA3_SLIDING_PATTERN)
        return tuple(-1 if (i + 1) % pattern == 0 else int(window) for i in range(layers))
    return (int(window),) * layers  # Phi-3 (mistral-style): every layer slides


class _Consts:
    """Values of constant tensors: initializers, Constant nodes, and nodes computed only from those."""

    def __init__(self, graph) -> None:
        from onnx import numpy_helper

        self._np = numpy_helper
        self.inits = {i.name: i for i in graph.initializer}
        self.producer = {o: n for n in graph.node for o in n.output}
        self._memo: dict[str, np.ndarray | None] = {}

    def value(self, name: str, depth: int = 0) -> np.ndarray | None:
        if name in self._memo:
            return self._memo[name]
        out: np.ndarray | None = None
        if name in self.inits:
            out = self._np.to_array(self.inits[name])
        elif name in self.producer and depth < 16:
            node = self.producer[name]
            if node.op_type == "Constant":
                out = self._np.to_array(node.attribute[0].t) if node.attribute[0].name == "value" else None
            elif node.op_type not in ("Shape", "Size", "ConstantOfShape") and node.input:
                args = [self.value(i, depth + 1) for i in node.input if i]
                if all(a is not None for a in args):
                    from onnx.reference import ReferenceEvaluator

                    feeds = dict(zip([i for i in node.input if i], args))
                    results = list(ReferenceEvaluator(node).run(None, feeds))
                    out = np.asarray(results[list(node.output).index(name)])
        self._memo[name] = out
        return out


def _module(node_name: str) -> tuple[int | None, str]:
    """``/model/model/layers.3/self_attn/q_proj/MatMul`` -> (3, "self_attn.q_proj"); outside layers: (None, path)."""
    parts = [p for p in node_name.split("/") if p][:-1]
    for i, p in enumerate(parts):
        if m := _LAYER.match(p):
            return int(m.group(1)), ".".join(parts[i + 1 :])
    while parts and parts[0] == "model":
        parts = parts[1:]
    return None, ".".join(parts)


def recover(model, arch: Arch, where: str) -> DecoderWeights:
    """The weights of ``model`` (an ``onnx.ModelProto`` with its external data loaded); ``where`` names it in errors."""
    consts = _Consts(model.graph)
    linear: dict[tuple[int | None, str], np.ndarray] = {}
    norms: dict[tuple[int | None, str], np.ndarray] = {}
    embed = scale = None
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    for node in model.graph.node:
        key = _module(node.name)
        if node.op_type in ("MatMul", "Gemm") and len(node.input) >= 2:
            w = consts.value(node.input[1])
            if w is not None and w.ndim == 2:
                if node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute):
                    w = w.T
                linear[key] = w.astype(np.float32, copy=False)  # no second copy of a float32 weight
        elif node.op_type == "Mul" and key[1].endswith("norm"):
            # q_norm / k_norm (Gemma 3) weigh each head: their weights have the head size
            size = arch.head_dim if key[1].endswith(("q_norm", "k_norm")) else arch.hidden
            for name in node.input:
                w = consts.value(name)
                if w is not None and w.shape == (size,):
                    norms[key] = w.astype(np.float32)
        elif node.op_type == "Gather" and "input_ids" in node.input[1:]:
            table = consts.value(node.input[0])
            if table is not None and table.ndim == 2:
                embed = table.astype(np.float32, copy=False)
                for use in consumers.get(node.output[0], []):
                    factors = [consts.value(i) for i in use.input if i != node.output[0]]
                    if use.op_type == "Mul" and factors and factors[0] is not None and factors[0].size == 1:
                        scale = float(factors[0].reshape(()))
    if embed is None:
        raise ModelError(f"{where}: no embedding table (a Gather of a constant [vocab, hidden] table by input_ids)")
    if arch.family != "phi3" and scale is None:
        scale = float(np.float32(math.sqrt(arch.hidden)))  # Gemma scales the embedding; the export hid the Mul
    found = {f"{'' if k[0] is None else f'layers.{k[0]}.'}{k[1]}" for k in (*linear, *norms)}

    def need(table: dict, layer: int | None, *names: str) -> np.ndarray:
        for n in names:
            if (layer, n) in table:
                return table[(layer, n)]
        where_layer = "" if layer is None else f"layers.{layer}."
        raise ModelError(
            f"{where}: no weight for module {where_layer}{names[0]} (looked for {', '.join(names)} by the node names "
            f"of a torch.onnx/optimum export; found {len(found)} modules, e.g. {sorted(found)[:6]})"
        )

    out = DecoderWeights(
        embed=embed,
        embed_scale=scale,
        lm_head=need(linear, None, "lm_head"),
        final_norm=need(norms, None, "norm", "model.norm", "language_model.norm", "model.language_model.norm"),
    )
    for i in range(arch.layers):
        layer = {}
        if (i, "self_attn.qkv_proj") in linear:
            layer["qkv"] = linear[(i, "self_attn.qkv_proj")]
        else:
            parts = [need(linear, i, f"self_attn.{p}_proj") for p in "qkv"]
            layer["qkv"] = np.concatenate(parts, axis=1)
        layer["o"] = need(linear, i, "self_attn.o_proj")
        if (i, "mlp.gate_up_proj") in linear:
            layer["gate_up"] = linear[(i, "mlp.gate_up_proj")]
        else:
            layer["gate_up"] = np.concatenate([need(linear, i, "mlp.gate_proj"), need(linear, i, "mlp.up_proj")], 1)
        layer["down"] = need(linear, i, "mlp.down_proj")
        norm_names = ["input_layernorm", "post_attention_layernorm"]
        if arch.sandwich:
            norm_names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        if arch.qk_norm:
            norm_names += ["self_attn.q_norm", "self_attn.k_norm"]
        for n in norm_names:
            layer[n] = need(norms, i, n)
        _check_shapes(layer, arch, i, where)
        out.layers.append(layer)
    if out.lm_head.shape != (arch.hidden, arch.vocab) and out.lm_head.shape[0] != arch.hidden:
        raise ModelError(f"{where}: lm_head weight is {out.lm_head.shape}, expected ({arch.hidden}, vocab)")
    return out


def _check_shapes(layer: dict[str, np.ndarray], arch: Arch, i: int, where: str) -> None:
    qkv = (arch.heads + 2 * arch.kv_heads) * arch.head_dim
    want = {"qkv": (arch.hidden, qkv), "o": (arch.heads * arch.head_dim, arch.hidden)}
    for name, shape in want.items():
        if layer[name].shape != shape:
            raise ModelError(
                f"{where}: layers.{i} {name} weight is {layer[name].shape}, but config.json (heads {arch.heads}, "
                f"kv heads {arch.kv_heads}, head_dim {arch.head_dim}) gives {shape}"
            )
    if layer["gate_up"].shape[1] != 2 * layer["down"].shape[0]:
        raise ModelError(
            f"{where}: layers.{i} gate/up {layer['gate_up'].shape} do not match down {layer['down'].shape}"
        )
