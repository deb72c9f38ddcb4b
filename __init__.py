"""trajforge: a self-evolving trajectory data factory for GUI agents.

The repository's top-level folders are the rooms of one package: installed, they are
`trajforge.schemas`, `trajforge.data`, `trajforge.llm`, `trajforge.envs`,
`trajforge.query_gen`, `trajforge.rollout`, `trajforge.critics`, `trajforge.guidance`,
`trajforge.synth`, `trajforge.tasks` and `trajforge.flows` (pyproject.toml maps them),
so an install adds one import name and collides with no other package.
"""

import os

# Torch's OpenMP threads spin while they wait for each other, on the cores the rest of a night (browsers, OCR,
# a second test worker) needs. A 2.7k-token prompt with 60 answer tokens of the embedded model on 2 cores:
# 11.3 s alone and 40-48 s beside two busy processes as OpenMP runs by default; 12.2 s and 24.2 s with passive
# waiting, which is better than one thread beside them (26 s). Set before torch loads: OpenMP reads it once.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
