"""A LoRA adapter merged into an imported model: a new model folder, addressable by its own name.

``ADAPTERS`` lists the adapters shipped with the package (``edge_agent/adapters/<name>/``): each names
the fetchable base model it was trained on and holds ``adapter.npz`` (per adapted linear layer
``<module>.lora_A`` [r, in] and ``<module>.lora_B`` [out, r], modules named as transformers names them)
and ``adapter.json`` (rank, alpha, the base file's sha256, how it was trained, the npz's sha256).

``merge`` copies the base folder and adds ``alpha / r · (B @ A)`` to each adapted weight in place in
the copy's ``model.onnx.data``. The imported graph names its weights after transformers' modules and
stores each as ``[in, out]`` (``MatMul(x, W)``), so the delta goes in transposed. The graph itself is
not rewritten: the merged folder is an ordinary model folder whose engines, recipes and gates apply
as to any other, and the runtime needs no LoRA support (nor torch).

    edge-agent models fetch gemma-3-270m-home     # fetches and imports gemma-3-270m first if needed

The adapter is checked against its recorded sha256 and its base against the base file's sha256 before
anything is written; the merged folder is staged and renamed into place (``staging.staged_folder``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelError
from .result import ImportResult
from .staging import sha256_file, staged_folder

IMPORT_RECORD = "import.json"
SHIPPED = Path(__file__).resolve().parent.parent / "adapters"


@dataclass(frozen=True, slots=True)
class Adapter:
    """An adapter: the name its merged model gets, the fetchable base, its purpose and its folder."""

    name: str
    base: str
    description: str
    folder: Path


ADAPTERS: dict[str, Adapter] = {
    a.name: a
    for a in (
        Adapter(
            "gemma-3-270m-home",
            "gemma-3-270m",
            "Gemma 3 270M with a LoRA adapter for home commands (set_light, set_timer, set_temperature)",
            SHIPPED / "gemma-3-270m-home",
        ),
    )
}


def _external(init) -> tuple[str, int, int]:
    """(file, offset, length) of an initializer stored as external data."""
    fields = {e.key: e.value for e in init.external_data}
    if "location" not in fields:
        raise ModelError(f"weight {init.name} is not stored as external data")
    return fields["location"], int(fields.get("offset", 0)), int(fields.get("length", 0))


def merge(adapter: Adapter, base: Path, dest: Path, say: Callable[[str], None] = lambda _: None) -> ImportResult:
    """Write ``dest``: the model folder ``base`` with ``adapter`` merged into its weights."""
    import onnx

    meta = json.loads((adapter.folder / "adapter.json").read_text())
    npz = adapter.folder / "adapter.npz"
    got = sha256_file(npz)
    if got != meta["sha256"]:
        raise ModelError(f"{npz}: sha256 {got}, expected {meta['sha256']}: the shipped adapter is damaged")
    record = json.loads((base / IMPORT_RECORD).read_text()) if (base / IMPORT_RECORD).is_file() else {}
    base_sha = (record.get("source") or {}).get("sha256")
    if base_sha != meta["base"]["sha256"]:
        raise ModelError(
            f"{base}: not the model {adapter.name}'s adapter was trained on (source sha256 {base_sha}, "
            f"expected {meta['base']['sha256']}); fetch it again with: edge-agent models fetch {adapter.base}"
        )
    graph = onnx.load(str(base / "model.onnx"), load_external_data=False).graph
    inits = {i.name: i for i in graph.initializer}
    scale = float(meta["alpha"]) / int(meta["rank"])
    with np.load(npz) as z:
        deltas = {k[: -len(".lora_A")]: (z[k], z[k[: -len("A")] + "B"]) for k in z.files if k.endswith(".lora_A")}
    with staged_folder(dest) as folder:
        for item in sorted(base.iterdir()):
            if item.is_file() and item.name != IMPORT_RECORD:
                say(f"copying {item.name}") if item.stat().st_size > 1 << 26 else None
                shutil.copy2(item, folder / item.name)
        files: dict[str, np.memmap] = {}
        for module, (a, b) in deltas.items():
            init = inits.get(f"{module}.weight")
            if init is None:
                raise ModelError(f"{base}: no weight {module}.weight for the adapter's layer {module}")
            location, offset, length = _external(init)
            shape = tuple(init.dims)  # [in, out]
            if init.data_type != onnx.TensorProto.FLOAT or (a.shape[1], b.shape[0]) != shape:
                raise ModelError(f"{module}: the adapter's [{b.shape[0]}, {a.shape[1]}] does not fit weight {shape}")
            if location not in files:
                files[location] = np.memmap(folder / location, dtype=np.uint8, mode="r+")
            w = files[location][offset : offset + length].view(np.float32).reshape(shape)
            w += (scale * (b.astype(np.float32) @ a.astype(np.float32))).T
        for mm in files.values():
            mm.flush()
        del files
        record = {
            "format": 1,
            "adapter": {"name": adapter.name, "sha256": meta["sha256"], "rank": meta["rank"], "alpha": meta["alpha"]},
            "base": {"name": adapter.base, **{k: v for k, v in record.items() if k in ("importer", "source")}},
            "name": adapter.name,
            "architecture": record.get("architecture"),
            "layers": len(deltas),
        }
        (folder / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return ImportResult(adapter.name, dest, "lora-adapter", str(record["architecture"]), record)
