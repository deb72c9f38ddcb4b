"""The stage runner: any `StageDef` run shard by shard, with resume from the ledger and one commit per
table (`runner`), and its Prefect task wrapper (`prefect_tasks`). It knows no stage by name: the
stages declare themselves in their rooms and `flows.stages` orders them."""
