"""The dataset catalog (versions, tags, lineage), the screenshot blob store, notebook helpers."""
