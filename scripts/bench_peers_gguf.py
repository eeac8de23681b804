"""Convert a Hugging Face Phi-3 checkpoint to GGUF with llama.cpp's own ``convert_hf_to_gguf.py``.

Runs in .venv-peers, with the converter that scripts/bench-peers-setup unpacked from the same
llama-cpp-python release that was compiled there (``.venv-peers/llama.cpp``). Two adjustments for the
benchmark's tokenizers, which llama.cpp has never seen (the benchmark feeds token ids, so neither changes a
measured figure): the checkpoint's tokenizer is declared a ``GPT2Tokenizer`` (Phi-3's converter otherwise
wants a SentencePiece ``tokenizer.model``; a ``tokenizer.json`` BPE is read through the GPT-2 route), and an
unrecognized BPE pre-tokenizer is stored as ``default`` instead of stopping the conversion.

    .venv-peers/bin/python scripts/bench_peers_gguf.py HF_FOLDER OUT.gguf --outtype f32|f16
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import tempfile
from pathlib import Path

LLAMA_CPP = Path(sys.prefix) / "llama.cpp"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--outtype", choices=("f32", "f16"), required=True)
    args = parser.parse_args(argv)
    script = LLAMA_CPP / "convert_hf_to_gguf.py"
    if not script.is_file():
        sys.exit(f"bench_peers_gguf: no {script} (run scripts/bench-peers-setup)")
    sys.path[:0] = [str(LLAMA_CPP / "gguf-py"), str(LLAMA_CPP)]
    from conversion import base  # llama.cpp's converter package

    original = base.TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            return "default"

    base.TextModel.get_vocab_base_pre = vocab_base_pre
    with tempfile.TemporaryDirectory() as tmp:
        view = Path(tmp)
        for f in args.hf.iterdir():
            (view / f.name).symlink_to(f.resolve())
        cfg_path = view / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        cfg["tokenizer_class"] = "GPT2Tokenizer"
        cfg_path.unlink(missing_ok=True)
        cfg_path.write_text(json.dumps(cfg))
        sys.argv = [str(script), str(view), "--outfile", str(args.out), "--outtype", args.outtype]
        runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
