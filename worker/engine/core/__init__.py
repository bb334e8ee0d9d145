"""The engine's torch-free core: the scheduler, block manager, encoder cache bookkeeping, requests."""
