"""The environments: where tasks run and how their success is read.

- `envs.kinds`: the app kinds (bundled web app, MiniWoB++, Android) behind one
  interface: their tasks, their environment, their checker;
- `envs.apps`: the bundled web apps (stdlib HTTP servers with per-session state) whose
  state, not their screen, is what checkers judge;
- `envs.spec`: the app spec, a page graph with slots and goals; `envs.operations`: UI
  operations on named elements (what a reference path is made of);
- `envs.miniwob`: MiniWoB++ tasks from the `miniwob` package, seeded, with their own rewards;
- `envs.android`: Android devices over ADB, with the browser env's interface;
- `envs.actions`: GUI-Owl's mobile (paper Table 9) and desktop (Table 10) action
  spaces in pixels, with validation that never raises;
- `envs.axtree`: the accessibility tree as data, and the one owner of its text form;
- `envs.browser`: a headless Chromium environment (Playwright + CDP) that observes
  screenshots and accessibility trees with boxes and executes pixel actions;
- `envs.pool`: N isolated browser contexts on one browser, run in parallel.
"""
