"""The `vlmq` command: the composition root above api/ and worker/."""
