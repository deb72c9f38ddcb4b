"""Prefect flows (one per stage, plus the nightly flow), the deployment and the `trajforge` CLI."""

import os

# Prefect's telemetry cannot reach its server from a closed network and logs errors about it.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
