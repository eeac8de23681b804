"""Recipe validation and calibration-manifest reading: every error names the key or the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge_agent.engines.datasets import manifest_digest, read_audio_manifest, read_text_manifest
from edge_agent.engines.recipes import Profile, input_shapes, load_recipe
from edge_agent.errors import ConfigError, InputError

ROOT = Path(__file__).resolve().parents[2]

BASE = """
name = "tiny"
model = "demo-phi3"
workload = "llm"
targets = ["cpu"]
precisions = ["fp32", "int8"]
[calibration]
data = "prompts.jsonl"
samples = 4
[heldout]
data = "prompts.jsonl"
[[profiles]]
name = "prefill"
dims = { batch_size = [1, 1, 4], sequence_length = [1, 16, 64] }
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.toml"
    path.write_text(text)
    return path


def problems(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_recipe(write(tmp_path, text))
    return str(info.value)


@pytest.mark.parametrize(
    "name", ["demo-phi3-small", "demo-asr", "phi3-mini", "gemma2-2b", "gemma-3-270m", "gemma-3-270m-home"]
)
def test_shipped_recipes_are_valid(name: str) -> None:
    recipe = load_recipe(ROOT / "engines" / f"{name}.toml")
    assert recipe.name == name
    if "jetson" in recipe.targets and recipe.workload == "llm":
        assert {p.name for p in recipe.profiles_for("jetson")} == {"prefill", "decode"}
    assert all(p.is_fixed for p in recipe.profiles_for("intel-npu"))
    if "intel-npu" in recipe.targets and recipe.workload == "llm":
        assert recipe.npu_llm is not None and recipe.npu_llm.weights in recipe.precisions
    assert recipe.resolve(recipe.heldout.data).is_file()


def test_valid_recipe_resolves_paths_relative_to_its_file(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path, BASE))
    assert recipe.resolve(recipe.calibration.data) == tmp_path / "prompts.jsonl"
    assert recipe.calibration.method == "minmax"
    assert "source" not in recipe.fingerprint()


def test_kv_layout_may_be_given_per_precision_without_changing_the_recipe_key(tmp_path: Path) -> None:
    whole = load_recipe(write(tmp_path, BASE.replace('workload = "llm"', 'workload = "llm"\nkv_layout = "plain"')))
    table = load_recipe(
        write(tmp_path, BASE.replace('workload = "llm"', 'workload = "llm"\nkv_layout = { int8w = "plain" }'))
    )
    assert [whole.layout_of(p) for p in ("fp32", "int8w", "int4")] == ["plain"] * 3
    assert [table.layout_of(p) for p in ("fp32", "int8w", "int4")] == ["inplace", "plain", "inplace"]
    assert load_recipe(write(tmp_path, BASE)).layout_of("int8w") == "inplace"
    # the layout is keyed per build (key_parts["layout"]), never through the recipe's fingerprint
    assert whole.fingerprint() == table.fingerprint() == load_recipe(write(tmp_path, BASE)).fingerprint()


def test_a_bare_name_is_found_in_the_recipes_dir(tmp_path: Path) -> None:
    write(tmp_path, BASE)
    assert load_recipe("r", search=tmp_path).name == "tiny"
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_recipe("nope", search=tmp_path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.replace('workload = "llm"', 'workload = "llm"\nbogus = 1'), "bogus: unknown key"),
        (lambda t: t.replace('precisions = ["fp32", "int8"]', 'precisions = ["fp64"]'), "precisions[0]"),
        (lambda t: t.split("[calibration]")[0] + "[heldout]\ndata = 'p.jsonl'", "int8 needs a [calibration] section"),
        (lambda t: t.replace("[1, 16, 64]", "[8, 4, 64]"), "need 0 <= min <= opt <= max"),
        (
            lambda t: t.replace('workload = "llm"', 'workload = "asr"').replace(
                'targets = ["cpu"]', 'targets = ["intel-npu"]'
            ),
            "static shapes only",
        ),
        (lambda t: t.replace('workload = "llm"', 'workload = "asr"') + "\n[npu_llm]\n", "remove it from an ASR recipe"),
        (lambda t: t + "\n[npu_llm]\nmax_prompt = 100\n", "multiple of 64"),
        (lambda t: t.replace('targets = ["cpu"]', 'targets = ["jetson"]'), "'prefill' and a 'decode' profile"),
        (
            lambda t: t.replace('workload = "llm"', 'workload = "asr"').replace('"int8"]', '"int8", "int4"]'),
            "int4 is weight-only",
        ),
        (lambda t: t + "\n[[profiles]]\nname = 'prefill'\ndims = { batch_size = [1, 1, 1] }\n", "unique"),
        (lambda t: t.replace('name = "tiny"', "name = [1"), "not valid TOML"),
        (lambda t: t.replace('workload = "llm"', 'workload = "llm"\nkv_layout = { int9 = "plain" }'), "kv_layout"),
        (lambda t: t.replace('workload = "llm"', 'workload = "llm"\nkv_layout = { int4 = "paged" }'), "kv_layout"),
    ],
)
def test_invalid_recipes_are_refused_with_the_key(tmp_path: Path, edit, message: str) -> None:
    assert message in problems(tmp_path, edit(BASE))


