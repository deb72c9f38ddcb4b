"""Prefect flows (one per stage, plus the nightly flow), the deployment and the `trajforge` CLI."""

import os

# Prefect's telemetry cannot reach its server from a closed network and logs errors about it.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# The temporary server's first start with a fresh PREFECT_HOME runs its migrations (about 15 s on
# 2 idle cores, shared/FACTS.md) against a 20 s default limit; on a loaded machine it missed it
# ("Timed out while attempting to connect to ephemeral Prefect API server") and the run died.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
