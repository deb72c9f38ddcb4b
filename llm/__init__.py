"""The model gateway: one client for every stage that thinks, on a laptop or a GPU cluster.

A stage renders one of its templates (llm/prompts/<name>.yaml) and asks:

    gateway = Gateway.from_settings(settings)
    result = await gateway.chat(load_prompt("step_critic").render(task=..., screenshots=[sha256]), schema=Critique)
    result.parsed, result.record.observation_mode, gateway.stats.models, gateway.stats.prompts

or `gateway.chat_sync(...)` from synchronous code.
"""

from trajforge.llm.calls import CallRecord, ChatResult, GatewayError, Sampling
from trajforge.llm.gateway import Gateway, GatewayStats
from trajforge.llm.messages import ImagePart, Message, TextPart
from trajforge.llm.prompts import Prompt, PromptError, RenderedPrompt, load_prompt

__all__ = [
    "CallRecord",
    "ChatResult",
    "Gateway",
    "GatewayError",
    "GatewayStats",
    "ImagePart",
    "Message",
    "Prompt",
    "PromptError",
    "RenderedPrompt",
    "Sampling",
    "TextPart",
    "load_prompt",
]