def test_check_names_the_missing_target_and_precision(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path, BASE))
    with pytest.raises(ConfigError, match=r"does not build for 'jetson'.*does not build 'fp16'"):
        recipe.check("jetson", "fp16")
    recipe.check("cpu", "int8")


def test_input_shapes_maps_named_dims_and_reports_mismatches() -> None:
    profile = Profile(name="p", dims={"batch": (1, 2, 4), "seq": (1, 8, 16)})
    shapes = input_shapes(profile, [("ids", ("batch", "seq")), ("state", ("batch", 3, 64))])
    assert shapes == {"ids": ((1, 1), (2, 8), (4, 16)), "state": ((1, 3, 64), (2, 3, 64), (4, 3, 64))}
    with pytest.raises(ConfigError, match=r"dynamic ids dim 'past'.*gives \['seq'\]"):
        input_shapes(profile, [("ids", ("batch", "past"))])


# -- calibration manifests -------------------------------------------------------------------


def test_text_manifest_reads_prompts_and_messages(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    items = read_text_manifest(path)
    assert [(i.line, i.prompt) for i in items] == [(1, "hello"), (3, None)]
    assert items[1].messages == (("user", "hi"),)
    assert len(read_text_manifest(path, limit=1)) == 1


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "the manifest is empty"),
        ("\n\n", "the manifest is empty"),
        ('{"prompt": \n', "p.jsonl:1: not valid JSON"),
        ('{"text": "x"}\n', 'p.jsonl:1: expected {"prompt"'),
        ('{"prompt": "  "}\n', 'p.jsonl:1: "prompt" is empty'),
        ('{"messages": [{"role": "user"}]}\n', "p.jsonl:1: each message needs"),
        ("[1, 2]\n", "p.jsonl:1: expected a JSON object"),
    ],
)
def test_broken_text_manifests_name_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("{", r"\{")):
        read_text_manifest(path)


def test_a_broken_line_among_good_ones_is_skipped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": \n{"prompt": "also"}\n')
    items = read_text_manifest(path)
    assert [i.prompt for i in items] == ["ok", "also"] and items.skipped == 1


def test_corrupt_binary_and_missing_manifests(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(InputError, match="not UTF-8"):
        read_text_manifest(path)
    with pytest.raises(InputError, match="not found"):
        read_text_manifest(tmp_path / "missing.jsonl")


def test_audio_manifest_resolves_relative_paths_and_names_missing_audio(tmp_path: Path) -> None:
    (tmp_path / "a.wav").write_bytes(b"RIFF")
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"audio": "a.wav", "text": "hi"}) + "\n")
    items = read_audio_manifest(path, need_text=True)
    assert items[0].audio == (tmp_path / "a.wav").resolve() and items[0].text == "hi"
    path.write_text(json.dumps({"audio": "b.wav"}) + "\n")
    with pytest.raises(InputError, match=r"m\.jsonl:1: audio file b\.wav not found"):
        read_audio_manifest(path)
    path.write_text(json.dumps({"audio": "a.wav"}) + "\n")
    with pytest.raises(InputError, match=r'm\.jsonl:1: no reference "text"'):
        read_audio_manifest(path, need_text=True)


def test_manifest_digest_follows_the_audio_bytes(tmp_path: Path) -> None:
    (tmp_path / "a.wav").write_bytes(b"one")
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"audio": "a.wav"}) + "\n")
    first = manifest_digest(path)
    (tmp_path / "a.wav").write_bytes(b"two")
    assert manifest_digest(path) != first
