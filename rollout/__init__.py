"""Rollout: environments, the action spaces, policies and the episode recorder.

- `rollout.apps`: bundled web apps (stdlib HTTP servers with per-session state) whose
  state, not their screen, is what checkers judge;
- `rollout.miniwob`: MiniWoB++ tasks from the `miniwob` package, seeded, with their own rewards;
- `rollout.android`: Android devices over ADB, with the browser env's interface;
- `rollout.actions`: GUI-Owl's mobile (paper Table 9) and desktop (Table 10) action
  spaces in pixels, with validation that never raises;
- `rollout.env`: a headless Chromium environment (Playwright + CDP) that observes
  screenshots and accessibility trees with boxes and executes pixel actions;
- `rollout.pool`: N isolated browser contexts on one browser, run in parallel;
- `rollout.gui_owl`, `rollout.mobile_agent`: the model-driven policies (paper 2.1, 7);
- `rollout.replay`, `rollout.random_policy`: the reference replay and the random baseline;
- `rollout.episode`: the recorder that turns a policy run into Episode and Step rows;
- `rollout.stage`: the rollout stage over one shard of queries (no Prefect here).
"""
