"""The data contracts: record models, their Arrow schemas with a schema version, the configuration model,
the stage contract (`stage`) and ids (`ids`)."""
