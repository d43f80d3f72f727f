"""The pipeline: scatter, replicate, parallel_apply, gather, and their helpers."""
