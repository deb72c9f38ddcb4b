"""Critics: pre-filters, step critic, trajectory critic channels and their consensus (the `critics` stage,
`stage.py`, which reads each app kind's programmatic checker from `envs.kinds`), and their evaluation."""
