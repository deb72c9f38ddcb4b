"""The self-evolving loop (paper 2.2.1, 6.4): per-query history, hard-query selection, and
query-specific guidance distilled from reference trajectories for the queries the model
keeps failing. `stage.guide` runs before the rollouts that use the guidance, `stage.record`
after the critics; `tasks.stages` wraps both as the `guidance` and `history` stages."""
