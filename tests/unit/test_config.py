from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from edge_agent.config import SLA_PRESETS, LLMTierConfig, Settings, load_settings
from edge_agent.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "systemd" / "agent.toml"


def _limits(settings: Settings, tier: LLMTierConfig):
    from edge_agent.serving.llm.tiers import tier_limits

    return tier_limits(tier, settings.batching, settings.prefix_cache, settings.sla.target_ms)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


@pytest.mark.embedded_default
def test_embedded_default_is_cpu_onnxruntime_with_real_gemma_tiers_and_local_broker():
    s = load_settings(None)
    # real weights on both tiers; the lighter one trades reply length for larger batches
    assert [(t.name, t.model) for t in s.models.llm] == [("full", "gemma-3-270m-home"), ("short", "gemma-3-270m-home")]
    full, short = s.models.llm
    assert short.max_new_tokens < full.max_new_tokens and short.rows(s.batching) > full.rows(s.batching)
    assert [t.model for t in s.models.asr] == ["whisper-base"]  # real weights: demo-asr hears no natural voice
    # the annotated example shows the defaults
    assert load_settings(EXAMPLE).models.llm == s.models.llm
    assert all(t.backend == "onnxruntime" and t.device == "cpu" for t in s.models.llm + s.models.asr)
    assert (s.mqtt.host, s.mqtt.port) == ("127.0.0.1", 1883)
    assert s.api.host == "127.0.0.1"
    assert (s.sla.metric, s.sla.percentile, s.sla.target_ms) == ("ttft_ms", 95, 387.0)
    assert (s.batching.max_batch, s.batching.batch_timeout_ms) == (4, 80.0)


def test_env_overrides_toml_and_merges_into_nested_sections(tmp_path, monkeypatch):
    path = write(tmp_path, '[mqtt]\nhost = "broker.local"\nport = 1884\n[telemetry]\ninterval_s = 5\n')
    monkeypatch.setenv("EDGE_AGENT_MQTT__PORT", "8883")
    s = load_settings(path)
    assert s.mqtt.host == "broker.local"  # from the file
    assert s.mqtt.port == 8883  # env wins
    assert s.telemetry.interval_s == 5


def test_env_can_set_a_tier_list_as_json(monkeypatch):
    monkeypatch.setenv("EDGE_AGENT_MODELS__LLM", '[{"name": "g", "model": "demo-gemma"}]')
    assert [t.model for t in load_settings(None).models.llm] == ["demo-gemma"]


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_settings(tmp_path / "nope.toml")
    assert err.value.problems == [(str(tmp_path / "nope.toml"), "config file not found")]


def test_default_file_is_read_when_present(tmp_path, monkeypatch):
    default = write(tmp_path, "[api]\nport = 9090\n")
    monkeypatch.setattr("edge_agent.config.DEFAULT_CONFIG", default)
    assert load_settings(None).api.port == 9090


def test_every_problem_is_reported_with_its_dotted_path(tmp_path):
    path = write(
        tmp_path,
        """
[mqtt]
hots = "typo"
port = 99999
device_id = "a/b"
[batching]
max_batch = 2
preferred_batch_sizes = [2, 4]
[[models.llm]]
name = "x"
model = "demo-phi3"
backend = "tensorflow"
""",
    )
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    problems = dict(err.value.problems)
    assert problems["mqtt.hots"] == "unknown key; did you mean 'host'?"
    assert "65535" in problems["mqtt.port"]
    assert "'/'" in problems["mqtt.device_id"]
    assert "preferred_batch_sizes" in problems["batching"]
    assert "onnxruntime" in problems["models.llm[0].backend"]
    assert str(path) in str(err.value)


def test_toml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "[mqtt]\nport = = 3\n")
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    ((where, msg),) = err.value.problems
    assert where == str(path) and "line 2" in msg


def test_sla_preset_fills_unset_fields_but_explicit_values_win(tmp_path):
    s = load_settings(write(tmp_path, '[sla]\npreset = "live-risk-control"\n'))
    assert (s.sla.percentile, s.sla.target_ms) == (99, 85.0)
    s = load_settings(write(tmp_path, '[sla]\npreset = "live-risk-control"\ntarget_ms = 100\n'))
    assert (s.sla.percentile, s.sla.target_ms) == (99, 100.0)


