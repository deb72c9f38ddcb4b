"""trajforge: a self-evolving trajectory data factory for GUI agents.

The repository's top-level folders are the rooms of one package: installed, they are
`trajforge.schemas`, `trajforge.data`, `trajforge.llm`, `trajforge.envs`,
`trajforge.query_gen`, `trajforge.rollout`, `trajforge.critics`, `trajforge.guidance`,
`trajforge.synth`, `trajforge.tasks` and `trajforge.flows` (pyproject.toml maps them),
so an install adds one import name and collides with no other package.
"""

import os

# Torch's OpenMP threads (GNU libgomp) spin 300,000 times while they wait for each other, on the cores the rest of
# a night needs (browsers, OCR, a second test worker); waiting passively gives the cores back but slows the model
# alone, whose every decoding pass wakes its threads. 4 constrained policy answers of the embedded model on 2
# cores, seconds an answer alone / beside two busy processes (2026-12-03): as libgomp runs by default 4.61 / 18.25,
# OMP_WAIT_POLICY=PASSIVE 5.89 / 9.61, ACTIVE 4.39 / 21.06, 20,000 spins 4.61-4.65 / 11.0-11.6. Set before torch
# loads (libgomp reads it once). Your own GOMP_SPINCOUNT is kept, and so is your OMP_WAIT_POLICY (a spin count
# would override it).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")
