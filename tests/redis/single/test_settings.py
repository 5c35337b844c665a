"""Settings layers (defaults < TOML < REDBATCH_* environment < flags) and their errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.rigs.paths import REPO_ROOT
from worker.cli import build_parser
from worker.cli_flags import setting_overrides
from worker.models import create_model
from worker.setting_groups import GROUP_NAMES, GROUPS
from worker.setting_sources import INHERITED
from worker.settings import Settings, SettingsError, exported, load_settings

CONFIGS = REPO_ROOT / "configs"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's own REDBATCH_* variables must not leak into these tests."""
    for name in [*Settings.model_fields, "setting_sources"]:
        monkeypatch.delenv(f"REDBATCH_{name.upper()}", raising=False)


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "worker.toml"
    path.write_text(text)
    return path


def flags(*argv: str) -> dict[str, object]:
    """The overrides the CLI would pass for these flags."""
    return setting_overrides(build_parser().parse_args(["run", *argv]))


def test_defaults() -> None:
    settings = load_settings()
    assert (settings.redis_url, settings.model, settings.model_name) == (None, "minilm", "minilm")
    assert (settings.namespace, settings.group) == ("redbatch", "workers")
    assert settings.bucket_boundaries is None  # the model's own default
    assert settings.result_ttl_ms == 3_600_000 and settings.metrics_port == 9100


def test_each_layer_overrides_the_one_below(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path, """
        model = "echo"
        max_batch_size = 2
        max_wait_ms = 3.0
        max_batch_tokens = 300
        bucket_boundaries = [8]
        [model_options]
        delay_ms = 1
    """)
    monkeypatch.setenv("REDBATCH_MAX_WAIT_MS", "4")
    monkeypatch.setenv("REDBATCH_MAX_BATCH_TOKENS", "400")
    monkeypatch.setenv("REDBATCH_BUCKET_BOUNDARIES", "[16, 32]")
    monkeypatch.setenv("REDBATCH_MODEL_OPTIONS", '{"delay_ms": 2}')
    settings = load_settings(config, **flags("--max-batch-tokens", "500",
                                             "--model-options", '{"delay_ms": 3}'))
    assert settings.model == "echo"  # TOML over the default
    assert settings.max_batch_size == 2  # TOML, nothing above it
    assert settings.max_wait_ms == 4.0  # environment over TOML
    assert settings.bucket_boundaries == [16, 32]  # environment JSON over TOML
    assert settings.max_batch_tokens == 500  # flag over environment
    assert settings.model_options == {"delay_ms": 3}  # flag JSON over environment


def test_the_environment_names_of_the_issue(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"REDIS_URL": "redis://h:1/2", "MODEL": "echo",
                        "MODEL_OPTIONS": '{"delay_ms": 5}', "MAX_BATCH_SIZE": "7",
                        "MAX_BATCH_TOKENS": "70", "MAX_WAIT_MS": "0",
                        "BUCKET_BOUNDARIES": "[]", "METRICS_PORT": "0"}.items():
        monkeypatch.setenv(f"REDBATCH_{name}", value)
    settings = load_settings()
    assert (settings.redis_url, settings.model, settings.model_options) == (
        "redis://h:1/2", "echo", {"delay_ms": 5})
    assert (settings.max_batch_size, settings.max_batch_tokens, settings.max_wait_ms) == (
        7, 70, 0.0)
    assert settings.bucket_boundaries == [] and settings.metrics_port == 0


def test_plugin_models_are_named_by_their_class() -> None:
    assert load_settings(model="mypkg.models:BigEncoder").model_name == "bigencoder"
    assert load_settings(model="mypkg.models:BigEncoder", model_name="big").model_name == "big"