def test_duplicate_tier_names_are_rejected(tmp_path):
    path = write(
        tmp_path, '[[models.llm]]\nname = "a"\nmodel = "demo-phi3"\n[[models.llm]]\nname = "a"\nmodel = "demo-gemma"\n'
    )
    with pytest.raises(ConfigError, match=r"models\.llm: tier names must be unique"):
        load_settings(path)


def test_tls_cert_needs_key(tmp_path):
    with pytest.raises(ConfigError, match=r"mqtt\.tls: cert_file and key_file go together"):
        load_settings(write(tmp_path, '[mqtt.tls]\ncert_file = "/c.pem"\n'))


def test_systemd_directories_set_cache_and_state(monkeypatch, tmp_path):
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "c"))
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "s"))
    s = load_settings(None)
    assert s.engines.cache_dir == tmp_path / "c" / "engines"
    assert s.telemetry.spool_path == tmp_path / "s" / "spool.sqlite"


def _leaf_keys(model: type, prefix: str = "") -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        ann = field.annotation
        inner = getattr(ann, "__args__", (ann,))
        sub = next((a for a in inner if isinstance(a, type) and hasattr(a, "model_fields")), None)
        if sub is not None and name not in ("llm", "asr"):
            keys |= _leaf_keys(sub, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def test_example_config_is_valid_and_documents_every_key():
    settings = load_settings(EXAMPLE)
    assert isinstance(settings, Settings)
    text = EXAMPLE.read_text()
    # Every key appears in the example, set or commented out, so the file documents them all.
    present = set(re.findall(r"^#?\s*([a-z_]+)\s*=", text, flags=re.M))
    for header in re.findall(r"^#?\s*\[\[?([a-z_.]+)\]", text, flags=re.M):
        present |= set(header.split("."))
    for key in _leaf_keys(Settings):
        assert key.split(".")[-1] in present, f"{key} is not documented in {EXAMPLE.name}"
    assert set(SLA_PRESETS) <= set(re.findall(r'"([a-z-]+)"', text)), "SLA presets are listed in the example"
    tomllib.loads(text)


def test_sla_asr_is_its_own_policy_and_flat_sla_keys_stay_the_llm_policy(tmp_path):
    s = load_settings(None)
    a = s.sla.asr
    assert (a.metric, a.percentile, a.target_ms) == ("first_partial_ms", 95, 300.0)  # customer-service ASR
    assert (a.window_s, a.min_samples, a.downgrade_after, a.upgrade_after, a.upgrade_ratio) == (30, 20, 3, 6, 0.7)
    s = load_settings(
        write(
            tmp_path,
            '[sla]\npreset = "customer-service"\ndowngrade_after = 5\n'
            '[sla.asr]\ntarget_ms = 250\nmetric = "final_ms"\ncooldown_s = 5\n',
        )
    )
    assert (s.sla.metric, s.sla.target_ms, s.sla.downgrade_after) == ("ttft_ms", 220.0, 5)
    assert (s.sla.asr.metric, s.sla.asr.target_ms, s.sla.asr.cooldown_s) == ("final_ms", 250.0, 5.0)
    assert s.sla.asr.downgrade_after == 3  # the LLM's knobs do not leak into the ASR policy


def test_sla_asr_preset_unknown_keys_and_llm_metrics_are_rejected(tmp_path, monkeypatch):
    s = load_settings(write(tmp_path, '[sla.asr]\npreset = "asr-customer-service"\npercentile = 99\n'))
    assert (s.sla.asr.metric, s.sla.asr.percentile, s.sla.asr.target_ms) == ("first_partial_ms", 99, 300.0)
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, '[sla.asr]\ntarget = 300\nmetric = "ttft_ms"\nadaptive_batch = "on"\n'))
    problems = dict(err.value.problems)
    assert problems["sla.asr.target"] == "unknown key; did you mean 'target_ms'?"
    assert problems["sla.asr.adaptive_batch"].startswith("unknown key")
    assert "first_partial_ms" in problems["sla.asr.metric"]
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, '[sla.asr]\npreset = "chit-chat"\n'))
    ((where, message),) = err.value.problems
    assert where == "sla.asr" and "asr-customer-service" in message
    monkeypatch.setenv("EDGE_AGENT_SLA__ASR__TARGET_MS", "200")
    assert load_settings(write(tmp_path, "[sla]\ntarget_ms = 400\n")).sla.asr.target_ms == 200.0


