"""What a run hands on: the end-to-end training table (`export`, the `export` stage) and the
per-run report (`report`, written by the nightly flow, printed by `trajforge report`)."""
