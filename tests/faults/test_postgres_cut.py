"""The catalog's PostgreSQL connection cut in the middle of a commit, by a TCP proxy between trajforge and the
server: the worst case, where the server has committed the new table version and the client never hears it.
The stage fails with one line; its rerun finds its own commit by its key, commits nothing twice and loses
nothing."""

from __future__ import annotations

import socket
import subprocess
import threading
import uuid
from pathlib import Path

import pytest
from fault_bench import cli_env

from trajforge.data.catalog import Catalog

pytestmark = [pytest.mark.postgres, pytest.mark.browser]

CONFIG = """\
query_gen:
  apps: [notes]
  num_queries: 2
  atomic_per_app: 1
  deep_search_apps: []
warehouse:
  catalog_url: {url}
  namespace: {namespace}
"""


class CuttingProxy:
    """Forwards 127.0.0.1:PORT to PostgreSQL; with `cut` set, the first connection that sends COMMIT after
    updating `iceberg_tables` (a table version's commit) has its COMMIT delivered, then both ends closed
    before the server's answer reaches the client."""

    def __init__(self, upstream: tuple[str, int] = ("127.0.0.1", 5432)) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut = False
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            state = {"updated": False, "closed": False}
            threading.Thread(target=self._pipe, args=(client, server, state, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, state, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, state: dict[str, bool], upstream: bool) -> None:
        try:
            while data := source.recv(65536):
                if upstream and self.cut and not self.cuts:
                    state["updated"] |= b"UPDATE iceberg_tables" in data
                    if state["updated"] and b"COMMIT" in data:
                        sink.sendall(data)  # the server commits...
                        self.cuts += 1
                        state["closed"] = True
                        threading.Event().wait(0.2)
                        break  # ...and the client never hears it
                if state["closed"]:
                    break
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()


def run(exe: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, *args], cwd=cwd, env=cli_env(cwd), capture_output=True, text=True, timeout=600,
                          check=False)


def test_a_commit_cut_after_the_server_committed_is_found_by_its_key_on_rerun(tmp_path, postgres_url,
                                                                               trajforge_cli) -> None:
    proxy = CuttingProxy()
    proxied = postgres_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    namespace = f"cut{uuid.uuid4().hex[:10]}"
    (tmp_path / "trajforge.yaml").write_text(CONFIG.format(url=proxied, namespace=namespace))
    try:
        proxy.cut = True
        broken = run(trajforge_cli, tmp_path, "run", "query_gen")
        assert proxy.cuts == 1
        assert broken.returncode == 1, broken.stdout + broken.stderr
        errors = [line for line in broken.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "server closed the connection" in errors[0], broken.stderr
        committed = Catalog(tmp_path / "data" / "warehouse", uri=postgres_url, namespace=namespace)
        assert sum(len(committed.history(t)) for t in ("queries", "pages")) == 1  # the server did commit it
        proxy.cut = False
        rerun = run(trajforge_cli, tmp_path, "run", "query_gen")
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
        assert "resuming run" in rerun.stdout
    finally:
        proxy.close()
    catalog = Catalog(tmp_path / "data" / "warehouse", uri=postgres_url, namespace=namespace)
    for table in ("queries", "pages"):
        versions = catalog.history(table)
        assert len(versions) == 1, f"{table}: {len(versions)} versions, one stage commits each table once"
        rows = catalog.load(table)
        assert rows.height == versions[0].added_rows and rows.height > 0
    queries = catalog.load("queries")
    assert queries["query_id"].is_unique().all() and queries.height == 3  # 2 page-graph queries and 1 atomic
