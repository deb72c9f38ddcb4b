"""The self-evolving loop (paper 2.2.1, 6.4): per-query history, hard-query selection, and
query-specific guidance distilled from reference trajectories for the queries the model
keeps failing. The `guidance` stage (`stage.py`) runs before the rollouts that use the
guidance, the `history` stage (`history.py`) after the critics."""