@pytest.mark.parametrize("overrides, message", [
    ({"max_batch_size": "0"}, "invalid setting 'max_batch_size' from --max-batch-size (flag)"),
    ({"max_wait_ms": "soon"}, "invalid setting 'max_wait_ms'"),
    ({"bucket_boundaries": [32, 16]}, "strictly increasing"),
    ({"metrics_port": "70000"}, "invalid setting 'metrics_port'"),
    ({"log_level": "loud"}, "invalid setting 'log_level'"),
    ({"no_such_setting": "1"}, "unknown setting 'no_such_setting'"),
])
def test_invalid_settings_name_the_setting(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(**overrides)
    assert message in str(caught.value)


@pytest.mark.parametrize("overrides, message", [
    ({"batch_controller": "aimd", "controller_target_ms": 50, "latency_target_ms": 100},
     "batch_controller 'aimd' is a baseline that replaces latency_target_ms"),
    ({"batch_controller": "step"}, "batch_controller 'step' needs controller_target_ms"),
    ({"controller_target_ms": 50}, "controller_target_ms is for batch_controller aimd or step"),
    ({"batch_controller": "dynamic_timeout", "controller_target_ms": 50},
     "not 'dynamic_timeout'"),
    ({"batch_controller": "pid"}, "invalid setting 'batch_controller'"),
    ({"batch_controller": "aimd", "controller_target_ms": 0},
     "invalid setting 'controller_target_ms'"),
])
def test_a_baseline_controller_refuses_bad_combinations(overrides: dict[str, object],
                                                        message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(**overrides)
    assert message in str(caught.value) and len(str(caught.value).splitlines()) == 1


def test_a_baseline_controller_from_flags() -> None:
    settings = load_settings(**flags("--batch-controller", "step", "--controller-target-ms", "80"))
    assert settings.batch_controller == "step" and settings.controller_target_ms == 80.0
    assert settings.latency_target_ms is None and load_settings().batch_controller == "static"


def test_a_malformed_json_flag_is_a_settings_error() -> None:
    with pytest.raises(SettingsError, match="--bucket-boundaries takes JSON"):
        flags("--bucket-boundaries", "[16,")


def test_a_malformed_json_environment_value_is_a_settings_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDBATCH_MODEL_OPTIONS", "{delay_ms: 1}")
    with pytest.raises(SettingsError, match="model_options"):
        load_settings()


def test_a_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="config file not found"):
        load_settings(tmp_path / "absent.toml")


def test_a_broken_config_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="worker.toml is not valid TOML: "):
        load_settings(write_config(tmp_path, "max_batch_size = [unclosed\n"))


def test_an_unknown_key_in_the_config_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="max_batch_sise"):
        load_settings(write_config(tmp_path, "max_batch_sise = 4\n"))


@pytest.mark.parametrize("name", ["minilm", "echo"])
def test_shipped_configs_load_and_build_their_model(name: str) -> None:
    settings = load_settings(CONFIGS / f"{name}.toml")
    assert settings.model == name and settings.model_name == name
    assert settings.bucket_boundaries  # the config states its buckets explicitly
    create_model(settings.model, settings.model_options)  # every option is a real one


