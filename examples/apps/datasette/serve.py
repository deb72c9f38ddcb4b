"""Serve books.csv with Datasette (https://datasette.io, `pip install datasette`): the worked example of
README "Your own app". The database is built from the CSV at every start, so each run sees the same data.

    python serve.py --port 8001
"""

import argparse
import csv
import os
import sqlite3
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, default=8001)
port = parser.parse_args().port
db = Path(tempfile.mkdtemp(prefix="datasette-books-")) / "books.db"
with open(HERE / "books.csv", newline="") as f, sqlite3.connect(db) as con:
    rows = list(csv.DictReader(f))
    con.execute("CREATE TABLE books (title TEXT PRIMARY KEY, author TEXT, year INTEGER, genre TEXT, pages INTEGER)")
    con.executemany("INSERT INTO books VALUES (:title, :author, :year, :genre, :pages)", rows)
# Datasette in this process's place, so stopping it stops the server.
os.execv(sys.executable, [sys.executable, "-m", "datasette", "serve", str(db), "--port", str(port),
                          "--metadata", str(HERE / "metadata.json"), "--setting", "suggest_facets", "off"])
