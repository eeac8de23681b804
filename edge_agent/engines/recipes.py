"""Engine recipes: one TOML file per model in ``engines/``, validated into a ``Recipe``.

A recipe says which model to build from, for which workload, targets and precisions, with which
shape profiles, which calibration and held-out data, and how much accuracy an engine may lose::

    name = "demo-phi3-small"
    model = "demo-phi3-small"          # demo name or model folder (relative to the recipe file)
    workload = "llm"                   # llm | asr
    targets = ["cpu", "jetson", "intel-npu"]
    precisions = ["fp32", "fp16", "int8", "int8w", "int4"]   # int8w, int4: weight-only (LLMs)
    kv_layout = "inplace"              # LLM, ONNX Runtime: plain exports get the in-place KV graph | "plain"
                                       #   or per precision: { int8w = "plain" } (those not named: "inplace")
    graphs = []                        # Whisper: its three graphs, each built at the precision (whisper_engine)
    float_graphs = []                  # of those, the ones kept FP32 at every precision (e.g. the decoders)

    [weight_only]                      # how int8w / int4 weights are made (no calibration data needed)
    block_size = 32                    # weights per scale along K (ORT MatMulNBits block, NNCF group size),
                                       #   or per precision: { int8w = 32, int4 = 128 } (those not named: 32)
    symmetric = true                   # no zero points (ORT: is_symmetric; NNCF: INT4_SYM / INT8_SYM, else *_ASYM)
    algorithm = "rtn"                  # ORT int4: rtn | rtn_asym | kquant | hqq | gptq (gptq needs calibration)
    accuracy_level = 4                 # ORT MatMulNBits compute: 0 = float activations, 4 = int8 activations
    embedding_bits = 0                 # ORT: 8 = embedding tables as 8-bit blocks too (GatherBlockQuantized)
    head_bits = 0                      # ORT: the LM head's own bits (0: as the precision's), e.g. 8 in int4
    head_block_size = 0                # ORT: the LM head's own block size (0: block_size), or { int4 = 128 }

    [weight_only.openvino]             # OpenVINO int4: NNCF's options (absent: data-free, every matmul at 4 bits)
    awq = false                        # activation-aware scaling (needs weight_only.calibration, as the next two)
    scale_estimation = false           # group scales fitted to the calibration activations
    gptq = false                       # NNCF's GPTQ
    ratio = 1.0                        # share of the ratio-defining weights at INT4, the rest at backup_mode
    sensitivity_metric = "hessian_input_activation"   # which weights stay at the backup precision (ratio < 1)
    backup_mode = "int8_asym"          # int8_asym | int8_sym | none

    [dynamic]                          # Whisper's dynamic INT8 (graphs): the encoder's matmuls kept FP32
    max_state_error = 0.05             # the costliest kept FP32 until the encoder's states on the [calibration]
                                       #   audio are within this relative error of FP32's (0: every one INT8)

    [calibration]                      # INT8 activation ranges come from here (Whisper: [dynamic]'s audio)
    data = "../calibration/llm/prompts.jsonl"
    samples = 64
    method = "minmax"                  # minmax | entropy | percentile
    max_tokens = 64                    # LLM prompts are cut to this many tokens
    ignored_types = []                 # op types to keep in float, e.g. ["GRU"]

    [heldout]                          # what the accuracy gate compares on (never the calibration set)
    data = "../calibration/llm/heldout.jsonl"
    samples = 16

    [accuracy]                         # the budget an engine must stay within
    min_cosine = 0.99
    min_top1 = 0.90
    max_kl = 0.05
    max_wer_delta = 0.02
    max_ppl_increase_pct = 1.0         # LLM with [perplexity]: perplexity at most 1 % over FP32's
    min_greedy_agreement = 0.95        # LLM with [perplexity]: share of scored tokens whose argmax is FP32's

    [perplexity]                       # LLM: held-out text the gate scores by perplexity (as `eval llm`)
    data = "../calibration/llm/text/python-reference.txt"   # a text file or a {"text"} JSONL manifest
    max_tokens = 4096                  # score the text's first N tokens (0: all of it)
    window = 1024                      # tokens per window (BOS first in each), a new window every stride
    stride = 512
    chunk = 256                        # tokens per model call, KV cache carried

    [[profiles]]                       # one optimization profile: named dims -> [min, opt, max]
    name = "prefill"
    dims = { batch_size = [1, 1, 4], sequence_length = [1, 64, 512], past_sequence_length = [0, 0, 0] }

Where recipes are found: ``--recipe NAME`` (and the daemon's background builds) look for
``NAME.toml`` in ``engines.recipes_dir`` first (a user folder: ``/etc/edge-agent/engines`` under
systemd, ``~/.config/edge-agent/engines`` otherwise), then among the shipped recipes (the
repository's ``engines/``, package data in a wheel). A user's file hides a shipped one of the same name.

A relative path in a recipe (``model``, ``data``) is taken relative to the recipe file; when nothing
is there, relative to the shipped ``engines/`` folder. So a shipped recipe copied into the user
folder keeps finding ``../calibration/...`` in the shipped data, unless the user puts a
``calibration/`` folder beside the copy's folder, which then wins.

Every problem is reported as ``dotted.path: message`` through ``ConfigError``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from ..backends.npu import LlmShape
from ..config import validation_problems
from ..errors import ConfigError
from ..shipped import engines_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Target = Literal["cpu", "jetson", "intel-npu"]
BuildPrecision = Literal["fp32", "fp16", "int8", "int8w", "int4"]
KvLayout = Literal["inplace", "plain"]
# The ladder's top rung: its budget is the recipe's [accuracy]; lower rungs are named in [rungs.NAME].
TOP_RUNG = "top"
# Weight-only precisions: only the weights are quantized (int8w: 8 bits, int4: 4 bits, per block); LLMs only.
WEIGHT_ONLY: dict[str, int] = {"int8w": 8, "int4": 4}
Method = Literal["minmax", "entropy", "percentile"]
Workload = Literal["llm", "asr"]

# The runtime each target builds for, first choice first.
TARGET_BACKENDS: dict[str, tuple[str, ...]] = {
    "cpu": ("onnxruntime", "openvino"),
    "jetson": ("tensorrt",),
    "intel-npu": ("openvino",),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataRef(_Strict):
    """A JSONL manifest of samples, relative to the recipe file, and how many to use."""

    data: Path = Field(description="JSONL manifest, relative to the recipe file")
    samples: int = Field(64, ge=1, le=100_000, description="use at most this many records")


class CalibrationSpec(DataRef):
    """The calibration data and method for INT8, and the op types kept in float."""

    method: Method = "minmax"
    max_tokens: int = Field(64, ge=2, le=8192, description="LLM prompts are cut to this many tokens")
    ignored_types: list[str] = Field(
        default_factory=list, description="op types kept in float (ORT: not quantized; NNCF: ignored scope)"
    )


class AccuracyBudget(_Strict):
    """How far a candidate may drift from FP32 and still pass the gate."""

    min_cosine: float = Field(0.99, ge=0.0, le=1.0, description="LLM: mean logits cosine vs FP32")
    min_top1: float = Field(0.90, ge=0.0, le=1.0, description="LLM: top-1 agreement with FP32")
    max_kl: float = Field(0.05, ge=0.0, description="LLM: mean KL(FP32 || candidate) per step, nats")
    max_wer_delta: float = Field(0.02, ge=0.0, le=1.0, description="ASR: WER increase allowed over FP32")
    max_ppl_increase_pct: float | None = Field(
        None, ge=0.0, description="LLM with [perplexity]: perplexity increase over FP32 allowed, percent"
    )
    min_greedy_agreement: float | None = Field(
        None, ge=0.0, le=1.0, description="LLM with [perplexity]: share of scored tokens whose argmax is FP32's"
    )

    @property
    def judges_perplexity(self) -> bool:
        """A perplexity budget is set: then the logits metrics are gated only where the recipe sets them."""
        return self.max_ppl_increase_pct is not None or self.min_greedy_agreement is not None

    def logits_limits(self) -> dict[str, float]:
        """The logits budgets to gate: all three, or with a perplexity budget only those the recipe sets."""
        limits = {"min_cosine": self.min_cosine, "min_top1": self.min_top1, "max_kl": self.max_kl}
        if self.judges_perplexity:
            return {k: v for k, v in limits.items() if k in self.model_fields_set}
        return limits


class PerplexitySpec(_Strict):
    """Held-out text the gate scores by perplexity (LLMs), with the windows of ``edge-agent eval llm``."""

    data: Path = Field(description="a UTF-8 text file or a JSONL manifest of {text} lines, relative to the recipe")
    max_tokens: int = Field(4096, ge=0, description="score the text's first N tokens (0: all of it)")
    window: int = Field(
        1024, ge=1, le=131072, description="tokens per window; BOS first in each when the model has one"
    )
    stride: int = Field(512, ge=1, le=131072, description="tokens between window starts (at most window)")
    chunk: int = Field(256, ge=1, le=8192, description="tokens per model call, the KV cache carried")

    @model_validator(mode="after")
    def _covered(self) -> PerplexitySpec:
        if self.stride > self.window:
            raise ValueError(f"stride {self.stride} > window {self.window} would leave tokens out of every window")
        return self


SensitivityMetric = Literal[
    "weight_quantization_error",
    "hessian_input_activation",
    "mean_activation_variance",
    "max_activation_variance",
    "mean_activation_magnitude",
]


class OpenVinoInt4Spec(_Strict):
    """``[weight_only.openvino]``: NNCF's INT4 weight compression options (``nncf.compress_weights``) for
    OpenVINO builds; the data-aware ones run on ``weight_only.calibration``'s tokens."""

    awq: bool = Field(False, description="activation-aware weight quantization (needs calibration)")
    scale_estimation: bool = Field(False, description="group scales fitted on the calibration activations")
    gptq: bool = Field(False, description="NNCF's GPTQ on the calibration activations")
    ratio: float = Field(1.0, gt=0.0, le=1.0, description="share of the ratio-defining weights at INT4")
    sensitivity_metric: SensitivityMetric | None = Field(
        None,
        description="which weights keep the backup precision when ratio < 1 (default: NNCF's, "
        "hessian_input_activation with calibration, weight_quantization_error without)",
    )
    backup_mode: Literal["int8_asym", "int8_sym", "none"] = Field(
        "int8_asym", description="the precision of the weights ratio leaves out of INT4"
    )
    subset_size: int = Field(128, ge=1, le=100_000, description="calibration windows NNCF uses at most")

    def data_aware(self) -> list[str]:
        """The keys set here that need calibration activations."""
        keys = [k for k in ("awq", "scale_estimation", "gptq") if getattr(self, k)]
        if self.sensitivity_metric not in (None, "weight_quantization_error"):
            keys.append("sensitivity_metric")
        return keys


