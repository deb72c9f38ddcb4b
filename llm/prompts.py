"""Prompts as versioned template files: `llm/prompts/<name>.yaml`.

A prompt is data, not code: a stage's output rows and its snapshot lineage name the
template and version that asked, so a change of wording is a new version that can be
compared with the old one, and the response cache never answers the new wording with
the old one's answers. The version recorded is the file's `version:`, a `+` and the first
8 hex digits of the file's sha256 (`"2+1f0c9a7e"`): edits have shipped without a bump of
`version:` (a rewritten instruction, a new answer format), and rows written before and
after one must not name the same prompt. A file looks like:

    version: "2"
    description: why this prompt exists
    format: json            # text | json | tool_call | think_answer: what the answer must be
    sampling: {max_tokens: 128}
    messages:
      - role: system
        content: You judge one step of a GUI agent ...
      - role: user
        images: screenshots # a variable holding images (blob sha256, bytes or ImagePart)
        content: |
          Task: {{ task }}

Contents are Jinja templates; a variable the caller did not give is an error, not an
empty string.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jinja2
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trajforge.llm.calls import Sampling
from trajforge.llm.messages import ImagePart, Message, TextPart
from trajforge.schemas.config import read_yaml, yaml_problem
from trajforge.schemas.ids import digest

PROMPTS_DIR = Path(__file__).parent / "prompts"
_JINJA = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=False)

OutputFormat = Literal["text", "json", "tool_call", "think_answer"]


class PromptError(ValueError):
    """A template that cannot be loaded or rendered; the message names the file and the field or variable."""


class _MessageTemplate(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant"]
    content: str
    images: str | None = Field(default=None, description="Variable whose images go before the text.")


class _PromptFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)

    version: str = Field(min_length=1)
    description: str = ""
    format: OutputFormat = "text"
    sampling: Sampling = Sampling()
    messages: list[_MessageTemplate] = Field(min_length=1)


@dataclass(frozen=True)
class RenderedPrompt:
    """Messages ready to send, with the template they came from."""

    template: str
    version: str
    format: OutputFormat
    sampling: Sampling
    messages: tuple[Message, ...]


@dataclass(frozen=True)
class Prompt:
    name: str
    version: str
    format: OutputFormat
    sampling: Sampling
    path: Path
    _messages: tuple[tuple[_MessageTemplate, jinja2.Template], ...]

    def render(self, **variables: Any) -> RenderedPrompt:
        """The messages with `variables` filled in; images come from the variables a message names."""
        messages = []
        for i, (spec, template) in enumerate(self._messages):
            where = f"{self.path}: messages[{i}]"
            try:
                text = template.render(**variables).strip()
            except jinja2.UndefinedError as exc:
                raise PromptError(f"{where}.content: {exc.message} (variables given: {sorted(variables)})") from None
            parts: list[TextPart | ImagePart] = []
            if spec.images is not None:
                if spec.images not in variables:
                    raise PromptError(
                        f"{where}.images: variable {spec.images!r} not given (variables given: {sorted(variables)})"
                    )
                parts += [_image(value, f"{where}.images ({spec.images})") for value in variables[spec.images]]
            parts.append(TextPart(text=text))
            messages.append(Message(role=spec.role, content=parts))
        return RenderedPrompt(self.name, self.version, self.format, self.sampling, tuple(messages))


def _image(value: str | bytes | ImagePart, where: str) -> ImagePart:
    if isinstance(value, ImagePart):
        return value
    try:
        return ImagePart(png=value) if isinstance(value, bytes) else ImagePart(sha256=value)
    except ValidationError as exc:
        raise PromptError(f"{where}: {exc.errors()[0]['msg']}") from None


PACKAGE_ROOT = Path(__file__).parents[1]


def prompts_fingerprint(root: Path | None = None) -> str:
    """A digest of every prompt template the package holds (each room's `prompts/*.yaml`, by path and content):
    what a stage that does its units once (`StageDef.once`) must redo them for when it changes. The code version
    does not tell it: a checkout already dirty, or an install without git, has the same one after an edit."""
    root = root or PACKAGE_ROOT
    files = sorted(root.glob("*/prompts/*.yaml"))
    return digest("\n".join(f"{path.relative_to(root)}:{digest(path.read_bytes(), 32)}" for path in files))


def load_prompt(name: str, folder: Path = PROMPTS_DIR) -> Prompt:
    """The template `folder/<name>.yaml`, checked whole: a bad template fails before any call."""
    path = Path(folder) / f"{name}.yaml"
    try:
        content = path.read_bytes()
        data = read_yaml(path)
    except OSError as exc:
        raise PromptError(f"{path}: cannot read prompt {name!r}: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise PromptError(f"{path}{yaml_problem(exc)}") from None
    try:
        spec = _PromptFile.model_validate(data)
    except ValidationError as exc:
        fields = "; ".join(f"field {'.'.join(map(str, e['loc'])) or '(top)'!r}: {e['msg']}" for e in exc.errors())
        raise PromptError(f"{path}: {fields}") from None
    compiled = []
    for i, message in enumerate(spec.messages):
        try:
            compiled.append((message, _JINJA.from_string(message.content)))
        except jinja2.TemplateSyntaxError as exc:
            raise PromptError(f"{path}: messages[{i}].content line {exc.lineno}: {exc.message}") from None
    version = f"{spec.version}+{digest(content, 8)}"  # names the text itself: module docstring
    return Prompt(name, version, spec.format, spec.sampling, path, tuple(compiled))
