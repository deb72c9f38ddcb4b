"""Configuration: embedded defaults, file + environment, and errors that name file and field."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from trajforge.data.catalog import Catalog
from trajforge.data.notebook import open_catalog
from trajforge.schemas.config import ConfigError, Settings, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("TRAJFORGE_") and name != "TRAJFORGE_REQUIRE_SERVICES":
            monkeypatch.delenv(name)


def test_defaults_without_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = load_settings()
    assert settings.warehouse.path == Path("data/warehouse")
    assert settings.warehouse.catalog_url is None
    from trajforge.envs.apps import known_apps

    # Every bundled app by default but Harbor ID, whose tasks need a password set (TRAJFORGE_SECRET_ACCOUNT_PASSWORD).
    assert sorted(settings.query_gen.apps) == [a for a in known_apps() if a != "account"]


def test_file_then_environment_override(tmp_path, monkeypatch):
    cfg = tmp_path / "trajforge.yaml"
    cfg.write_text("rollout:\n  contexts: 3\n  viewport: desktop\n")
    monkeypatch.setenv("TRAJFORGE_ROLLOUT__CONTEXTS", "4")
    settings = load_settings(cfg)
    assert settings.rollout.contexts == 4
    assert settings.rollout.viewport == "desktop"


def test_unknown_key_names_file_and_field(tmp_path):
    cfg = tmp_path / "trajforge.yaml"
    cfg.write_text("rollout:\n  contxts: 3\n")
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    assert str(cfg) in str(err.value)
    assert "rollout.contxts" in str(err.value)


def test_invalid_value_names_file_and_field(tmp_path):
    cfg = tmp_path / "trajforge.yaml"
    cfg.write_text("rollout:\n  contexts: 0\n")
    with pytest.raises(ConfigError, match=r"trajforge.yaml: field 'rollout.contexts'"):
        load_settings(cfg)


def test_an_unknown_time_zone_is_refused_when_the_config_loads(tmp_path):
    cfg = tmp_path / "trajforge.yaml"
    cfg.write_text("schedule:\n  timezone: Mars/Base\n")
    with pytest.raises(ConfigError, match=r"field 'schedule.timezone': Value error, unknown time zone 'Mars/Base'"):
        load_settings(cfg)
    cfg.write_text("schedule:\n  timezone: Europe/Berlin\n")
    assert load_settings(cfg).schedule.timezone == "Europe/Berlin"


def test_an_invalid_cron_is_refused_when_the_config_loads_without_importing_prefect(tmp_path):
    """`deploy` took `cron: "0 2 * *"` only after it had made the work pool, and died there with a ValueError.
    The config's check is Prefect's own parser, loaded without Prefect: every command loads the config first."""
    cfg = tmp_path / "trajforge.yaml"
    for cron in ("0 2 * *", "61 2 * * *", "H 2 * * *", "R 2 * * *"):
        cfg.write_text(f"schedule:\n  cron: '{cron}'\n")
        with pytest.raises(ConfigError) as refused:
            load_settings(cfg)
        expected = rf"{cfg}: field 'schedule.cron': Value error, .*cron {re.escape(repr(cron))}"
        assert re.search(expected, str(refused.value)), refused.value
    cfg.write_text("schedule:\n  cron: '@daily'\n")  # Prefect takes it
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, pathlib; from trajforge.schemas.config import load_settings; "
         f"print(load_settings(pathlib.Path({str(cfg)!r})).schedule.cron, any(m.startswith('prefect') "
         "for m in sys.modules))"],
        capture_output=True, text=True, check=True, timeout=120)
    assert probe.stdout.split() == ["@daily", "False"]


def test_a_k_of_n_consensus_that_no_verdict_can_reach_is_refused(tmp_path):
    # Three channels at most: k 4 made every verdict a failure and train_e2e empty, with no error.
    cfg = tmp_path / "trajforge.yaml"
    cfg.write_text("critics:\n  consensus: k_of_n\n  k: 3\n")
    with pytest.raises(ConfigError, match=r"field 'critics': Value error, critics.k: 3 channels must say success, "
                                          r"but 2 are asked \(checker, text\)"):
        load_settings(cfg)
    cfg.write_text("critics:\n  consensus: k_of_n\n  k: 3\n  multimodal_model: vl\n")
    assert load_settings(cfg).critics.k == 3


def test_invalid_environment_value_names_variable(monkeypatch):
    monkeypatch.setenv("TRAJFORGE_ROLLOUT__VIEWPORT", "tablet")
    with pytest.raises(ConfigError, match="TRAJFORGE_ROLLOUT__VIEWPORT"):
        load_settings()


@pytest.mark.parametrize(("name", "value"), [("TRAJFORGE_QUERY_GEN__APPS", "shop"), ("TRAJFORGE_ROLLOUT", "{bad")])
def test_a_list_or_section_variable_that_is_not_json_is_named(name, value, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"environment variable {name}: not valid JSON"):
        load_settings()


def test_an_environment_value_is_blamed_on_its_variable_not_on_the_file(tmp_path, monkeypatch):
    cfg = tmp_path / "trajforge.yaml"
    cfg.write_text("rollout:\n  contexts: 2\n")
    monkeypatch.setenv("TRAJFORGE_ROLLOUT__CONTEXTS", "abc")
    with pytest.raises(ConfigError, match="environment variable TRAJFORGE_ROLLOUT__CONTEXTS: field 'rollout.contexts'"):
        load_settings(cfg)


def test_a_secret_variable_is_no_setting_and_no_error(monkeypatch):
    """TRAJFORGE_SECRET_* hold what apps are typed (envs.secrets): never read into the settings, never refused."""
    monkeypatch.setenv("TRAJFORGE_SECRET_ACCOUNT_PASSWORD", "S3NT1NEL-typed")
    settings = load_settings()
    assert "S3NT1NEL-typed" not in settings.model_dump_json()


def test_unknown_environment_variable_suggests_the_setting_it_resembles(monkeypatch):
    monkeypatch.setenv("TRAJFORGE_ROLOUT__CONTEXTS", "2")
    with pytest.raises(ConfigError, match="TRAJFORGE_ROLOUT__CONTEXTS: unknown setting; did you mean "
                                          "TRAJFORGE_ROLLOUT__CONTEXTS\\?") as caught:
        load_settings()
    assert len(str(caught.value)) < 200  # a hint, not every setting there is


@pytest.mark.parametrize(("text", "where"), [
    ("rollout:\n  contexts: [1\n", (r"trajforge.yaml:3:1: not valid YAML: expected ',' or '\]', but got "
                                      r"'<stream end>' \(while parsing a flow sequence from 2:13\)")),
    ("rollout:\n  a: b\n c: d\n", r"trajforge.yaml:3:2: not valid YAML: expected <block end>"),
])
def test_malformed_yaml_names_the_line_and_column(tmp_path, text, where):
    cfg = tmp_path / "trajforge.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=where):
        load_settings(cfg)


@pytest.mark.parametrize(("text", "where"), [
    ("rollout:\n  samples_per_query: 1\nsynth:\n  writer: template\nrollout:\n  max_fault_retries: 2\n",
     r"trajforge.yaml:5:1: not valid YAML: duplicate key 'rollout' \(first at line 1\)"),
    ("rollout:\n  contexts: 2\n  contexts: 3\n",
     r"trajforge.yaml:3:3: not valid YAML: duplicate key 'contexts' \(first at line 2\)"),
])
def test_a_key_given_twice_is_refused_with_its_line(tmp_path, text, where):
    """PyYAML keeps the last of two keys silently: a second `rollout:` section would drop the first's settings."""
    cfg = tmp_path / "trajforge.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=where):
        load_settings(cfg)


