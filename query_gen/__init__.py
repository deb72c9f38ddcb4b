"""Query generation (the `query_gen` stage, `stage.py`): path sampling on app page graphs, instruction
synthesis and refinement, interface validation, atomic operations, deep search; task suites bring their own."""
