"""The response cache is shared through the catalog database: SQLite by default, PostgreSQL in production."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import pytest

from trajforge.llm.cache import ResponseCache, responses
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


def test_answers_stored_before_a_time_are_forgotten_and_the_rest_stay(db_url):
    """`datasets expire --responses`: an answer older than the cutoff goes (asked again, it is a miss), a newer
    one stays; a dry run only counts. The old answer is dated 1999. The PostgreSQL table is shared with other
    runs (a killed one leaves its 1999 row), so counts are taken relative to before and the rest is judged by
    this test's own keys."""
    cache = ResponseCache(db_url)
    old, new = uuid.uuid4().hex * 2, uuid.uuid4().hex * 2
    try:
        for key in (old, new):
            cache.put(key, "model-x", "judge", "3", Completion(f"answer {key[:4]}", "stop", 12, 3))
        cutoff = datetime(2000, 1, 1, tzinfo=timezone.utc)
        before = cache.forget(cutoff, dry_run=True)
        with cache.engine.begin() as conn:
            conn.execute(responses.update().where(responses.c.key == old)
                         .values(created_at=datetime(1999, 1, 1, tzinfo=timezone.utc)))
        assert cache.forget(cutoff, dry_run=True) == before + 1 and cache.get(old) is not None
        assert cache.forget(cutoff) >= 1
        assert cache.get(old) is None and cache.get(new) is not None
    finally:
        with cache.engine.begin() as conn:
            conn.execute(responses.delete().where(responses.c.key.in_([old, new])))
        cache.close()
