"""The dataset catalog (versions, tags, lineage), the screenshot blob store, the run ledger, notebook helpers."""
