"""Each stage's unit of work over one shard (the plain runner and its Prefect task wrappers)."""
