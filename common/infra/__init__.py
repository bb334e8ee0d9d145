"""Settings, the database, object storage, logs, migrations and process utilities."""