_CALIBRATION_KEYS = (
    "calibration",
    "calibration_skip_tokens",
    "calibration_tokens",
    "sensitivity_tokens",
    "mixed_budget_pct",
)


DEFAULT_BLOCK_SIZE = 32


class WeightOnlySpec(_Strict):
    """How the weight-only precisions (int8w, int4) quantize MatMul weights, per backend's tool."""

    block_size: int | dict[Literal["int8w", "int4"], int] = Field(
        DEFAULT_BLOCK_SIZE,
        description="weights per scale along K (ORT block, NNCF group), or per precision: { int4 = 128 } "
        "(those not named: 32)",
    )
    symmetric: bool = Field(True, description="no zero points (NNCF *_SYM modes), else asymmetric (*_ASYM)")
    algorithm: Literal["rtn", "rtn_asym", "kquant", "hqq", "gptq"] = Field(
        "rtn",
        description="ONNX Runtime int4: rtn (symmetric, ONNX Runtime's); rtn_asym, kquant (searched asymmetric "
        "blocks), hqq (half-quadratic zero points), gptq (needs calibration): int4_methods",
    )
    accuracy_level: Literal[0, 1, 2, 3, 4] = Field(
        4, description="ONNX Runtime MatMulNBits compute type: 0 as the input (fp32), 4 int8 activations"
    )
    embedding_bits: Literal[0, 8] = Field(
        0, description="ONNX Runtime: 8 stores embedding tables as 8-bit blocks (GatherBlockQuantized), 0 float"
    )
    head_bits: Literal[0, 4, 8] = Field(
        0, description="ONNX Runtime: the LM head's own bits in both weight-only precisions (0: the precision's)"
    )
    head_block_size: int | dict[Literal["int8w", "int4"], int] = Field(
        0,
        description="ONNX Runtime: the LM head's block size (0: block_size), or per precision: { int4 = 128 } "
        "(those not named: block_size)",
    )
    calibration: Path | None = Field(
        None, description="ONNX Runtime: a text file (relative to the recipe) for kquant's importance, gptq, mixed"
    )
    calibration_skip_tokens: int = Field(0, ge=0, description="tokens of the calibration text skipped first")
    calibration_tokens: int = Field(2048, ge=2, le=65536, description="calibration tokens after the skipped ones")
    sensitivity_tokens: int = Field(
        512,
        ge=2,
        le=65536,
        description="calibration tokens the sensitivity pass scores: those after calibration_tokens",
    )
    mixed_budget_pct: float | None = Field(
        None,
        ge=0.0,
        description="ONNX Runtime int4: keep the layers at 8 bits that the sensitivity pass picks to stay within "
        "this perplexity increase on the calibration text (needs calibration)",
    )
    openvino: OpenVinoInt4Spec | None = Field(None, description="OpenVINO int4: NNCF's options (data-aware ones)")

    @model_validator(mode="after")
    def _calibrated(self) -> WeightOnlySpec:
        if self.algorithm == "gptq" and self.calibration is None:
            raise ValueError("calibration: algorithm 'gptq' needs a calibration text (weight_only.calibration)")
        if self.mixed_budget_pct is not None and self.calibration is None:
            raise ValueError("calibration: mixed_budget_pct (the sensitivity pass) needs a calibration text")
        needs = self.openvino.data_aware() if self.openvino is not None else []
        if needs and self.calibration is None:
            raise ValueError(f"calibration: openvino.{needs[0]} needs a calibration text (weight_only.calibration)")
        return self

    def for_precision(self, precision: str) -> WeightOnlySpec:
        """These settings as ``precision``'s engines get them: a per-precision ``block_size`` and
        ``head_block_size`` resolved (so its cache key is that of a recipe naming its values alone)."""
        update: dict[str, int] = {}
        if isinstance(self.block_size, dict):
            update["block_size"] = self.block_size.get(precision, DEFAULT_BLOCK_SIZE)  # type: ignore[call-overload]
        if isinstance(self.head_block_size, dict):
            update["head_block_size"] = self.head_block_size.get(precision, 0)  # type: ignore[call-overload]
        return self.model_copy(update=update) if update else self

    def base(self) -> WeightOnlySpec:
        """These settings with each per-precision value at its default (``block_size`` 32, the head's as the
        rest): what the recipe's fingerprint holds. A precision's own values are in its weight-only key part
        (``for_precision``), so naming one precision's value changes no other engine's key."""
        return self.for_precision("")

    @property
    def block(self) -> int:
        """The block size of these settings once resolved for one precision (``for_precision``)."""
        if isinstance(self.block_size, dict):
            raise TypeError("block_size is per precision here: resolve it with for_precision(precision) first")
        return self.block_size

    def unset_head(self) -> set[str]:
        """The head keys left at 0, the calibration keys left unset and an absent ``openvino`` table: kept out of
        cache keys, so engines built before they existed stay valid (of settings resolved for a precision, or
        ``base``)."""
        unset = {k for k in ("head_bits", "head_block_size") if not getattr(self, k)}
        unset |= {"openvino"} if self.openvino is None else set()
        return unset | (
            {k for k in _CALIBRATION_KEYS if k not in self.model_fields_set} if self.calibration is None else set()
        )

    def key(self) -> dict:
        """The cache key part: the calibration text by its content (sha256), not its path."""
        out = self.model_dump(mode="json", exclude=self.unset_head())
        if self.calibration is not None:
            try:
                digest = hashlib.sha256(Path(self.calibration).read_bytes()).hexdigest()
            except OSError as exc:
                raise ConfigError([("weight_only.calibration", f"cannot read {self.calibration}: {exc}")]) from exc
            out["calibration"] = {"name": Path(self.calibration).name, "sha256": digest}
        if self.mixed_budget_pct is not None:  # the pass once scored the first tokens the method fitted on
            out["sensitivity_slice"] = "after calibration_tokens"
        return out

    def ort_args(self, precision: str) -> dict:
        """``quantize_matmul_nbits``'s keyword arguments for ``precision``'s LLM graph (all but src, dst and
        bits)."""
        return self.for_precision(precision).model_dump(exclude={"openvino"})

    @field_validator("block_size", "head_block_size")
    @classmethod
    def _power_of_two(cls, size: int | dict[str, int], info: ValidationInfo) -> int | dict[str, int]:
        for one in size.values() if isinstance(size, dict) else [size]:
            if (one or info.field_name == "block_size") and (one < 16 or one > 4096 or one & (one - 1)):
                raise ValueError(f"block_size {one} must be a power of two from 16 to 4096 (16, 32, 64, 128, ...)")
        return size


