"""The recipe the daemon makes for a tier's plain Phi-3 / Gemma export that no recipe builds.

A user who points a tier at an ``optimum-cli`` export without writing a recipe would otherwise be
served the export as it is: every decode step copies the whole KV cache in and out of the runtime.
With ``engines.convert_plain_exports`` (on by default) such a tier gets this recipe: one FP32 ONNX
Runtime engine with the in-place KV layout (``inplace_kv``), built in the background like any other,
checked by the conversion's own equivalence test and by the accuracy gate on the shipped held-out
prompts. FP32 changes no weight, so the answers stay the export's; quantized precisions remain a
choice the field engineer makes in a recipe of their own.

Demo model names are left out: the demo models that are worth an engine ship recipes.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..models.catalog import DEMO_MODELS
from ..shipped import calibration_dir
from .inplace_kv import is_plain_decoder
from .recipes import DataRef, Recipe

if TYPE_CHECKING:
    from ..config import TierConfig

HELDOUT_SAMPLES = 8  # enough for the gate's cosine / top-1 / KL; the build stays short on a busy device


def plain_export_recipe(tier: TierConfig) -> Recipe | None:
    """The in-place FP32 recipe for ``tier`` when it serves a plain decoder export folder with ONNX
    Runtime on the CPU target; None for anything else (demo names, genai folders, other backends)."""
    if tier.model in DEMO_MODELS or tier.backend != "onnxruntime" or tier.device.lower() != "cpu":
        return None
    folder = Path(tier.model).expanduser().resolve()
    if not is_plain_decoder(folder):
        return None
    return Recipe(
        name=recipe_name(folder),
        model=str(folder),
        workload="llm",
        targets=["cpu"],
        precisions=["fp32"],
        heldout=DataRef(data=calibration_dir() / "llm" / "heldout.jsonl", samples=HELDOUT_SAMPLES),
        kv_layout="inplace",
    )


def recipe_name(folder: Path) -> str:
    """``inplace-<folder name>-<8 hex of the path>``: readable in events, unique per folder."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", folder.name).strip("-.") or "model"
    return f"inplace-{stem}-{hashlib.sha256(str(folder).encode()).hexdigest()[:8]}"
