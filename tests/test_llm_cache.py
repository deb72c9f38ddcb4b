"""The response cache is shared through the catalog database: SQLite by default, PostgreSQL in production."""

from __future__ import annotations

import uuid

import pytest

from trajforge.llm.cache import ResponseCache
from trajforge.llm.calls import Completion


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'catalog.db'}"
    return request.getfixturevalue("postgres_url")


def test_workers_share_answers_and_the_first_answer_stands(db_url):
    first, second = ResponseCache(db_url), ResponseCache(db_url)  # two workers, one database
    key = uuid.uuid4().hex + uuid.uuid4().hex  # unique per run: the PostgreSQL table outlives the test
    try:
        assert second.get(key) is None
        first.put(key, "model-x", "judge", "3", Completion("answer one", "stop", 12, 3, attempts=2))
        second.put(key, "model-x", "judge", "3", Completion("answer two", "stop", 12, 3))  # a race: no error
        assert second.get(key) == Completion("answer one", "stop", 12, 3, attempts=0)
        assert first.get(key) == second.get(key)
    finally:
        first.close()
        second.close()
