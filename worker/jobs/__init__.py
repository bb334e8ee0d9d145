"""The job pipeline: claim, prepare, generate and write one job, with its leases and telemetry."""
