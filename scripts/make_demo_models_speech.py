"""Speech demo models for make_demo_models.py: demo-whisper (encoder/decoder, optimum layout) and
demo-ctc (wav2vec2-CTC). Same rules: exact HF architectures, tiny sizes, fixed seeds, ONNX checked
against PyTorch on ONNX Runtime before anything is written."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from demo_models_common import (
    SEEDS,
    assert_close,
    onnx_export,
    ort_session,
    save_config,
    save_npz,
    train_bpe,
    write_common,
    write_json,
    write_tokenizer,
)
from tokenizers import AddedToken
from transformers import (
    DynamicCache,
    EncoderDecoderCache,
    Wav2Vec2Config,
    Wav2Vec2FeatureExtractor,
    Wav2Vec2ForCTC,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
)

SR = 16000
WHISPER_TEXT_VOCAB = 512
# Whisper's language tokens start in this order (en, zh, de, es, ru, ko, fr, ja, ...); the first eight are kept.
WHISPER_LANGUAGES = ["en", "zh", "de", "es", "ru", "ko", "fr", "ja"]
WHISPER_GREEDY_STEPS = 16
# wav2vec2-base-960h's character vocabulary, in its order (<pad> is the CTC blank, "|" the word delimiter).
CTC_VOCAB = ["<pad>", "<s>", "</s>", "<unk>", "|", *"ETAONIHSRDLUMWCFGYPBVK'XJQZ"]


def test_waveform(seconds: float, seed: int) -> np.ndarray:
    """Deterministic 16 kHz test signal: a few tones under a slow envelope plus seeded noise."""
    t = np.arange(int(seconds * SR), dtype=np.float64) / SR
    tones = sum(a * np.sin(2 * np.pi * f * t) for f, a in ((220.0, 0.3), (440.0, 0.2), (1250.0, 0.1), (3100.0, 0.05)))
    envelope = 0.6 + 0.4 * np.sin(2 * np.pi * 1.5 * t)
    noise = np.random.default_rng(seed).standard_normal(t.size) * 0.02
    return (tones * envelope + noise).astype(np.float32)


# ----------------------------------------------------------------------------- Whisper


def whisper_tokenizer() -> tuple[Any, dict[str, int]]:
    """Byte-level BPE text vocabulary, then Whisper's special tokens in Whisper's order."""
    tok = train_bpe(WHISPER_TEXT_VOCAB, [], [])
    specials = (
        ["<|endoftext|>", "<|startoftranscript|>"]
        + [f"<|{lang}|>" for lang in WHISPER_LANGUAGES]
        + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    # Timestamps are added as non-special tokens, as in the HF Whisper tokenizers (decode keeps them).
    tok.add_tokens([AddedToken(f"<|{i * 0.02:.2f}|>", special=False, normalized=False) for i in range(1501)])
    ids = {t: tok.token_to_id(t) for t in specials}
    assert ids["<|endoftext|>"] == WHISPER_TEXT_VOCAB and tok.token_to_id("<|30.00|>") == tok.get_vocab_size() - 1
    return tok, ids


class WhisperEncoderOnly(torch.nn.Module):
    def __init__(self, model: WhisperForConditionalGeneration) -> None:
        super().__init__()
        self.encoder = model.model.encoder

    def forward(self, input_features):
        return self.encoder(input_features).last_hidden_state


class WhisperDecoderStep(torch.nn.Module):
    """optimum's two decoder graphs. Without past: (input_ids, encoder_hidden_states) -> logits + self- and
    cross-attention presents. With past: (input_ids, per layer decoder k/v + encoder k/v) -> logits + the
    decoder presents (the cross-attention k/v never change after the first step)."""

    def __init__(self, model: WhisperForConditionalGeneration, with_past: bool) -> None:
        super().__init__()
        self.decoder, self.proj_out, self.with_past = model.model.decoder, model.proj_out, with_past

    def forward(self, input_ids, *rest):
        if self.with_past:
            own = DynamicCache(ddp_cache_data=list(zip(rest[0::4], rest[1::4])))
            cross = DynamicCache(ddp_cache_data=list(zip(rest[2::4], rest[3::4])))
            # Cross-attention reads the cached k/v; the decoder only needs a non-None encoder tensor to run it.
            encoder_hidden_states = rest[2]
        else:
            own, cross, encoder_hidden_states = DynamicCache(), DynamicCache(), rest[0]
        out = self.decoder(
            input_ids=input_ids,
            encoder_hidden_states=encoder_hidden_states,
            cache=EncoderDecoderCache(own, cross),
            use_cache=True,
        )
        present = []
        for i, layer in enumerate(own.layers):
            present += [layer.keys, layer.values]
            if not self.with_past:
                present += [cross.layers[i].keys, cross.layers[i].values]
        return (self.proj_out(out.last_hidden_state), *present)


def whisper_names(n_layers: int, with_past: bool) -> tuple[list[str], list[str], dict[str, dict[int, str]]]:
    axes = {
        "input_ids": {0: "batch_size", 1: "decoder_sequence_length"},
        "logits": {0: "batch_size", 1: "decoder_sequence_length"},
    }
    kinds = [f"{i}.{part}.{kv}" for i in range(n_layers) for part in ("decoder", "encoder") for kv in ("key", "value")]
    if with_past:
        inputs = ["input_ids"] + [f"past_key_values.{k}" for k in kinds]
        outputs = ["logits"] + [f"present.{k}" for k in kinds if ".decoder." in k]
        axes.update(
            {
                f"past_key_values.{k}": {0: "batch_size", 2: "past_decoder_sequence_length"}
                if ".decoder." in k
                else {0: "batch_size"}
                for k in kinds
            }
        )
        axes.update(
            {f"present.{k}": {0: "batch_size", 2: "total_decoder_sequence_length"} for k in kinds if ".decoder." in k}
        )
    else:
        inputs, outputs = ["input_ids", "encoder_hidden_states"], ["logits"] + [f"present.{k}" for k in kinds]
        axes["encoder_hidden_states"] = {0: "batch_size"}
        axes.update(
            {
                f"present.{k}": {0: "batch_size", 2: "decoder_sequence_length"}
                if ".decoder." in k
                else {0: "batch_size"}
                for k in kinds
            }
        )
    return inputs, outputs, axes


def build_whisper(out_dir: Path) -> dict[str, Any]:
    name = "demo-whisper"
    tok, ids = whisper_tokenizer()
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    symbols = set('"#()*+/:;<=>@[\\]^_`{|}~')  # OpenAI's non-speech symbols; their tokens are suppressed
    suppress = [i for i in range(WHISPER_TEXT_VOCAB) if (s := tok.decode([i]).strip()) and s[0] in symbols]
    begin_suppress = [tok.token_to_id("Ġ"), eot]  # a leading space and an immediate end, as in Whisper (220, eot)
    cfg = WhisperConfig(
        vocab_size=tok.get_vocab_size(),
        num_mel_bins=80,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=256,
        decoder_ffn_dim=256,
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=sot,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        suppress_tokens=suppress,
        begin_suppress_tokens=begin_suppress,
        init_std=0.2,
        attn_implementation="eager",
    )  # init_std 0.2 (default 0.02): varied greedy tokens
    torch.manual_seed(SEEDS[name])
    model = WhisperForConditionalGeneration(cfg).eval()
    folder = out_dir / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)

    # Exports. Traced with batch 2 and a non-empty decoder past, so neither is baked in as a constant.
    n_layers, d = cfg.decoder_layers, cfg.d_model
    hd, heads = d // cfg.decoder_attention_heads, cfg.decoder_attention_heads
    onnx_export(
        WhisperEncoderOnly(model),
        (torch.zeros(2, 80, 3000),),
        folder / "encoder_model.onnx",
        ["input_features"],
        ["last_hidden_state"],
        {"input_features": {0: "batch_size"}, "last_hidden_state": {0: "batch_size"}},
    )
    onnx_export(
        WhisperDecoderStep(model, False),
        (torch.full((2, 3), sot), torch.zeros(2, 1500, d)),
        folder / "decoder_model.onnx",
        *whisper_names(n_layers, False),
    )
    past = [torch.zeros(2, heads, 4 if ".decoder." in n else 1500, hd) for n in whisper_names(n_layers, True)[0][1:]]
    onnx_export(
        WhisperDecoderStep(model, True),
        (torch.full((2, 1), sot), *past),
        folder / "decoder_with_past_model.onnx",
        *whisper_names(n_layers, True),
    )

    # Torch reference: HF's own path (encoder, then the decoder with its EncoderDecoderCache), raw argmax.
    waveform = test_waveform(2.0, SEEDS[name])
    fe = WhisperFeatureExtractor(feature_size=80, sampling_rate=SR, hop_length=160, chunk_length=30, n_fft=400)
    features = fe(waveform, sampling_rate=SR, return_tensors="np").input_features.astype(np.float32)
    prompt = [sot, ids["<|en|>"], ids["<|transcribe|>"], ids["<|notimestamps|>"]]
    with torch.no_grad():
        enc = model.model.encoder(torch.from_numpy(features)).last_hidden_state
        out = model(encoder_outputs=(enc,), decoder_input_ids=torch.tensor([prompt]), use_cache=True)
        prompt_logits, tokens, margin = out.logits[0].numpy(), [], float("inf")
        for _ in range(WHISPER_GREEDY_STEPS):
            top2 = torch.topk(out.logits[0, -1], 2).values
            margin = min(margin, float(top2[0] - top2[1]))
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(
                encoder_outputs=(enc,), decoder_input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True
            )
    enc = enc.numpy()
    assert margin > 1e-3, f"whisper greedy argmax too close to a tie ({margin}); pick another seed"

    # ONNX Runtime must reproduce it: encoder (batch 2), first decoder step, then the cached loop.
    encoder = ort_session(folder / "encoder_model.onnx")
    other = features[:, :, ::-1].copy()
    with torch.no_grad():
        other_enc = model.model.encoder(torch.from_numpy(other)).last_hidden_state.numpy()
    got = encoder({"input_features": np.concatenate([features, other])})["last_hidden_state"]
    assert_close("whisper encoder", got, np.concatenate([enc, other_enc]))
    first = ort_session(folder / "decoder_model.onnx")({"input_ids": np.array([prompt]), "encoder_hidden_states": enc})
    assert_close("whisper decoder_model logits", first["logits"][0], prompt_logits)
    step = ort_session(folder / "decoder_with_past_model.onnx")
    past = {k.replace("present", "past_key_values"): v for k, v in first.items() if k != "logits"}
    onnx_tokens = [int(first["logits"][0, -1].argmax())]
    for _ in range(WHISPER_GREEDY_STEPS - 1):
        res = step({"input_ids": np.array([[onnx_tokens[-1]]]), **past})
        onnx_tokens.append(int(res["logits"][0, -1].argmax()))
        past.update({k.replace("present", "past_key_values"): v for k, v in res.items() if k != "logits"})
    assert onnx_tokens == tokens, f"whisper greedy: onnx {onnx_tokens} != torch {tokens}"
    # Batch 2, two new tokens at once on a 5-token past: nothing shape-dependent got baked into the graph.
    rng = np.random.default_rng(0)
    names = whisper_names(n_layers, True)[0]
    feeds = {"input_ids": rng.integers(0, WHISPER_TEXT_VOCAB, (2, 2))}
    feeds.update(
        {n: rng.standard_normal((2, heads, 5 if ".decoder." in n else 1500, hd), np.float32) for n in names[1:]}
    )
    with torch.no_grad():
        want = WhisperDecoderStep(model, True)(*[torch.from_numpy(feeds[n]) for n in names])
    for got, ref in zip(step(feeds).values(), want):
        assert_close("whisper decoder_with_past (batch 2, 2 tokens)", got, ref.numpy())

    save_config(cfg, "WhisperForConditionalGeneration", folder)
    write_json(
        folder / "generation_config.json",
        {
            "begin_suppress_tokens": begin_suppress,
            "bos_token_id": eot,
            "decoder_start_token_id": sot,
            "eos_token_id": eot,
            "is_multilingual": True,
            "lang_to_id": {f"<|{lang}|>": ids[f"<|{lang}|>"] for lang in WHISPER_LANGUAGES},
            "max_initial_timestamp_index": 50,
            "max_length": 448,
            "no_timestamps_token_id": ids["<|notimestamps|>"],
            "pad_token_id": eot,
            "prev_sot_token_id": ids["<|startofprev|>"],
            "return_timestamps": False,
            "suppress_tokens": suppress,
            "task_to_id": {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
            "transformers_version": transformers.__version__,
        },
    )
    fe_dict = fe.to_dict()
    fe_dict.pop("mel_filters", None)
    write_json(
        folder / "preprocessor_config.json", {**dict(sorted(fe_dict.items())), "processor_class": "WhisperProcessor"}
    )
    # tokenizer_class stays the generic fast one: transformers' WhisperTokenizer would drop the timestamp tokens.
    eot_meta = dict.fromkeys(("bos", "eos", "pad", "unk"), "<|endoftext|>")
    write_tokenizer(folder, tok, eot_meta, {"model_max_length": 448})
    save_npz(
        folder / "reference.npz",
        {
            "waveform": waveform,
            "input_features": features[0],
            "encoder_hidden_states": enc[0],
            "decoder_prompt_ids": np.array(prompt, np.int64),
            "greedy_ids": np.array(tokens, np.int64),
        },
    )
    write_common(folder, name, {"parameters": sum(p.numel() for p in model.parameters())})
    return {"vocab_size": cfg.vocab_size, "greedy_ids": tokens, "min_margin": margin}


# ----------------------------------------------------------------------------- wav2vec2-CTC


def build_ctc(out_dir: Path) -> dict[str, Any]:
    name = "demo-ctc"
    cfg = Wav2Vec2Config(
        vocab_size=len(CTC_VOCAB),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        # The real 7-layer feature encoder (strides 5,2,2,2,2,2,2: 320x, 20 ms frames) with few channels.
        conv_dim=(32,) * 7,
        conv_stride=(5, 2, 2, 2, 2, 2, 2),
        conv_kernel=(10, 3, 3, 3, 3, 2, 2),
        feat_extract_norm="group",
        do_stable_layer_norm=False,
        num_conv_pos_embeddings=128,
        num_conv_pos_embedding_groups=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        ctc_loss_reduction="sum",
        attn_implementation="eager",
    )
    torch.manual_seed(SEEDS[name])
    model = Wav2Vec2ForCTC(cfg).eval()
    folder = out_dir / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_values):
            return self.model(input_values).logits

    onnx_export(
        Logits(),
        (torch.zeros(2, 12345),),
        folder / "model.onnx",
        ["input_values"],
        ["logits"],
        {"input_values": {0: "batch_size", 1: "num_samples"}, "logits": {0: "batch_size", 1: "num_frames"}},
    )

    waveform = test_waveform(1.0, SEEDS[name])
    fe = Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=SR, padding_value=0.0, do_normalize=True, return_attention_mask=False
    )
    values = fe(waveform, sampling_rate=SR, return_tensors="np").input_values.astype(np.float32)
    with torch.no_grad():
        logits = model(torch.from_numpy(values)).logits[0].numpy()
        short = values[:, :8123]
        short_logits = model(torch.from_numpy(short)).logits.numpy()
    run = ort_session(folder / "model.onnx")
    assert_close("ctc logits", run({"input_values": values})["logits"][0], logits)
    assert_close("ctc logits (other length)", run({"input_values": short})["logits"], short_logits)
    assert logits.shape[0] == 49, logits.shape  # 1 s -> 49 frames of 20 ms
    top2 = np.sort(logits, -1)[:, -2:]
    margin = float((top2[:, 1] - top2[:, 0]).min())
    assert margin > 1e-4, f"ctc argmax too close to a tie ({margin}); pick another seed"

    save_config(cfg, "Wav2Vec2ForCTC", folder)
    write_json(folder / "vocab.json", {t: i for i, t in enumerate(CTC_VOCAB)})
    write_json(
        folder / "tokenizer_config.json",
        {
            "bos_token": "<s>",
            "do_lower_case": False,
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "processor_class": "Wav2Vec2Processor",
            "replace_word_delimiter_char": " ",
            "tokenizer_class": "Wav2Vec2CTCTokenizer",
            "unk_token": "<unk>",
            "word_delimiter_token": "|",
        },
    )
    write_json(
        folder / "special_tokens_map.json",
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"},
    )
    write_json(
        folder / "preprocessor_config.json",
        {**dict(sorted(fe.to_dict().items())), "processor_class": "Wav2Vec2Processor"},
    )
    save_npz(
        folder / "reference.npz",
        {
            "waveform": waveform,
            "input_values": values[0],
            "logits": logits,
            "greedy_ids": logits.argmax(-1).astype(np.int64),
        },
    )
    write_common(folder, name, {"parameters": sum(p.numel() for p in model.parameters())})
    return {"frames": int(logits.shape[0]), "min_margin": margin, "greedy_ids": logits.argmax(-1).tolist()}
