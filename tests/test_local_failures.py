"""A request the in-process model cannot answer fails that request alone, as an endpoint's error does: a
GatewayError whose record says why, so a stage drops the one row and counts it."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import require
from test_llm_models import build_tiny_qwen25_vl

from trajforge.llm import Gateway, GatewayError, ImagePart, load_prompt
from trajforge.llm.local import missing_models
from trajforge.schemas.config import LLMSettings

SAY = """
version: 1
sampling: {max_tokens: 4}
messages:
  - role: user
    images: screenshots
    content: "{{ question }}"
"""


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> Path:
    reason = missing_models(embedded=False)
    require(reason is None, str(reason))
    folder = tmp_path_factory.mktemp("qwen25vl") / "tiny-qwen2.5-vl"
    build_tiny_qwen25_vl(folder)
    return folder


def test_an_image_the_local_model_cannot_read_fails_that_request_as_a_gateway_error(tiny_vl, tmp_path):
    (tmp_path / "say.yaml").write_text(SAY)
    broken = load_prompt("say", tmp_path).render(question="click Checkout", screenshots=[ImagePart(png=b"not a png")])
    with Gateway(LLMSettings(local={"model": str(tiny_vl)}, cache=False)) as gw:
        with pytest.raises(GatewayError) as err:
            gw.chat_sync(broken)
        assert gw.stats.errors == 1 and gw.stats.calls == 0
    record = err.value.record
    assert (record.model_id, record.backend, record.observation_mode) == (str(tiny_vl), "transformers", "image")
    assert record.error.startswith(f"local model {tiny_vl}: UnidentifiedImageError: cannot identify image file")