def test_unknown_keys_get_the_closest_key_of_their_own_section(tmp_path):
    path = write(
        tmp_path,
        """
[tlemetry]
interval_s = 5
[[models.llm]]
name = "x"
modle = "demo-phi3"
[mqtt.tls]
ca_fiel = "/etc/ca.pem"
[api]
zzzz = 1
""",
    )
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    problems = dict(err.value.problems)
    assert problems["tlemetry"] == "unknown key; did you mean 'telemetry'?"
    assert problems["models.llm[0].modle"] == "unknown key; did you mean 'model'?"
    assert problems["mqtt.tls.ca_fiel"] == "unknown key; did you mean 'ca_file'?"
    # Nothing close: the section's keys are listed instead.
    assert problems["api.zzzz"].startswith("unknown key; this section takes host, port")


def test_messages_never_offer_the_internal_backend(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, '[[models.llm]]\nname = "x"\nmodel = "demo-phi3"\nbackend = "onnxrt"\n'))
    message = dict(err.value.problems)["models.llm[0].backend"]
    assert "did you mean 'onnxruntime'?" in message
    assert "'tensorrt'" in message and "fake" not in message
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, '[[models.llm]]\nname = "x"\nmodel = "demo-phi3"\nbackend = "fak"\n'))
    assert "fake" not in str(err.value)
    # Still accepted where it is used (tests, benchmarks).
    s = load_settings(write(tmp_path, '[[models.llm]]\nname = "x"\nmodel = "demo-phi3"\nbackend = "fake"\n'))
    assert s.models.llm[0].backend == "fake"


def test_logging_section_defaults_and_choices(tmp_path, monkeypatch):
    s = load_settings(None)
    assert (s.logging.level, s.logging.format) == ("info", "text")
    s = load_settings(write(tmp_path, '[logging]\nlevel = "debug"\nformat = "json"\n'))
    assert (s.logging.level, s.logging.format) == ("debug", "json")
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, '[logging]\nformat = "jsn"\nlevel = "loud"\n'))
    problems = dict(err.value.problems)
    assert problems["logging.format"] == "'jsn' is not one of 'text', 'json'; did you mean 'json'?"
    assert problems["logging.level"].startswith("'loud' is not one of 'debug', 'info', 'warning', 'error'")
    monkeypatch.setenv("EDGE_AGENT_LOGGING__FORMAT", "text")
    assert load_settings(write(tmp_path, '[logging]\nformat = "json"\n')).logging.format == "text"


def test_check_config_reports_schema_and_model_problems_in_one_pass(tmp_path):
    from edge_agent.diagnostics.preflight import config_problems

    path = write(
        tmp_path,
        f"""
[mqtt]
hots = "typo"
[mqtt.tls]
ca_file = "{tmp_path / "no-ca.pem"}"
[[models.llm]]
name = "big"
model = "{tmp_path / "no-such-export"}"
[[models.llm]]
name = "small"
model = "demo-phi3"
max_batch = 0
[[models.asr]]
name = "ctc"
model = "demo-phi3"
""",
    )
    problems = dict(config_problems(path))
    assert problems["mqtt.hots"].startswith("unknown key")
    assert "greater than or equal to 1" in problems["models.llm[1].max_batch"]
    assert "no such folder" in problems["models.llm[0].model"]  # found although the schema failed
    assert "not asr" in problems["models.asr[0].model"]
    assert "models.llm[1].model" not in problems  # demo-phi3 exists
    assert problems["mqtt.tls.ca_file"] == f"file not found: {tmp_path / 'no-ca.pem'}"


@pytest.mark.embedded_default
def test_check_config_says_how_to_get_the_default_model_and_finds_imported_models_by_name(
    tmp_path, monkeypatch, capsys
):
    import shutil

    from edge_agent.cli import main

    cache = tmp_path / "models"
    monkeypatch.setenv("EDGE_AGENT_MODELS__CACHE_DIR", str(cache))
    assert main(["check-config"]) == 2  # no file: the built-in defaults, whose model is not fetched yet
    lines = capsys.readouterr().out.strip().splitlines()
    fetch = "is not here yet: get it with `edge-agent models fetch gemma-3-270m-home`"
    keys = ["models.llm[0].model", "models.llm[1].model", "models.asr[0].model"]
    assert [line.split(": ", 1)[0] for line in lines] == keys
    assert all(fetch in line for line in lines[:2]), lines
    assert "edge-agent models fetch whisper-base" in lines[2]  # the default voice tier: real Whisper base
    # once imported (any LLM folder under <cache>/imported/<name>), the name resolves
    shutil.copytree(REPO / "tests" / "data" / "phi3-optimum-tiny", cache / "imported" / "gemma-3-270m-home")
    shutil.copytree(REPO / "edge_agent" / "demo_models" / "demo-whisper", cache / "imported" / "whisper-base")
    assert main(["check-config"]) == 0, capsys.readouterr().out
    # the same for a file that fails its schema (each tier's model checked on its own)
    path = write(tmp_path, '[mqtt]\nhots = "x"\n[[models.llm]]\nname = "a"\nmodel = "gemma-3-270m-home"\n')
    assert main(["check-config", "--config", str(path)]) == 2
    assert "models.llm[0].model" not in capsys.readouterr().out


