"""Streaming inference over many batches: DataParallel.map and its workers."""
