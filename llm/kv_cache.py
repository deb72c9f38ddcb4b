"""A key-value cache that `LocalModel` keeps from one answer of a text model to the next.

Imported only where transformers is installed (the in-process models' extra), by `llm.local`.
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache, PreTrainedConfig
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """transformers' DynamicLayer, written into buffers with room to spare rather than concatenated anew.

    DynamicLayer copies its whole cache into a new tensor at every pass: 27% of a decoding pass of the
    embedded model after a 1.9k-token prompt (torch's profiler, 2 cores). Here `keys` and `values` are views
    of the buffers' first positions, and a pass's new keys are written after them; `keep` shortens the
    views, so the next prompt reuses the positions it shares with this one and overwrites the rest.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = key_states.new_empty((*key_states.shape[:-2], 0, key_states.shape[-1]))
        self._value_buffer = value_states.new_empty((*value_states.shape[:-2], 0, value_states.shape[-1]))
        self.keep(0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            self._key_buffer = _grown(self._key_buffer, start, end)
            self._value_buffer = _grown(self._value_buffer, start, end)
        self._key_buffer[..., start:end, :] = key_states
        self._value_buffer[..., start:end, :] = value_states
        self.keep(end)
        return self.keys, self.values

    def keep(self, length: int) -> None:
        """Hold only the first `length` positions; the next update writes after them."""
        if self.is_initialized:
            self.keys = self._key_buffer[..., :length, :]
            self.values = self._value_buffer[..., :length, :]


def _grown(buffer: torch.Tensor, used: int, needed: int) -> torch.Tensor:
    """A larger buffer holding the first `used` positions: room for a prompt's answer besides (the prompts'
    max_tokens are 200 or less), and a quarter more than before, so a long answer grows it now and then, not
    at every token."""
    room = max(needed + 256, buffer.shape[-2] * 5 // 4)
    bigger = buffer.new_empty((*buffer.shape[:-2], room, buffer.shape[-1]))
    bigger[..., :used, :] = buffer[..., :used, :]
    return bigger


def kept_cache(config: PreTrainedConfig) -> Cache | None:
    """A cache of growing layers for a model of `config`, or None where a layer has a sliding window (it drops
    positions, so what it holds is not the whole prefix)."""
    layers = DynamicCache(config=config).layers
    if not all(type(layer) is DynamicLayer for layer in layers):
        return None
    return Cache(layers=[GrowingLayer() for _ in layers])


def shared_prefix(held: list[int], prompt: list[int]) -> int:
    """How many tokens `prompt` shares with `held`, its last one apart (its logits must be computed)."""
    shared = 0
    for a, b in zip(held, prompt[:-1]):
        if a != b:
            break
        shared += 1
    return shared