class DynamicInt8Spec(_Strict):
    """``[dynamic]``: which of a Whisper encoder's matmuls its dynamic INT8 engine keeps FP32."""

    max_state_error: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="keep the matmuls whose INT8 costs most FP32 until the encoder's last states on the "
        "[calibration] audio are within this mean relative error (||int8 - fp32|| / ||fp32||) of FP32's; 0: none",
    )


class Profile(_Strict):
    """A shape profile: [min, opt, max] per dynamic dimension, optionally for some targets only."""

    name: str = Field(min_length=1)
    dims: dict[str, tuple[int, int, int]] = Field(description="dynamic dim name -> [min, opt, max]")
    targets: list[Target] | None = Field(None, description="only for these targets (default: all)")

    @field_validator("dims")
    @classmethod
    def _ordered(cls, dims: dict[str, tuple[int, int, int]]) -> dict[str, tuple[int, int, int]]:
        if not dims:
            raise ValueError("a profile needs at least one dim")
        for name, (lo, opt, hi) in dims.items():
            if lo < 0 or not lo <= opt <= hi:
                raise ValueError(f"dim {name!r}: need 0 <= min <= opt <= max, got [{lo}, {opt}, {hi}]")
        return dims

    @property
    def is_fixed(self) -> bool:
        return all(lo == hi for lo, _, hi in self.dims.values())

    def applies_to(self, target: str) -> bool:
        return self.targets is None or target in self.targets


