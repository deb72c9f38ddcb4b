"""Query generation's crawl: interface validation of the bundled apps' page-graph queries on 1 to N contexts.

Validation visits each (page, route) the queries pass through once: a reset, the form actions that reach a
page its url cannot show, and the lookup of the elements the next transition needs (query_gen.validation).
Each visit is mostly waiting (a page load, the app's answer to a form), so `query_gen.contexts`
contexts of one browser visit pages side by side. The same queries are generated and validated at each
context count, in this process, the browser's start included; the figure is each count's time as a ratio
of one context's.

    python benchmarks/crawl_bench.py [--apps calendar,mail,notes,settings,shop] [--queries 60] [--contexts 1,2,4,8]

Prints a table; never asserts.
"""

from __future__ import annotations

import argparse
import time

from trajforge.envs.apps import load_app
from trajforge.envs.browser import CHROMIUM
from trajforge.envs.kinds import BundledWebKind
from trajforge.query_gen.stage import generate_queries
from trajforge.schemas.config import QueryGenSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--apps", default="calendar,mail,notes,settings,shop")
    parser.add_argument("--queries", type=int, default=60, help="Page-graph queries per app (query_gen.num_queries).")
    parser.add_argument("--contexts", default="1,2,4,8", help="Context counts to validate with; the first is the "
                        "baseline.")
    args = parser.parse_args()
    apps = [BundledWebKind(load_app(name)) for name in args.apps.split(",")]

    rows = []
    for contexts in [int(c) for c in args.contexts.split(",")]:
        settings = QueryGenSettings(num_queries=args.queries, atomic_per_app=0, contexts=contexts)
        start = time.perf_counter()
        out = generate_queries(apps, run_id="crawl-bench", settings=settings, chromium=CHROMIUM)
        rows.append((contexts, time.perf_counter() - start, len(out.rows["queries"]),
                     sum(n for reason, n in out.dropped.items() if "interface validation" in reason)))
        print(f"{contexts} contexts: {rows[-1][1]:.1f} s", flush=True)

    base = rows[0][1]
    print(f"\n{args.apps}, {args.queries} queries per app")
    print(f"| contexts | seconds | queries kept | dropped by validation | of {rows[0][0]} context's time |")
    print("| --- | --- | --- | --- | --- |")
    for contexts, seconds, kept, dropped in rows:
        print(f"| {contexts} | {seconds:.1f} | {kept} | {dropped} | {seconds / base:.2f} |")


if __name__ == "__main__":
    main()
