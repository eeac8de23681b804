"""ONNX graphs the agent writes itself, with the ``onnx`` helper API and numpy only.

builder.py      what they share: the graph under construction, the opset, a KV-cache decoder's inputs and outputs
decoder.py      a decoder from a GGUF file's weights (``importers.gguf``): the plain KV-cache export contract
inplace_kv.py   a plain decoder export's recovered weights as an in-place KV graph with GroupQueryAttention
                (``engines.inplace_kv``)
tensorrt.py     the graph a TensorRT build parses (the last position's logits only), and the checks its
                decoder profiles must pass (``engines.stages``)
whisper.py      Whisper's encoder and decoders from CTranslate2 weights (``importers.ct2_whisper``), and the NPU's
                static decoder step and cross-attention keys/values (``models.asr_whisper_npu``)

The builders take what they build from as arguments (a spec, weights, a path) and import nothing of the
agent but ``errors``; the layers above them (importers, engines, models) read the files and call them.
"""