class NpuLlmSpec(_Strict):
    """``[npu_llm]``: what the NPU plugin's LLM mode compiles for this model. The NPU pads every prompt
    to ``max_prompt`` and keeps ``max_prompt + min_response`` tokens of KV (both multiples of 64, as the
    plugin rounds them); a longer prompt is fed on in generate steps of ``generate_tokens``."""

    max_prompt: int = Field(1024, ge=64, le=32768, multiple_of=64, description="tokens prefilled at once")
    min_response: int = Field(128, ge=64, le=32768, multiple_of=64, description="KV room kept after the prompt")
    generate_tokens: int = Field(1, ge=1, le=64, description="tokens one generate step takes")
    weights: Literal["int4", "fp16"] = Field("int4", description="the weight format the NPU wants (INT4 symmetric)")

    def shape(self) -> LlmShape:
        return LlmShape(self.max_prompt, self.min_response, self.generate_tokens)


class Recipe(_Strict):
    """How to build a model's engines: targets, precisions, calibration, held-out data and the budget."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    model: str = Field(min_length=1, description="demo model name or model folder")
    onnx_file: str = Field("model.onnx", description="the graph inside the model folder")
    graphs: list[str] = Field(
        default_factory=list,
        description="a multi-graph model's graphs (Whisper: encoder, decoder, decoder with past), each "
        "built at the precision into one engine folder; empty: the one graph onnx_file",
    )
    float_graphs: list[str] = Field(
        default_factory=list,
        description="those of graphs kept FP32 (optimized) at every precision: Whisper's decoders, for engines "
        "that quantize the encoder alone",
    )
    workload: Workload
    targets: list[Target] = Field(min_length=1)
    precisions: list[BuildPrecision] = Field(min_length=1)
    calibration: CalibrationSpec | None = None
    heldout: DataRef | None = None
    perplexity: PerplexitySpec | None = Field(None, description="LLM: held-out text scored by perplexity")
    accuracy: AccuracyBudget = Field(default_factory=AccuracyBudget)
    rungs: dict[str, AccuracyBudget] = Field(
        default_factory=dict,
        description="budgets of lower ladder rungs by name ([rungs.lower]); [accuracy] is the top rung's. An "
        "engine within any rung's budget enters the cache; each rung serves the fastest engine within its own",
    )
    weight_only: WeightOnlySpec | None = Field(None, description="int8w / int4 settings (defaults when absent)")
    dynamic: DynamicInt8Spec | None = Field(None, description="Whisper's dynamic INT8: the matmuls kept FP32")
    profiles: list[Profile] = Field(default_factory=list)
    npu_llm: NpuLlmSpec | None = Field(None, description="the NPU's LLM mode (defaults when absent)")
    kv_layout: KvLayout | dict[BuildPrecision, KvLayout] = Field(
        "inplace",
        description="ONNX Runtime LLM engines of plain exports: in-place KV (GroupQueryAttention) or as exported; "
        'a table gives it per precision (those it does not name: "inplace")',
    )
    source: Path | None = Field(None, description="the recipe file (set by load_recipe)")

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        if ("int8" in self.precisions) and self.calibration is None and not self.graphs:
            raise ValueError("precision int8 needs a [calibration] section (data = the calibration manifest)")
        for p in WEIGHT_ONLY:
            if p in self.precisions and self.workload != "llm" and not self.graphs:
                raise ValueError(
                    f"{p} is weight-only compression for LLMs and Whisper (graphs); remove it from this ASR recipe"
                )
        if self.graphs and (self.workload != "asr" or self.onnx_file not in self.graphs):
            raise ValueError("graphs lists an ASR model's graphs (Whisper), onnx_file among them")
        stray = [g for g in self.float_graphs if g not in self.graphs]
        if stray:
            raise ValueError(f"float_graphs: {stray[0]!r} is not one of graphs {self.graphs}")
        if self.graphs and set(self.float_graphs) >= set(self.graphs):
            raise ValueError("float_graphs keeps every graph FP32: no precision would change anything")
        if self.dynamic is not None and not (self.graphs and "int8" in self.precisions):
            raise ValueError("[dynamic] configures a Whisper recipe's int8 (graphs), which this recipe does not build")
        if self.dynamic is not None and self.dynamic.max_state_error > 0 and self.calibration is None:
            raise ValueError("[dynamic] max_state_error needs [calibration] data (the audio the states are taken on)")
        if self.weight_only is not None and not set(WEIGHT_ONLY) & set(self.precisions):
            raise ValueError("[weight_only] configures int8w / int4, which precisions does not list")
        if TOP_RUNG in self.rungs:
            raise ValueError(f"rungs.{TOP_RUNG}: the top rung's budget is [accuracy]; name lower rungs otherwise")
        for name, rung in self.rungs.items():
            if rung.judges_perplexity and self.perplexity is None:
                raise ValueError(f"rungs.{name}: a perplexity budget needs a [perplexity] section (held-out text)")
        names = [p.name for p in self.profiles]
        if len(set(names)) != len(names):
            raise ValueError(f"profile names must be unique: {names}")
        npu_fixed = any(p.is_fixed and p.applies_to("intel-npu") for p in self.profiles)
        if "intel-npu" in self.targets and self.workload == "asr" and not npu_fixed:
            raise ValueError(
                "target intel-npu compiles static shapes only: add a profile with min = max for every "
                'dim (targets = ["intel-npu"])'
            )
        if self.perplexity is not None and self.workload != "llm":
            raise ValueError("[perplexity] scores LLMs; remove it from an ASR recipe")
        if self.accuracy.judges_perplexity and self.perplexity is None:
            raise ValueError(
                "accuracy.max_ppl_increase_pct / min_greedy_agreement need a [perplexity] section (held-out text)"
            )
        if self.npu_llm is not None and self.workload != "llm":
            raise ValueError("[npu_llm] configures the NPU's LLM mode; remove it from an ASR recipe")
        if self.workload == "llm" and "jetson" in self.targets:
            jetson = {p.name for p in self.profiles if p.applies_to("jetson")}
            if not {"prefill", "decode"} <= jetson:
                raise ValueError(
                    "an LLM for jetson needs a 'prefill' and a 'decode' profile (TensorRT builds one "
                    "optimization profile each)"
                )
        return self

    # -- derived -------------------------------------------------------------------------------

    def resolve(self, relative: Path | str) -> Path:
        """A path from the recipe: relative to the recipe file's folder, else to the shipped recipes'
        (a copied recipe still finds the shipped calibration data)."""
        path = Path(relative).expanduser()
        if path.is_absolute() or self.source is None:
            return path
        here = (self.source.parent / path).resolve()
        if here.exists():
            return here
        shipped = (engines_dir() / path).resolve()
        return shipped if shipped.exists() else here

    def profiles_for(self, target: str) -> list[Profile]:
        chosen = [p for p in self.profiles if p.applies_to(target)]
        if target == "intel-npu":
            chosen = [p for p in chosen if p.is_fixed]
        return chosen

    def check(self, target: str, precision: str) -> None:
        problems = []
        if target not in self.targets:
            problems.append(("targets", f"this recipe does not build for {target!r} (it lists {self.targets})"))
        if precision not in self.precisions:
            problems.append(("precisions", f"this recipe does not build {precision!r} (it lists {self.precisions})"))
        if problems:
            raise ConfigError(problems, str(self.source or self.name))

    @property
    def weight_spec(self) -> WeightOnlySpec:
        """The ``[weight_only]`` settings, the defaults when the recipe has none; a calibration text as an
        absolute path (found like the recipe's other data)."""
        spec = self.weight_only or WeightOnlySpec()
        if spec.calibration is not None:
            spec = spec.model_copy(update={"calibration": self.resolve(spec.calibration)})
        return spec

    def layout_of(self, precision: str) -> KvLayout:
        """The ``kv_layout`` asked for ``precision``'s engines."""
        if isinstance(self.kv_layout, str):
            return self.kv_layout
        return self.kv_layout.get(precision, "inplace")  # type: ignore[call-overload]

    def rung_budgets(self) -> dict[str, AccuracyBudget]:
        """Every rung's budget, the top one (``[accuracy]``) first under ``TOP_RUNG``."""
        return {TOP_RUNG: self.accuracy, **self.rungs}

    def fingerprint(self) -> dict:
        """What about the recipe changes an engine (the cache key part): everything but its file path.
        An absent ``[weight_only]`` is left out, so recipes without one keep the keys they had."""
        # kv_layout is in the key as key_parts["layout"], only for builds that convert.
        # weight_only goes in as ``base`` has it, below.
        exclude: dict = dict.fromkeys(
            {"source", "kv_layout", "weight_only"}
            | (set() if self.graphs else {"graphs"})
            | (set() if self.float_graphs else {"float_graphs"}),
            True,
        )
        exclude |= {"npu_llm": True} if self.npu_llm is None else {}
        exclude |= {"dynamic": True} if self.dynamic is None else {}
        exclude |= {"perplexity": True} if self.perplexity is None else {}
        exclude |= {"rungs": True} if not self.rungs else {}
        unset = {k for k in ("max_ppl_increase_pct", "min_greedy_agreement") if getattr(self.accuracy, k) is None}
        if unset:  # recipes without a perplexity budget keep the keys they had
            exclude["accuracy"] = dict.fromkeys(unset, True)
        out = json.loads(self.model_dump_json(exclude=exclude))
        if self.weight_only is not None:
            base = self.weight_only.base()
            out["weight_only"] = json.loads(base.model_dump_json(exclude=base.unset_head()))
        return out

    def precision_key(self, precision: str) -> dict:
        """The recipe's parts of ``precision``'s engine keys: its fingerprint and, for a weight-only precision,
        the settings that precision gets (where a per-precision value is)."""
        parts = {"recipe": self.fingerprint()}
        if precision in WEIGHT_ONLY:  # only weight-only keys carry it: other keys stay as they were
            parts["weight_only"] = self.weight_spec.for_precision(precision).key()
        return parts


def recipe_dirs(user_dir: Path | str | None = None) -> list[Path]:
    """Where recipes are looked for, first match wins: the user's folder, then the shipped recipes."""
    dirs = [Path(user_dir).expanduser()] if user_dir else []
    shipped = engines_dir()
    return dirs + ([shipped] if shipped.resolve() not in [d.resolve() for d in dirs] else [])


def recipe_files(user_dir: Path | str | None = None) -> list[Path]:
    """Every recipe file, the user's first (the daemon takes the first recipe for a model), a user's
    ``NAME.toml`` hiding the shipped one of the same name."""
    found: dict[str, Path] = {}
    for folder in recipe_dirs(user_dir):
        for path in sorted(folder.glob("*.toml")) if folder.is_dir() else []:
            found.setdefault(path.stem, path)
    return list(found.values())


def find_recipe(name: str | Path, user_dir: Path | str | None = None) -> Path:
    """A recipe file: ``name`` itself when it is a file, else ``NAME.toml`` in ``recipe_dirs(user_dir)``."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if path.suffix != ".toml" and len(path.parts) == 1:
        for folder in recipe_dirs(user_dir):
            if (folder / f"{path.name}.toml").is_file():
                return folder / f"{path.name}.toml"
        where = " or ".join(str(d) for d in recipe_dirs(user_dir))
        raise ConfigError([(str(name), f"recipe file not found, nor {path.name}.toml in {where}")])
    raise ConfigError([(str(path), "recipe file not found")])


def load_recipe(path: str | Path, search: Path | str | None = None) -> Recipe:
    """Read and validate a recipe file; a bare name is looked up as ``NAME.toml`` in ``search``
    (the user's folder, ``engines.recipes_dir``), then in the shipped recipes."""
    path = find_recipe(path, search)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([(str(path), f"not valid TOML: {exc}")]) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([(str(path), f"cannot read: {exc}")]) from exc
    try:
        return Recipe(**data, source=path.resolve())
    except ValidationError as exc:
        raise ConfigError(validation_problems(exc), str(path)) from exc
    except TypeError as exc:  # e.g. a key given twice as a keyword
        raise ConfigError([(str(path), str(exc))]) from exc


def input_shapes(profile: Profile, inputs: list[tuple[str, tuple]]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Per model input: (min, opt, max) shapes under ``profile``.

    ``inputs`` are ``(name, shape)`` with ints for fixed dims and names for dynamic ones. A dynamic
    dim the profile does not name, or a profile dim no input has, is a mismatch and an error.
    """
    used: set[str] = set()
    out: dict[str, tuple[tuple[int, ...], ...]] = {}
    missing: list[str] = []
    for name, shape in inputs:
        lo, opt, hi = [], [], []
        for d in shape:
            if isinstance(d, int) and d >= 0:
                lo.append(d)
                opt.append(d)
                hi.append(d)
                continue
            key = str(d)
            if key not in profile.dims:
                missing.append(f"{name} dim {key!r}")
                continue
            used.add(key)
            a, b, c = profile.dims[key]
            lo.append(a)
            opt.append(b)
            hi.append(c)
        out[name] = (tuple(lo), tuple(opt), tuple(hi))
    unused = sorted(set(profile.dims) - used)
    if missing or unused:
        parts = []
        if missing:
            parts.append(f"the model has dynamic {', '.join(missing)} that the profile does not give")
        if unused:
            parts.append(f"the profile gives {unused}, which no model input has")
        raise ConfigError([(f"profiles[{profile.name}]", "; ".join(parts))])
    return out
