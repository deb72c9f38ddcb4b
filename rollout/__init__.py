"""Rollout: the agent that acts in the environments of `envs`, and the episode recorder.

- `rollout.gui_owl`, `rollout.mobile_agent`: the model-driven policies (paper 2.1, 7);
- `rollout.replay`, `rollout.random_policy`: the reference replay and the random baseline;
- `rollout.episode`: the recorder that turns a policy run into Episode and Step rows;
- `rollout.stage`: the rollout stage over one shard of queries (no Prefect here).
"""
