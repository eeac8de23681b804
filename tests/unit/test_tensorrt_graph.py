"""The decoder profile checks a TensorRT build runs before TensorRT builds at min, opt and max shapes."""

from __future__ import annotations

from edge_agent.graphs.tensorrt import decoder_profile_problems


def decoder(seq: tuple[int, int, int], past: tuple[int, int, int], total: tuple[int, int, int]) -> dict:
    return {
        "input_ids": tuple((1, s) for s in seq),
        "attention_mask": tuple((1, t) for t in total),
        "past_key_values.0.key": tuple((1, 1, p, 16) for p in past),
    }


def test_consistent_profiles_pass_and_a_mask_off_by_its_past_is_named() -> None:
    good = [("prefill", decoder((2, 256, 512), (0, 0, 3584), (2, 256, 4096)))]
    assert decoder_profile_problems(good, 32_768) == []
    bad = [("decode", decoder((1, 1, 1), (1, 512, 4095), (2, 512, 4096)))]  # opt: 512 + 1 != 512
    (problem,) = decoder_profile_problems(bad, 32_768)
    assert "'decode' at its opt shapes" in problem and "512 + 1" in problem


def test_a_profile_past_the_context_and_non_decoders() -> None:
    (problem,) = decoder_profile_problems([("decode", decoder((1, 1, 1), (0, 1, 8191), (1, 2, 8192)))], 4096)
    assert "8192 tokens, past the model's context of 4096" in problem
    assert decoder_profile_problems([("x", {"x": ((1, 4), (2, 4), (8, 4))})], 4) == []