def test_a_higher_layer_replaces_model_options_whole(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each setting comes whole from the highest layer that sets it: a dictionary is not
    merged key by key with the one below (pydantic-settings' own behaviour)."""
    config = tmp_path / "worker.toml"
    config.write_text('model = "minilm"\n[model_options]\nmax_seq_length = 128\n')
    assert load_settings(config).model_options == {"max_seq_length": 128}
    assert load_settings(config, model_options={}).model_options == {}
    monkeypatch.setenv("REDBATCH_MODEL_OPTIONS", '{"a": 1}')
    assert load_settings(config).model_options == {"a": 1}
    assert load_settings(config, model_options={"b": 2}).model_options == {"b": 2}


def test_a_rule_across_settings_does_not_print_them_with_their_secrets() -> None:
    with pytest.raises(SettingsError) as raised:
        load_settings(redis_url="redis://:hunter2@127.0.0.1:6379/0",
                      memory_low_watermark=0.95, memory_high_watermark=0.9)
    assert "hunter2" not in str(raised.value)
    assert "memory_low_watermark must be below" in str(raised.value)


def test_a_password_setting_needs_a_url_and_is_never_printed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError, match="redis_password needs redis_url"):
        load_settings(redis_password="hunter2")
    monkeypatch.setenv("REDBATCH_REDIS_PASSWORD", "hunter2")
    settings = load_settings(redis_url="redis://127.0.0.1:6379/0")
    assert settings.redis_secret == "hunter2"
    assert "hunter2" not in repr(settings) and "hunter2" not in str(settings.model_dump())
    assert exported(settings)["redis_password"] == "hunter2"  # for a child's environment
    monkeypatch.setenv("REDBATCH_REDIS_PASSWORD", "")
    with pytest.raises(SettingsError) as raised:
        load_settings(redis_url="redis://127.0.0.1:6379/0")
    assert "redis_password" in str(raised.value) and "got" not in str(raised.value)


def test_every_setting_has_exactly_one_group() -> None:
    """--help groups the settings (setting_groups.py): a new setting must be given one."""
    grouped = [name for _, _, names in GROUPS for name in names]
    assert sorted(grouped) == sorted(Settings.model_fields), "each setting once, none unknown"
    assert set(GROUP_NAMES) == {"connection", "batching", "model", "memory", "latency",
                                "cluster", "observability"}


def test_settings_remember_the_layer_each_came_from(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path, "max_batch_size = 2\nmax_wait_ms = 3.0\nblock_ms = 50\n")
    monkeypatch.setenv("REDBATCH_MAX_WAIT_MS", "4")
    monkeypatch.setenv("redbatch_read_count", "8")  # matched whatever the case, as pydantic does
    settings = load_settings(config, **flags("--block-ms", "70"))
    assert settings.where("block_ms") == "--block-ms (flag)"
    assert settings.where("max_wait_ms") == "REDBATCH_MAX_WAIT_MS (environment)"
    assert settings.where("read_count") == "REDBATCH_READ_COUNT (environment)"
    assert settings.where("max_batch_size") == f"max_batch_size in {config} (file)"
    assert settings.where("max_inflight") == "max_inflight (default)"


@pytest.mark.parametrize("layer, where", [
    ("flag", "--max-batch-size (flag)"),
    ("environment", "REDBATCH_MAX_BATCH_SIZE (environment)"),
    ("file", "max_batch_size in {config} (file)"),
])
def test_an_invalid_setting_names_the_layer_it_came_from(
        layer: str, where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path, "max_batch_size = 0\n" if layer == "file" else "")
    if layer == "environment":
        monkeypatch.setenv("REDBATCH_MAX_BATCH_SIZE", "0")
    overrides = flags("--max-batch-size", "0") if layer == "flag" else {}
    with pytest.raises(SettingsError) as raised:
        load_settings(config, **overrides)
    assert f"invalid setting 'max_batch_size' from {where.format(config=config)}: " \
        in str(raised.value)


def test_a_rule_across_settings_names_where_each_came_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDBATCH_MEMORY_LOW_WATERMARK", "0.95")
    config = write_config(tmp_path, "memory_high_watermark = 0.9\n")
    with pytest.raises(SettingsError) as raised:
        load_settings(config)
    assert str(raised.value) == (
        "invalid settings: memory_low_watermark must be below memory_high_watermark "
        "[REDBATCH_MEMORY_LOW_WATERMARK (environment); "
        f"memory_high_watermark in {config} (file)]")
    monkeypatch.delenv("REDBATCH_MEMORY_LOW_WATERMARK")
    with pytest.raises(SettingsError) as raised:
        load_settings(**flags("--reply-prefixes", '["redbatch:"]'))
    assert str(raised.value).endswith("[--reply-prefixes (flag)]")


def test_an_unknown_key_names_its_file(tmp_path: Path) -> None:
    config = write_config(tmp_path, "max_batch_sise = 4\n")
    with pytest.raises(SettingsError, match=f"unknown setting 'max_batch_sise' in {config} "):
        load_settings(config)


def test_a_message_names_the_source_of_each_setting_it_names(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up errors (the CLI's refuse): flags and snake_case names are found in the
    message, one-word settings are named by the raiser."""
    monkeypatch.setenv("REDBATCH_DTYPE", "bfloat16")
    sources = load_settings(**flags("--metrics-port", "9100")).sources
    assert sources.annotate("give each its own --metrics-port") == \
        "give each its own --metrics-port [--metrics-port (flag)]"
    assert sources.annotate("dtype bfloat16 needs a CUDA device", ["dtype"]) == \
        "dtype bfloat16 needs a CUDA device [REDBATCH_DTYPE (environment)]"
    assert sources.annotate("raise memory_limit_bytes") == \
        "raise memory_limit_bytes [memory_limit_bytes (default)]"
    assert sources.annotate("nothing here: a model, a group") == "nothing here: a model, a group"


def test_a_child_process_names_the_sources_its_parent_saw(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor hands its children their settings as flags; their messages still name
    what the user set."""
    monkeypatch.setenv("REDBATCH_METRICS_PORT", "9101")
    parent = load_settings(**flags("--max-batch-size", "4"))
    handed = parent.sources.environment_for_children()
    monkeypatch.delenv("REDBATCH_METRICS_PORT")
    monkeypatch.setenv(INHERITED, handed[INHERITED])
    child = load_settings(**flags("--max-batch-size", "4", "--metrics-port", "9101",
                                  "--consumer", "w-0"))
    assert child.where("metrics_port") == "REDBATCH_METRICS_PORT (environment)"
    assert child.where("max_batch_size") == "--max-batch-size (flag)"
    assert child.where("consumer") == "--consumer (flag)"  # the parent left it at its default
