"""What a command checks before it starts work, so a scheduled run fails in seconds, not hours in.

Apart from the flows (flows.pipeline) so that the commands that only read the warehouse (`datasets`, `report`,
`export`) check the config without importing Prefect (about 1.7 s on 2 cores).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

from trajforge.envs.kinds import configured_kinds
from trajforge.guidance.stage import load_demonstrations
from trajforge.llm.local import SMOLLM2, checkpoint, missing_models
from trajforge.schemas.config import ConfigError, Settings, config_path, load_settings, set_by
from trajforge.train.stage import check_train_tables


def preflight(config: str | None, models: bool = True) -> Settings:
    """Everything that can be checked before work starts: the config, every app spec and MiniWoB++ task, the
    demonstrations file and, with `models`, the models the config asks (`check_models`), so a scheduled run
    fails in seconds."""
    path = config_path(Path(config) if config else None)
    settings = load_settings(path)
    named = partial(_named, path)
    if settings.runner.engine == "dask":
        _check_dask_catalog(settings, named)
    configured_kinds(settings, named)
    check_train_tables(settings.loop.train_tables, named)
    serve = settings.loop.serve
    if serve != "local" and serve not in settings.llm.endpoints:
        raise ConfigError(f"{named('loop.serve')}: {serve!r} is neither 'local' nor an llm endpoint "
                          f"(configured: {', '.join(settings.llm.endpoints) or 'none'})")
    if settings.guidance.demonstrations is not None:  # read by the guidance stage, after query generation
        try:
            load_demonstrations(settings.guidance.demonstrations)
        except OSError as exc:
            raise ConfigError(f"guidance.demonstrations: cannot read {settings.guidance.demonstrations}: "
                              f"{exc.strerror or exc}") from None
        except ValueError as exc:
            raise ConfigError(f"guidance.demonstrations: {exc}") from None
    if models:
        check_models(settings)
    return settings


def _named(path: Path | None, field: str) -> str:
    """`field` as a check across fields names it: after where its value was set, as `load_settings` names a field
    it refuses (the variable, else the config file), since the fields it is checked against may be set elsewhere."""
    return f"{set_by(tuple(field.split('.')), path)}: {field}"


def _check_dask_catalog(settings: Settings, named: Callable[[str], str]) -> None:
    """ConfigError unless the catalog is on PostgreSQL: the workers record their shards in the catalog's database
    from other processes and machines, which a SQLite file beside the warehouse does not take."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    url = settings.warehouse.catalog_url
    try:
        backend = make_url(url.get_secret_value()).get_backend_name() if url is not None else None
    except ArgumentError as exc:
        raise ConfigError(f"{named('warehouse.catalog_url')}: {exc}") from None
    if backend != "postgresql":
        given = f"it is {backend}" if backend else "it is not set"
        raise ConfigError(f"{named('runner.engine')}: dask needs a PostgreSQL warehouse.catalog_url ({given}): the "
                          "workers record their shards in the catalog's database from other processes and machines")


def _asked(settings: Settings) -> list[tuple[str, str]]:
    """(the setting that names it, model) for every llm model the configured stages ask; none for a run of rules
    and templates (replay or random policy, rule critics, template writers), which needs no model at all."""
    s = settings
    loop_model = s.loop.models.get(s.loop.iteration)
    asked = [
        (s.query_gen.instructions == "model", "query_gen.instruction_model", s.query_gen.instruction_model),
        (s.rollout.policy in ("gui_owl_e2e", "mobile_agent_v3"),
         f"loop.models.{s.loop.iteration}" if loop_model else "rollout.model", loop_model or s.rollout.model),
        (s.critics.step_critic == "model", "critics.step_model", s.critics.step_model),
        (s.critics.text_channel, "critics.text_model", s.critics.text_model),
        (s.guidance.describer == "model", "guidance.model", s.guidance.model),
        (s.synth.writer == "model", "synth.model", s.synth.model),
        (s.synth.writer == "model", "rollout.model", s.rollout.model),  # agentic_q samples the policy's model
        (bool(s.critics.multimodal_model), "critics.multimodal_model", s.critics.multimodal_model),  # only if named
        (bool(s.synth.vision_model), "synth.vision_model", s.synth.vision_model),
    ]
    return [(field if model else "llm.default", model or s.llm.default) for on, field, model in asked if on]


def _served(settings: Settings, name: str) -> bool:
    """Whether `name` is 'local', an endpoint or ENDPOINT:MODEL (`Gateway.backend` asks these first)."""
    endpoint, colon, _ = name.partition(":")
    return name == "local" or name in settings.llm.endpoints or (bool(colon) and endpoint in settings.llm.endpoints)


def check_models(settings: Settings) -> None:
    """Raise ConfigError unless the models the config asks can answer: the gateway reads every endpoint's key
    variable when it opens, and an in-process model ('local', or a checkpoint folder named by its path) needs its
    packages and checkpoint. Names the variable, never its value."""
    asked = _asked(settings)
    if not asked:
        return
    for field, name in asked:
        if _served(settings, name):
            continue
        if not os.path.isabs(name):  # a typo would otherwise surface mid-night, at the stage that asks it
            raise ConfigError(f"{field}: no model named {name!r} (configured: "
                              f"{', '.join(['local', *settings.llm.endpoints])}; or ENDPOINT:MODEL, or a checkpoint "
                              "folder's absolute path)")
        # A checkpoint folder is served in process, as 'local' is; the gateway would blame llm.local.model for it.
        # The folder first: a mistyped path is not fixed by installing the packages.
        try:
            checkpoint(name)
        except FileNotFoundError:
            raise ConfigError(f"{field}: {name} is not a transformers checkpoint folder (no config.json)") from None
        reason = missing_models(embedded=False)
        if reason:
            raise ConfigError(f"{field}: the in-process model {name} cannot run: {reason}")
    for name, endpoint in settings.llm.endpoints.items():
        if endpoint.api_key is None and endpoint.api_key_env and not os.environ.get(endpoint.api_key_env):
            raise ConfigError(
                f"llm.endpoints.{name}.api_key_env: environment variable {endpoint.api_key_env} is not set")
    if any(name == "local" for _, name in asked):
        local = settings.llm.local.model
        reason = missing_models(embedded=local == SMOLLM2)
        if reason:
            raise ConfigError(f"llm.local: the in-process model cannot run: {reason}")
        try:
            checkpoint(local)
        except FileNotFoundError as exc:
            raise ConfigError(str(exc)) from None