def test_check_config_cli_prints_every_problem_and_exits_2(tmp_path, capsys):
    from edge_agent.cli import main

    path = write(
        tmp_path, f'[mqtt]\nhots = "x"\n[[models.llm]]\nname = "a"\nmodel = "{tmp_path / "gone"}"\nbackend = "fake2"\n'
    )
    assert main(["check-config", "--config", str(path)]) == 2
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert any(line.startswith("mqtt.hots: unknown key; did you mean 'host'?") for line in lines), out
    assert any(line.startswith("models.llm[0].model: no model") for line in lines), out
    assert any(line.startswith("models.llm[0].backend: 'fake2' is not one of") for line in lines), out
    assert "'fake'" not in out
    assert "3 problem(s)" in err


def test_prompts_are_prefilled_together_on_tensorrt_tiers_only_unless_configured() -> None:
    cpu = LLMTierConfig(name="c", model="demo-phi3")
    gpu = LLMTierConfig(name="g", model="demo-phi3", backend="tensorrt", device="cuda")
    auto = Settings()
    assert (_limits(auto, cpu).prefill_together, _limits(auto, gpu).prefill_together) == (False, True)
    for value in (True, False):
        s = Settings(batching={"prefill_together": value})
        assert _limits(s, cpu).prefill_together is value and _limits(s, gpu).prefill_together is value


@pytest.mark.parametrize("key", ["command_end_silence_ms", "early_end_silence_ms"])
def test_an_early_end_longer_than_the_full_wait_is_refused_by_name(tmp_path, key):
    path = write(tmp_path, f"[audio]\ntrailing_silence_ms = 300\n{key} = 400\n")
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    ((where, msg),) = err.value.problems
    assert where == "audio" and key in msg and "trailing_silence_ms" in msg


def test_the_end_of_turn_keys_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("EDGE_AGENT_AUDIO__COMMAND_END_SILENCE_MS", "140")
    monkeypatch.setenv("EDGE_AGENT_AUDIO__COMMAND_END_MIN_PROB", "0")
    audio = load_settings(None).audio
    assert (audio.command_end_silence_ms, audio.command_end_min_prob) == (140, 0.0)


@pytest.mark.embedded_default
def test_a_tier_names_a_rung_by_a_plain_name_and_the_default_lighter_tier_serves_the_lower_one(tmp_path):
    assert [t.rung for t in load_settings(None).models.llm] == [None, "lower"]
    bad = write(tmp_path, '[[models.llm]]\nname = "a"\nmodel = "demo-phi3"\nrung = "Lower rung!"\n')
    with pytest.raises(ConfigError) as err:
        load_settings(bad)
    assert "rung" in str(err.value)


def test_a_tier_batch_is_its_own_else_the_batching_sections_one_value_every_consumer_reads(tmp_path):
    s = load_settings(
        write(
            tmp_path,
            "[batching]\nmax_batch = 2\npreferred_batch_sizes = [2]\n"
            '[[models.llm]]\nname = "a"\nmodel = "demo-phi3"\nmax_batch = 8\n'
            '[[models.llm]]\nname = "b"\nmodel = "demo-phi3"\n',
        )
    )
    wide, plain = s.models.llm
    # a tier's own batch is not clamped by [batching]'s (it used to be: 8 served as 2)
    assert (_limits(s, wide).max_batch, _limits(s, plain).max_batch) == (8, 2)
    assert _limits(s, wide).preferred_batch_sizes == (2,)


def test_an_asr_tier_refuses_llm_only_keys_by_name(tmp_path):
    path = write(tmp_path, '[[models.asr]]\nname = "w"\nmodel = "whisper-base"\nmax_new_tokens = 64\nrung = "lower"\n')
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    problems = dict(err.value.problems)
    assert set(problems) == {"models.asr[0].max_new_tokens", "models.asr[0].rung"}