def test_a_merged_key_may_still_be_overridden(tmp_path):
    """`<<` merges a mapping's keys to be overridden: no duplicate there."""
    cfg = tmp_path / "trajforge.yaml"
    cfg.write_text("llm:\n  endpoints:\n    a: &a {base_url: 'http://127.0.0.1:9/v1', model: m}\n"
                   "    b:\n      <<: *a\n      model: n\n")
    assert load_settings(cfg).llm.endpoints["b"].model == "n"


def test_a_file_not_in_utf8_is_named_with_its_line_and_byte(tmp_path):
    cfg = tmp_path / "trajforge.yaml"
    cfg.write_bytes("rollout:\n  contexts: 2 # caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as caught:
        load_settings(cfg)
    assert str(caught.value) == f"{cfg}:2:20: not UTF-8: byte 0xe9 (offset 28); save the file as UTF-8"


def test_catalog_url_is_a_secret_and_kept_out_of_hashes(tmp_path):
    cfg = tmp_path / "trajforge.yaml"
    cfg.write_text("warehouse:\n  catalog_url: postgresql+psycopg://u:hunter2@db/x\n")
    settings = load_settings(cfg)
    assert "hunter2" not in repr(settings)
    assert "hunter2" not in settings.model_dump_json()
    assert settings.warehouse.catalog_url.get_secret_value().endswith("@db/x")


def test_how_a_model_is_asked_changes_no_stages_hash_and_what_it_answers_does():
    """A stage's config hash decides what it redoes: turning the response cache off, or an endpoint's timeout,
    concurrency or retries, changes no row and must not re-ground every screen; its model or base URL does."""
    def llm_hash(**llm: object) -> str:
        return Settings(llm=llm).section_hash("synth", "llm")

    vllm = {"base_url": "http://gpu1:8000/v1", "model": "m"}
    base = llm_hash(endpoints={"vllm": vllm})
    assert llm_hash(endpoints={"vllm": vllm}, cache=False) == base
    assert llm_hash(endpoints={"vllm": vllm | {"timeout_s": 5, "max_concurrency": 2, "max_retries": 0}}) == base
    assert llm_hash(endpoints={"vllm": vllm}, local={"cache_dir": "/elsewhere"}) == base
    assert llm_hash(endpoints={"vllm": vllm | {"model": "other"}}) != base
    assert llm_hash(endpoints={"vllm": vllm}, reask=0) != base


@pytest.mark.parametrize(
    ("name", "error"),
    [
        # A lone base URL makes the endpoint, whose model is then missing: the error names that field,
        # which shows the variable reached llm.endpoints.vllm.
        ("TRAJFORGE_LLM__ENDPOINTS__VLLM__BASE_URL", "field 'llm.endpoints.vllm.model': Field required"),
        ("TRAJFORGE_ROLLOUT", "TRAJFORGE_ROLLOUT: field 'rollout': Input should be a valid dictionary"),
        ("TRAJFORGE_ROLLOUT__CONTEXTS__X", "TRAJFORGE_ROLLOUT__CONTEXTS__X: unknown setting"),
        ("TRAJFORGE_LLM__LOCAL__MODLE", "TRAJFORGE_LLM__LOCAL__MODLE: unknown setting"),
    ],
)
def test_nested_environment_variables_that_do_not_fit(name, error, monkeypatch):
    monkeypatch.setenv(name, "1")
    with pytest.raises(ConfigError, match=re.escape(error)):
        load_settings()


def test_nested_environment_variable_lands_in_its_field(monkeypatch):
    monkeypatch.setenv("TRAJFORGE_LLM__LOCAL__MODEL", "1")
    assert load_settings().llm.local.model == "1"


def test_endpoint_given_by_nested_environment_variables(monkeypatch):
    monkeypatch.setenv("TRAJFORGE_LLM__ENDPOINTS__VLLM__BASE_URL", "http://127.0.0.1:8000/v1")
    monkeypatch.setenv("TRAJFORGE_LLM__ENDPOINTS__VLLM__MODEL", "gui-owl-7b")
    monkeypatch.setenv("TRAJFORGE_LLM__DEFAULT", "vllm")
    settings = load_settings()
    assert settings.llm.endpoints["vllm"].model == "gui-owl-7b"
    assert settings.llm.default == "vllm"


def test_model_names_are_every_model_the_config_names(tmp_path):
    """What `datasets expire --checkpoints` keeps: a checkpoint folder named anywhere in the config."""
    config = tmp_path / "trajforge.yaml"
    config.write_text("llm:\n  default: vllm\n  endpoints:\n    vllm: {base_url: 'http://127.0.0.1:8000/v1', "
                      "model: /ck/served}\nrollout:\n  model: /ck/policy\nloop:\n  models: {2: 'vllm:/ck/two'}\n"
                      "critics:\n  step_model: vllm\n")
    names = load_settings(config).model_names()
    assert {"/ck/served", "/ck/policy", "vllm:/ck/two", "vllm"} <= names
    assert not any(n.startswith("http") for n in names)


def test_relative_paths_in_a_config_file_are_taken_from_its_folder(tmp_path, monkeypatch):
    """The CLI took `warehouse.path: wh` of `--config other/trajforge.yaml` as ./wh and a notebook as other/wh:
    the night wrote one warehouse, the notebook opened another. Every path a file gives is the file's folder's, and
    so is the default warehouse of a file that gives none."""
    other = tmp_path.resolve() / "other"
    other.mkdir()
    (other / "trajforge.yaml").write_text(
        "warehouse:\n  path: wh\nquery_gen:\n  app_dirs: [apps/mine, /srv/app]\nguidance:\n  demonstrations: d.jsonl\n"
        "loop:\n  checkpoints_dir: ck\nllm:\n  local:\n    cache_dir: ~/models\n")
    monkeypatch.chdir(tmp_path)
    settings = load_settings(Path("other/trajforge.yaml"))
    assert settings.warehouse.path == other / "wh"
    assert settings.query_gen.app_dirs == [other / "apps/mine", Path("/srv/app")]
    assert settings.guidance.demonstrations == other / "d.jsonl"
    assert settings.loop.checkpoints_dir == other / "ck"
    assert settings.llm.local.cache_dir == Path.home() / "models", "the home folder's, wherever the file is"
    monkeypatch.setenv("TRAJFORGE_WAREHOUSE__PATH", "elsewhere")  # a variable's path: the current folder's
    assert load_settings(Path("other/trajforge.yaml")).warehouse.path == Path("elsewhere")
    monkeypatch.delenv("TRAJFORGE_WAREHOUSE__PATH")
    (other / "bare.yaml").write_text("rollout:\n  contexts: 2\n")  # no warehouse.path: the default, in other/
    assert load_settings(Path("other/bare.yaml")).warehouse.path == other / "data" / "warehouse"
    Catalog.from_settings(load_settings(Path("other/bare.yaml")).warehouse).close()  # a night's, in other/
    monkeypatch.chdir(other / "data")  # a notebook's kernel elsewhere: it finds the night's warehouse by the file
    assert open_catalog(other / "bare.yaml").warehouse == other / "data" / "warehouse"
    monkeypatch.chdir(tmp_path)
    assert load_settings().warehouse.path == Path("data/warehouse"), "no file: the current folder's"


def test_a_home_folder_path_is_the_same_folder_to_every_reader(tmp_path, monkeypatch):
    """`warehouse.path: ~/tf-wh` stayed `~/tf-wh`: the catalog took it as a folder named `~` in the current one and
    `run` wrote there, while `datasets list` and notebooks, which expanded it, looked in $HOME."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trajforge.yaml").write_text("warehouse:\n  path: ~/tf-wh\nquery_gen:\n  app_dirs: [~/app]\n")
    settings = load_settings()
    assert settings.warehouse.path == home / "tf-wh" and settings.query_gen.app_dirs == [home / "app"]
    with Catalog.from_settings(settings.warehouse) as catalog:
        assert catalog.warehouse == home / "tf-wh"
    assert not (tmp_path / "~").exists()
    monkeypatch.setenv("TRAJFORGE_WAREHOUSE__PATH", "~/other")
    assert load_settings().warehouse.path == home / "other"


def test_a_warehouse_section_variable_without_a_path_keeps_the_default_warehouse_beside_the_file(tmp_path,
                                                                                                 monkeypatch):
    """TRAJFORGE_WAREHOUSE='{"catalog_url": ...}' gives no path, yet the default warehouse went to the current
    folder instead of the config file's, where a notebook opening the file looks for it."""
    other = tmp_path.resolve() / "other"
    other.mkdir()
    (other / "trajforge.yaml").write_text("rollout:\n  contexts: 2\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRAJFORGE_WAREHOUSE", '{"catalog_url": "sqlite:///elsewhere.db"}')
    assert load_settings(Path("other/trajforge.yaml")).warehouse.path == other / "data" / "warehouse"
    monkeypatch.setenv("TRAJFORGE_WAREHOUSE", '{"path": "given"}')  # a path the variable gives: the current folder's
    assert load_settings(Path("other/trajforge.yaml")).warehouse.path == Path("given")


def test_a_config_file_hashes_the_same_however_it_is_named(tmp_path, monkeypatch):
    """`deploy` names the config by its absolute path, a hand run in the project as ./trajforge.yaml: the same file
    gives the same paths, so the same config hash, and a once-stage does not redo what the other did."""
    (tmp_path / "trajforge.yaml").write_text("synth:\n  paddle_det_dir: models/det\nquery_gen:\n  app_dirs: [apps]\n")
    monkeypatch.chdir(tmp_path)
    paths = (Path("trajforge.yaml"), tmp_path / "trajforge.yaml", Path("../" + tmp_path.name + "/trajforge.yaml"))
    named = [load_settings(p).section_hash("synth", "query_gen") for p in paths]
    assert len(set(named)) == 1
    assert load_settings(None).section_hash("synth", "query_gen") == named[0]


@pytest.mark.parametrize("text", ["consistency: off", "consistency: 'off'"])
def test_a_choice_written_as_a_yaml_boolean_word_is_that_choice(tmp_path, text):
    """YAML reads an unquoted `off` as False: `synth.consistency: off`, as the README writes it, was refused."""
    cfg = tmp_path / "trajforge.yaml"
    cfg.write_text(f"synth:\n  {text}\n")
    assert load_settings(cfg).synth.consistency == "off"
    cfg.write_text("synth:\n  consistency: on\n")  # no such choice: refused, naming the choices
    with pytest.raises(ConfigError, match=r"field 'synth.consistency': Input should be 'rules' or 'off'"):
        load_settings(cfg)


def test_a_sections_own_check_names_the_variables_that_gave_its_fields(tmp_path, monkeypatch):
    """A check across a section's fields blamed the file (or 'the environment') for values variables gave."""
    cfg = tmp_path / "trajforge.yaml"
    cfg.write_text("critics:\n  consensus: k_of_n\n")
    monkeypatch.setenv("TRAJFORGE_CRITICS__K", "3")
    with pytest.raises(ConfigError, match=rf"{cfg} or environment variable TRAJFORGE_CRITICS__K: field 'critics': "):
        load_settings(cfg)
    monkeypatch.setenv("TRAJFORGE_CRITICS__CONSENSUS", "k_of_n")
    (tmp_path / "no-file").mkdir()
    monkeypatch.chdir(tmp_path / "no-file")
    both = "environment variables TRAJFORGE_CRITICS__CONSENSUS, TRAJFORGE_CRITICS__K"
    with pytest.raises(ConfigError, match=rf"  {both}: field 'critics': "):
        load_settings()


def test_an_endpoint_key_in_the_config_is_stripped_and_a_character_no_header_takes_is_refused(tmp_path, monkeypatch):
    """A key given as a YAML `|` block ends in a newline: every call failed as a connection error, retried, and
    httpx's debug log quoted the key; a non-ASCII one raised a UnicodeEncodeError quoting it. The file's newline
    is stripped; either character is refused as the config loads, naming the file or variable and the field,
    never the key."""
    secret = "sk-trajforge-CONFIGKEY-93be"
    cfg = tmp_path / "trajforge.yaml"
    cfg.write_text(f"llm:\n  endpoints:\n    vllm:\n      base_url: http://127.0.0.1:8000/v1\n      model: m\n"
                   f"      api_key: |\n        {secret}\n")
    assert load_settings(cfg).llm.endpoints["vllm"].api_key.get_secret_value() == secret
    cfg.write_text(f"llm:\n  endpoints:\n    vllm: {{base_url: 'http://x/v1', model: m, api_key: '{secret}’x'}}\n")
    with pytest.raises(ConfigError, match=r"trajforge.yaml: field 'llm.endpoints.vllm.api_key': .*non-ASCII") as err:
        load_settings(cfg)
    assert secret not in str(err.value)
    cfg.write_text("")
    monkeypatch.setenv("TRAJFORGE_LLM__ENDPOINTS",
                       f'{{"b": {{"base_url": "http://x/v1", "model": "m", "api_key": "{secret}\\u0007"}}}}')
    with pytest.raises(ConfigError, match=r"environment variable TRAJFORGE_LLM__ENDPOINTS: field "
                                          r"'llm.endpoints.b.api_key': .*control character") as err:
        load_settings(cfg)
    assert secret not in str(err.value)


def test_a_check_across_fields_names_the_file_or_variable_that_set_the_field(tmp_path, monkeypatch):
    """The preflight's checks of a field against others (an app against those installed, loop.serve against the
    endpoints) named the field only: TRAJFORGE_QUERY_GEN__APPS='["shopp"]' gave `query_gen.apps: unknown app`,
    leaving the user to find which of the file and the environment said so."""
    from trajforge.flows.preflight import preflight

    cfg = tmp_path / "trajforge.yaml"
    cfg.write_text("loop:\n  serve: vlm\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(cfg))}: loop.serve: 'vlm' is neither 'local' nor"):
        preflight(str(cfg), models=False)
    cfg.write_text("loop:\n  train_tables: [train_e2ee]\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(cfg))}: loop.train_tables: \['train_e2ee'\] are not"):
        preflight(str(cfg), models=False)
    monkeypatch.setenv("TRAJFORGE_QUERY_GEN__APPS", '["shopp"]')
    with pytest.raises(ConfigError, match=r"^environment variable TRAJFORGE_QUERY_GEN__APPS: query_gen.apps: "
                                          r"unknown app 'shopp'"):
        preflight(str(cfg), models=False)


def test_the_dask_engine_needs_a_postgresql_catalog(tmp_path, monkeypatch):
    """Several worker processes record their shards in the catalog's database, and a worker on another machine
    cannot open a SQLite file: a SQLite catalog_url passed the preflight, though `run` was said to refuse it."""
    from trajforge.flows.preflight import preflight

    cfg = tmp_path / "trajforge.yaml"
    cfg.write_text(f"runner:\n  engine: dask\nwarehouse:\n  catalog_url: sqlite:///{tmp_path}/catalog.db\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(cfg))}: runner.engine: dask needs a PostgreSQL "
                                          r"warehouse.catalog_url \(it is sqlite\)"):
        preflight(str(cfg), models=False)
    monkeypatch.setenv("TRAJFORGE_WAREHOUSE__CATALOG_URL", "postgresql+psycopg://db.example/trajforge")
    assert preflight(str(cfg), models=False).runner.engine == "dask"


def test_settings_built_in_code_do_not_repeat_a_refused_key() -> None:
    """A notebook building Settings itself gets pydantic's error, which repeated the refused value
    (`input_value='sk-...'`): the key reached the notebook's output."""
    with pytest.raises(ValidationError) as err:
        Settings(llm={"endpoints": {"x": {"base_url": "http://127.0.0.1:9/v1", "model": "m",
                                          "api_key": "sk-TOPSECRET\x01"}}})
    assert "llm.endpoints.x.api_key" in str(err.value) and "TOPSECRET" not in str(err.value)
