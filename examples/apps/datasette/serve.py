"""Serve books.csv with Datasette (https://datasette.io, `pip install datasette`): the worked example of
README "Your own app". The database is built from the CSV at every start, so each run sees the same data.

    python serve.py --port 8001
"""

import argparse
import csv
import signal
import sqlite3
import sys
import tempfile
from contextlib import closing
from pathlib import Path

from datasette.cli import cli

HERE = Path(__file__).parent

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, default=8001)
port = parser.parse_args().port
# Stopped by SIGTERM (trajforge's stop, `kill`), the process exits through the `with` below, which removes the
# database's folder, as Ctrl-C's KeyboardInterrupt does: uvicorn, once shut down, raises the signal it caught again,
# and SIGTERM's default action ended the process there (every start left a folder in /tmp).
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
with tempfile.TemporaryDirectory(prefix="datasette-books-") as folder:
    db = Path(folder) / "books.db"
    with open(HERE / "books.csv", newline="") as f, closing(sqlite3.connect(db)) as con, con:
        rows = list(csv.DictReader(f))
        con.execute("CREATE TABLE books (title TEXT PRIMARY KEY, author TEXT, year INTEGER, genre TEXT, pages INTEGER)")
        con.executemany("INSERT INTO books VALUES (:title, :author, :year, :genre, :pages)", rows)
    # Datasette in this process, so stopping it stops the server.
    cli.main(["serve", str(db), "--port", str(port), "--metadata", str(HERE / "metadata.json"),
              "--setting", "suggest_facets", "off"], prog_name="datasette")
