"""The floor plan: which room may import which, what the package list says, and what a real install ships.

The repository root is the package `trajforge`; its top-level folders are the rooms
(`trajforge.schemas`, `trajforge.data`, ...). Three things keep that true:

- the import graph: a room imports only rooms below it (and itself), the rooms form no
  cycle, and nothing imports a room by its bare name (`import llm` works in the checkout
  by accident, because the repository root is on sys.path, and breaks once installed);
- pyproject's explicit package list names every folder that has an `__init__.py`
  (setuptools' finder cannot put the folders under one name, so a folder left out is
  silently missing from the install);
- a wheel built from the repository and installed without the editable finder holds one
  import name, every data file the code loads at run time, and works.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# The floor plan, bottom to top. A room may import only itself and the rooms in the tiers
# below its own. Rooms in one tier are siblings and may not import each other
# (query_gen and rollout both sit on envs; neither sees the other).
ROOM_TIERS: tuple[tuple[str, ...], ...] = (
    ("schemas",),
    ("data",),
    ("llm",),
    ("envs",),
    ("query_gen", "rollout"),
    ("critics",),
    ("guidance",),
    ("synth",),
    ("train",),
    ("tasks",),
    ("flows",),
)

PACKAGE = "trajforge"
REPO = Path(__file__).resolve().parent.parent

# Non-.py files the code opens at run time, relative to the repository root (= the package).
# Globbed against the repository, so a new app, static file or prompt is covered without edits here.
RUNTIME_DATA_GLOBS: tuple[str, ...] = (
    "envs/apps/*/spec.yaml",
    "envs/apps/*/static/*",
    "envs/apps/_shared/static/interactions.js",
    "*/prompts/*.yaml",  # every room's prompts (llm, guidance, synth, ...), loaded by name at run time
)

ROOMS: tuple[str, ...] = tuple(room for tier in ROOM_TIERS for room in tier)
RANK: dict[str, int] = {room: i for i, tier in enumerate(ROOM_TIERS) for room in tier}
FLOOR_PLAN = " < ".join(tier[0] if len(tier) == 1 else "{" + ", ".join(tier) + "}" for tier in ROOM_TIERS)


# --- the import graph --------------------------------------------------------------------


@dataclass(frozen=True)
class RoomImport:
    """One import statement that names a room: where it is, what it imports, as which room."""

    file: str  # relative to the scanned root, posix
    line: int
    module: str  # the imported module, relative imports resolved (bare names as written)
    source: str  # the room the file is in
    target: str  # the room the module is in
    bare: bool  # the room was named without the `trajforge.` prefix

    def __str__(self) -> str:
        return f"{self.file}:{self.line} -> {self.module}"


@dataclass
class ImportGraphReport:
    """Every import of a room found under a root, and the ones that break the floor plan."""

    imports: list[RoomImport] = field(default_factory=list)
    unparsable: list[str] = field(default_factory=list)

    @property
    def upward(self) -> list[RoomImport]:
        return [i for i in self.imports if RANK[i.target] > RANK[i.source]]

    @property
    def sibling(self) -> list[RoomImport]:
        return [i for i in self.imports if RANK[i.target] == RANK[i.source] and i.target != i.source]

    @property
    def bare(self) -> list[RoomImport]:
        return [i for i in self.imports if i.bare]

    @property
    def cycles(self) -> list[tuple[list[str], list[RoomImport]]]:
        """Each group of rooms that import one another round in a circle (a strongly connected
        component of more than one room), with the imports between them."""
        edges: dict[str, set[str]] = {room: set() for room in ROOMS}
        for i in self.imports:
            if i.source != i.target:
                edges[i.source].add(i.target)
        reach = {room: _reachable(room, edges) for room in ROOMS}
        groups: list[list[str]] = []
        for room in ROOMS:
            group = [other for other in ROOMS if other in reach[room] and room in reach[other]]
            if room in group and len(group) > 1 and group not in groups:
                groups.append(group)
        return [
            (group, [i for i in self.imports if i.source in group and i.target in group and i.source != i.target])
            for group in groups
        ]

    def message(self) -> str:
        """'' when the graph keeps the floor plan; else every offence as `file:line -> module`."""
        parts: list[str] = []
        if self.unparsable:
            parts.append("files that could not be checked:\n" + _lines(self.unparsable))
        if self.upward:
            parts.append("a room imports a room above it:\n"
                         + _lines(f"{i}   ({i.source} -> {i.target})" for i in self.upward))
        if self.sibling:
            parts.append("a room imports its sibling (neither may import the other):\n"
                         + _lines(f"{i}   ({i.source} -> {i.target})" for i in self.sibling))
        for group, imports in self.cycles:
            parts.append(f"import cycle between rooms {{{', '.join(group)}}}; the imports among them:\n"
                         + _lines(f"{i}   ({i.source} -> {i.target})" for i in imports))
        if self.bare:
            parts.append(f"a room imported by its bare name (works only from the checkout; write {PACKAGE}.<room>):\n"
                         + _lines(self.bare))
        if not parts:
            return ""
        return f"the import graph breaks the floor plan ({FLOOR_PLAN}):\n\n" + "\n\n".join(parts)


def _lines(items: Iterable[object]) -> str:
    return "\n".join(f"  {item}" for item in items)


def _reachable(start: str, edges: dict[str, set[str]]) -> set[str]:
    seen: set[str] = set()
    todo = list(edges[start])
    while todo:
        room = todo.pop()
        if room not in seen:
            seen.add(room)
            todo.extend(edges[room])
    return seen


def python_files(root: Path) -> list[Path]:
    """The .py files of every room under `root` (rooms absent there are skipped)."""
    files: list[Path] = []
    for room in ROOMS:
        files += [p for p in (root / room).rglob("*.py")
                  if not any(part == "__pycache__" or part.startswith(".") for part in p.relative_to(root).parts)]
    return sorted(files)


def _room_of(module: str) -> tuple[str | None, bool]:
    """(room, bare) of an absolute module name; room is None when it names no room."""
    parts = module.split(".")
    if parts[0] in RANK:
        return parts[0], True
    if parts[0] == PACKAGE and len(parts) > 1 and parts[1] in RANK:
        return parts[1], False
    return None, False


def room_imports(root: Path, path: Path) -> list[tuple[int, str, str, bool]]:
    """(line, module, room, bare) for each room that the file at `path` imports, at any depth
    (inside functions and `if TYPE_CHECKING:` too), relative imports resolved against the
    file's place in the package. Raises SyntaxError for a file that does not parse, or whose
    relative import climbs above the package."""
    # The package a relative import starts from: the file's folder (for an __init__.py too).
    package = [PACKAGE, *path.relative_to(root).parent.parts]
    found: list[tuple[int, str, str, bool]] = []
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level > len(package):  # Python refuses it too, at run time
                    error = SyntaxError(f"relative import (level {node.level}) beyond the top of {PACKAGE}")
                    error.lineno = node.lineno
                    raise error
                base = package[: len(package) - (node.level - 1)]
                modules = [".".join([*base, *([node.module] if node.module else [])])]
            else:
                modules = [node.module or ""]
            # `from trajforge import llm` / `from .. import llm`: the names are the rooms.
            if modules == [PACKAGE]:
                modules = [f"{PACKAGE}.{alias.name}" for alias in node.names]
        for module in modules:
            room, bare = _room_of(module)
            if room is not None:
                found.append((node.lineno, module, room, bare))
    return found


def check_import_graph(root: Path) -> ImportGraphReport:
    """Every room import under `root`, `root` being laid out like the repository (root = the package)."""
    report = ImportGraphReport()
    for path in python_files(root):
        rel = path.relative_to(root)
        try:
            found = room_imports(root, path)
        except SyntaxError as exc:
            report.unparsable.append(f"{rel.as_posix()}:{exc.lineno}: {exc.msg}")
            continue
        for line, module, target, bare in found:
            report.imports.append(RoomImport(rel.as_posix(), line, module, rel.parts[0], target, bare))
    return report


def test_import_graph_keeps_the_floor_plan() -> None:
    """A room sees only the rooms below it, so each layer can be understood, tested and
    changed without the ones above; a cycle makes two rooms one; and a bare room name
    (`import llm`) imports fine from the checkout but fails once `trajforge` is installed."""
    report = check_import_graph(REPO)
    assert len({i.source for i in report.imports}) > len(ROOMS) // 2, "the checker found almost no imports"
    message = report.message()
    if message:
        pytest.fail(message, pytrace=False)


def test_import_checker_flags_a_planted_violation(tmp_path: Path) -> None:
    """The checker itself works: on a tiny fake tree it flags an upward import, a sibling
    import, a bare name and the cycle they make, relative and nested imports included, and
    passes the downward ones, so the real test cannot pass by finding nothing."""
    files = {
        "schemas/__init__.py": "",
        "schemas/records.py": "from trajforge.flows import cli\n",  # upward
        "data/catalog.py": "from trajforge.schemas.records import X\nimport trajforge\n",  # fine
        "llm/__init__.py": "from .. import data\nfrom .. import envs\n",  # fine, then upward (relative)
        "envs/__init__.py": "",
        "query_gen/__init__.py": "def f() -> None:\n    from trajforge.rollout import stage\n",  # sibling, nested
        "rollout/stage.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from ..query_gen import x\n"  # sibling, relative, TYPE_CHECKING
        ),
        "flows/cli.py": "from ..schemas import records\nimport envs.spec\n",  # fine, then bare
        "synth/bad.py": "from ... import x\n",  # climbs above trajforge
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    report = check_import_graph(tmp_path)

    assert sorted(map(str, report.upward)) == [
        "llm/__init__.py:2 -> trajforge.envs",
        "schemas/records.py:1 -> trajforge.flows",
    ]
    assert sorted(map(str, report.sibling)) == [
        "query_gen/__init__.py:2 -> trajforge.rollout",
        "rollout/stage.py:3 -> trajforge.query_gen",
    ]
    assert [str(i) for i in report.bare] == ["flows/cli.py:2 -> envs.spec"]
    assert [group for group, _ in report.cycles] == [["schemas", "flows"], ["query_gen", "rollout"]]
    assert [entry.split(": ")[0] for entry in report.unparsable] == ["synth/bad.py:1"]
    message = report.message()
    for expected in ("schemas/records.py:1 -> trajforge.flows", "flows/cli.py:2 -> envs.spec",
                     "rollout/stage.py:3 -> trajforge.query_gen", "import cycle between rooms"):
        assert expected in message


def test_every_top_level_package_is_a_room() -> None:
    """A new top-level package must get a place in ROOM_TIERS, or the import-graph test
    would not look at it at all; and every room in the plan must exist."""
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert packages == set(ROOMS), (
        f"top-level packages not in ROOM_TIERS: {sorted(packages - set(ROOMS))}; "
        f"rooms in ROOM_TIERS that are no package: {sorted(set(ROOMS) - packages)}"
    )


# --- the package list --------------------------------------------------------------------


def test_pyproject_lists_every_package() -> None:
    """pyproject names the packages one by one (the finder cannot map the root to
    `trajforge`); a package folder missing from the list installs without it, silently,
    and a listed package that no longer exists breaks the build."""
    setuptools_config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools_config["package-dir"] == {PACKAGE: "."}
    listed = set(setuptools_config["packages"])

    on_disk = {PACKAGE} | {
        ".".join([PACKAGE, *init.parent.relative_to(REPO).parts])
        for room in ROOMS
        for init in (REPO / room).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    missing = sorted(on_disk - listed)
    stale = sorted(p for p in listed
                   if not REPO.joinpath(*p.split(".")[1:], "__init__.py").is_file())
    # A folder with modules but no __init__.py would not be a listed package, so not shipped.
    no_init = sorted({
        py.parent.relative_to(REPO).as_posix()
        for py in python_files(REPO)
        if not (py.parent / "__init__.py").is_file()
    })
    assert not (missing or stale or no_init), (
        f"add to [tool.setuptools] packages in pyproject.toml: {missing}\n"
        f"listed but no such package (no <folder>/__init__.py): {stale}\n"
        f"folders with .py files but no __init__.py (not installed): {no_init}"
    )


# --- a real, non-editable install --------------------------------------------------------

_NOT_SOURCE_ANYWHERE = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache"}
_NOT_SOURCE_AT = {REPO: {"build", "dist", ".trajforge"}, REPO / "data": {"warehouse"}}  # as in .gitignore


def _ignore_for_copy(folder: str, names: list[str]) -> set[str]:
    """What the wheel build does not need: virtualenvs, caches, build outputs, the local warehouse."""
    here = _NOT_SOURCE_AT.get(Path(folder), set())
    return {n for n in names if n in _NOT_SOURCE_ANYWHERE or n in here
            or n.startswith(".venv") or n.endswith(".egg-info")}


@dataclass(frozen=True)
class BuiltWheel:
    wheel: Path
    source: Path  # the snapshot of the repository the wheel was built from


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> BuiltWheel:
    """A wheel built from a snapshot of the repository, the way pip builds it for a user.

    Built from a copy, not the checkout itself: an in-tree build writes build/ and
    trajforge.egg-info into the checkout that other people are editing, and a snapshot
    keeps the wheel and the file list it is compared with from the same moment.
    """
    source = tmp_path_factory.mktemp("source") / "trajforge"
    shutil.copytree(REPO, source, ignore=_ignore_for_copy)
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(source)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`{' '.join(command)}` took more than 300 s; with build isolation it fetches the build "
                    "backend (setuptools) from the package index: is the index reachable?")
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr)[-4000:]
        fetch_failed = any(s in output for s in ("No matching distribution found for setuptools",
                                                 "Could not find a version that satisfies the requirement setuptools",
                                                 "NewConnectionError", "Network is unreachable",
                                                 "Temporary failure in name resolution"))
        reason = ("it could not fetch the build backend (setuptools>=69) from the package index, which "
                  "build isolation needs (CI reaches it)" if fetch_failed else f"exit status {proc.returncode}")
        pytest.fail(f"building the wheel failed: {reason}\n$ {' '.join(command)}\n{output}")
    wheels = sorted(out.glob("*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {out}, found {[w.name for w in wheels]}"
    return BuiltWheel(wheels[0], source)


def _runtime_files(source: Path) -> list[str]:
    """Every file a running trajforge opens, relative to the package root: the modules of
    every room and the data files of RUNTIME_DATA_GLOBS (hidden files excluded, like
    setuptools' package-data globs do)."""
    files = ["__init__.py", *(p.relative_to(source).as_posix() for p in python_files(source))]
    for pattern in RUNTIME_DATA_GLOBS:
        matches = [p for p in source.glob(pattern) if p.is_file() and not p.name.startswith(".")]
        assert matches, f"{pattern} matches no file in the repository: update RUNTIME_DATA_GLOBS"
        files += [p.relative_to(source).as_posix() for p in matches]
    return sorted(set(files))


def test_wheel_holds_one_import_name_and_every_runtime_file(built_wheel: BuiltWheel) -> None:
    """An install adds exactly one import name, `trajforge` (a stray top-level `llm` or
    `data` would clash with other packages), and ships every module and every data file
    the code loads at run time: a missing package-data glob only shows after install."""
    with zipfile.ZipFile(built_wheel.wheel) as wheel:
        names = set(wheel.namelist())
        dist_info = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        assert len(dist_info) == 1, f"expected one .dist-info folder, found {sorted(dist_info)}"
        top_level_txt = wheel.read(f"{dist_info.pop()}/top_level.txt").decode().split()

    assert top_level_txt == [PACKAGE], f"top_level.txt says {top_level_txt}"
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {PACKAGE}, f"the wheel's top-level names are {sorted(tops)}, not just {PACKAGE}"

    missing = [f for f in _runtime_files(built_wheel.source) if f"{PACKAGE}/{f}" not in names]
    assert not missing, ("the wheel lacks these files of the repository (a package or a "
                         "[tool.setuptools.package-data] glob is missing in pyproject.toml):\n" + _lines(missing))


# Run in a fresh interpreter whose only trajforge is the installed wheel. argv: target, expected (JSON).
_INSTALLED_CHECK = r"""
import json, sys
from pathlib import Path

target = Path(sys.argv[1]).resolve()
expected = json.loads(sys.argv[2])

def installed(path):
    return Path(path).resolve().is_relative_to(target)

import trajforge
assert installed(trajforge.__file__), f"trajforge came from {trajforge.__file__}, not the install in {target}"

from trajforge.envs.apps import known_apps, load_app
apps = known_apps()
assert apps == expected["apps"], f"known_apps() = {apps}; the repository has {expected['apps']}"
for name in apps:
    load_app(name)

import importlib
from trajforge.llm.prompts import load_prompt
# llm prompts load from the default folder (llm/prompts); the other rooms (guidance/distill.py,
# synth/ask.py, synth/grounding.py, ...) load theirs with load_prompt(name, Path(__file__).parent
# / "prompts"), the folder beside their modules.
loaded = []
for room, names in expected["prompts"].items():
    folder = None if room == "llm" else Path(importlib.import_module(f"trajforge.{room}").__file__).parent / "prompts"
    for name in names:
        prompt = load_prompt(name) if folder is None else load_prompt(name, folder)
        assert installed(prompt.path), f"prompt {name} came from {prompt.path}"
        loaded.append(f"{room}/{name}")

import trajforge.flows.cli

outside = sorted(name for name, module in sys.modules.items()
                 if (name == "trajforge" or name.startswith("trajforge."))
                 and getattr(module, "__file__", None) and not installed(module.__file__))
assert not outside, f"modules loaded from outside the install: {outside}"
print(json.dumps({"apps": apps, "prompts": loaded,
                  "modules": sum(1 for n in sys.modules if n.startswith("trajforge"))}))
"""


def test_installed_wheel_loads_apps_prompts_and_cli(built_wheel: BuiltWheel, tmp_path: Path) -> None:
    """The installed package works away from the checkout: every bundled app and every
    prompt loads from the install's own files, and the CLI imports. From the checkout the
    repository root hides what an install lacks; this is what a user gets."""
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(built_wheel.wheel)]
    proc = subprocess.run(install, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"$ {' '.join(install)}\n{(proc.stdout + proc.stderr)[-4000:]}"

    source = built_wheel.source
    expected = {
        "apps": sorted(p.parent.name for p in source.glob("envs/apps/*/__init__.py")),
        "prompts": {room: sorted(p.stem for p in (source / room / "prompts").glob("*.yaml"))
                    for room in sorted({p.parent.parent.name for p in source.glob("*/prompts/*.yaml")})},
    }
    # The rooms whose prompts the pipeline loads today; a room that loses its folder fails here.
    assert expected["apps"] and {"llm", "guidance", "synth"} <= expected["prompts"].keys(), \
        f"nothing to check: {expected}"

    # The interpreter with the dependencies (the .venv's python when run as the README says).
    # That .venv holds an editable install of the checkout, but its finder is a meta-path
    # hook that setuptools *appends* to sys.meta_path, after the ordinary path finder, so
    # PYTHONPATH=target wins; the script asserts it did (trajforge.__file__ and every
    # loaded trajforge module under target). cwd is an empty folder, not the repository,
    # so the checkout is not on sys.path either.
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop("PYTHONHOME", None)
    command = [sys.executable, "-c", _INSTALLED_CHECK, str(target), json.dumps(expected)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=workdir, env=env,
                          check=False)
    assert proc.returncode == 0, f"the installed wheel does not work:\n{(proc.stdout + proc.stderr)[-6000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["apps"] == expected["apps"]
    assert len(result["prompts"]) == sum(map(len, expected["prompts"].values()))
