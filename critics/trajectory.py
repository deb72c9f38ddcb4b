"""The trajectory-level critic (paper 6.3): channels that judge a whole episode, and their consensus.

- text: a language model reads a caption of the final screen (its OCR text) and the
  step critic's summaries;
- multimodal: a vision model reads the newest screenshots and the summaries; with no
  vision model configured it is recorded as not asked, with the reason;
- checker: the app's own programmatic checker reading the state the episode ended in.

Every channel's answer is kept, asked or not, so a verdict can be re-derived under
another consensus rule and each channel can be evaluated on its own
(`trajforge eval critics`). A channel's answer is 'success', 'failure', or None when it
was not asked or gave no usable answer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trajforge.llm import Gateway, GatewayError, load_prompt
from trajforge.llm.messages import ImagePart
from trajforge.llm.ocr import OcrReader

Answer = Literal["success", "failure"]
Rule = Literal["checker_first", "paper", "k_of_n"]
TEXT, MULTIMODAL, CHECKER = "text", "multimodal", "checker"
TEXT_PROMPT = "critic_trajectory_text"
MULTIMODAL_PROMPT = "critic_trajectory_multimodal"
MAX_CAPTION_CHARS = 1500  # keeps a dense page's caption from crowding out the steps in a small model's context


class TrajectoryJudgement(BaseModel):
    """What a model channel must answer."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1)
    verdict: Literal["correct", "incorrect"]


@dataclass(frozen=True)
class ChannelAnswer:
    """One channel's answer about one episode; `asked` False says the channel was skipped and why."""

    answer: Answer | None
    reason: str
    model_id: str
    asked: bool = True
    prompt_version: str | None = None
    raw_output: str | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def not_asked(reason: str) -> ChannelAnswer:
    return ChannelAnswer(answer=None, reason=f"not asked: {reason}", model_id="none", asked=False)


def caption(png: bytes | None, reader: OcrReader) -> str:
    """The final screen as text for a text-only model: the OCR'd text boxes, top to bottom."""
    if png is None:
        return "(no screenshot: the episode took no step)"
    boxes = sorted((line.box[1] + line.box[3] / 2, line.box[0] + line.box[2] / 2, line.text)
                   for line in reader.read(png))  # by centre, top to bottom, as `OcrReader.lines` orders them
    return " | ".join(text for _, _, text in boxes)[:MAX_CAPTION_CHARS] or "(no text on the screen)"


def _ask(gateway: Gateway, model: str | None, template: str, **variables: Any) -> ChannelAnswer:
    prompt = load_prompt(template)
    try:
        result = gateway.chat_sync(prompt.render(**variables), model=model, schema=TrajectoryJudgement)
    except GatewayError as exc:
        return ChannelAnswer(None, f"no answer: {exc.record.error}", exc.record.model_id, True, prompt.version)
    judged = result.parsed
    if judged is None:
        return ChannelAnswer(
            None, f"unparsed answer: {result.parse_error}", result.record.model_id, True, prompt.version, result.text
        )
    answer: Answer = "success" if judged.verdict == "correct" else "failure"
    return ChannelAnswer(answer, judged.reason, result.record.model_id, True, prompt.version, result.text)


def text_channel(
    gateway: Gateway, model: str | None, task: str, summaries: list[str], final_png: bytes | None
) -> ChannelAnswer:
    """pi_text: the model reads the final screen's caption and the step summaries."""
    return _ask(gateway, model, TEXT_PROMPT, task=task, summaries=summaries, caption=caption(final_png, gateway.ocr))


def multimodal_channel(
    gateway: Gateway, model: str | None, task: str, summaries: list[str], screenshots: list[str]
) -> ChannelAnswer:
    """pi_multimodal: a vision model sees the screenshots (blob hashes, oldest first) and the summaries.

    Asked only of a model that takes images: a text-only model would get OCR text, which
    is the text channel again under another name.
    """
    if model is None:
        return not_asked("no vision model configured (critics.multimodal_model)")
    if not gateway.sees_images(model):
        return not_asked(f"model {model!r} does not take images (an endpoint needs vision: true)")
    images = [ImagePart(sha256=sha) for sha in screenshots]
    return _ask(gateway, model, MULTIMODAL_PROMPT, task=task, summaries=summaries, screenshots=images)


def checker_channel(success: bool, reason: str, checker_id: str) -> ChannelAnswer:
    """The programmatic channel: the app's checker on the episode's final state."""
    return ChannelAnswer("success" if success else "failure", reason, checker_id)


def _said(name: str, channel: ChannelAnswer | None) -> str:
    if channel is None:
        return f"{name}: absent"
    return f"{name}: {channel.answer or 'no answer'} ({channel.reason})"


def consensus(rule: Rule, channels: dict[str, ChannelAnswer], k: int) -> tuple[bool, str]:
    """(success, reason) of an episode under `rule`; a missing or unusable channel is handled explicitly.

    - paper: success only if text and multimodal both say success; a channel that was
      not asked or did not answer is not a success, so the episode is judged a failure
      (the rule's caution: a training example needs both channels' agreement).
    - k_of_n: success if at least k channels say success; a missing answer is no vote.
    - checker_first: the checker's answer where there is one; otherwise the paper's rule.
    """
    if rule == "checker_first":
        checker = channels.get(CHECKER)
        if checker is not None and checker.answer is not None:
            return checker.answer == "success", f"checker_first: {checker.reason}"
        success, reason = consensus("paper", channels, k)
        return success, f"checker_first, no checker answer, so {reason}"
    if rule == "paper":
        text, multimodal = channels.get(TEXT), channels.get(MULTIMODAL)
        success = all(c is not None and c.answer == "success" for c in (text, multimodal))
        verdict = "both model channels say success" if success else "needs both model channels to say success"
        return success, f"paper: {verdict}; {_said(TEXT, text)}; {_said(MULTIMODAL, multimodal)}"
    votes = sorted(name for name, c in channels.items() if c.answer == "success")
    silent = sorted(name for name, c in channels.items() if c.answer is None)
    success = len(votes) >= k
    return success, (
        f"k_of_n: {len(votes)} of {len(channels)} channels say success ({', '.join(votes) or 'none'}), "
        f"{k} needed" + (f"; no answer from {', '.join(silent)}" if silent else "")
    )
