"""Batches: ingesting an input file into jobs, datasets, archives and finalizing the output."""
