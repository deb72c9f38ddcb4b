"""trajforge: a self-evolving trajectory data factory for GUI agents.

The repository's top-level folders are the rooms of one package: installed, they are
`trajforge.schemas`, `trajforge.data`, `trajforge.llm`, `trajforge.envs`,
`trajforge.query_gen`, `trajforge.rollout`, `trajforge.critics`, `trajforge.guidance`,
`trajforge.synth`, `trajforge.tasks` and `trajforge.flows` (pyproject.toml maps them),
so an install adds one import name and collides with no other package.
"""
