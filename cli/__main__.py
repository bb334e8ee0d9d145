"""`python -m cli`: the `vlmq` command."""

from cli.main import main

main()
