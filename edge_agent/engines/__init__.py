"""Engines: building (recipes, calibration data, quantization per backend, the accuracy gate), caching,
and resolving what a tier loads.

    recipes.py            engines/*.toml -> Recipe (validated; shape profiles)
    datasets.py           calibration / held-out JSONL manifests (text, audio)
    probes.py             model inputs for calibration and the gate (LLM prefill, streamed ASR chunks)
    quantize_ort.py       ONNX Runtime: Q/DQ INT8, dynamic INT8, FP16, optimized graph
    quantize_openvino.py  OpenVINO: IR, FP16, NNCF INT8, INT8/INT4 weight compression, compiled blob
    tensorrt_build.py     TensorRT 10/11 plans: strongly typed Q/DQ, FP16, profiles, timing cache
    stages.py             per-backend convert / compile / open (given a StageContext, not the pipeline)
    heartbeat.py          a build's progress, systemd patience and cancel flag
    pipeline.py           resumable build steps, gate, commit
    gate.py               metrics, verdicts, the engine choice
    cache.py              the content-addressed engine cache
    fingerprint.py        runtime versions and device fingerprints (cache keys)
"""
