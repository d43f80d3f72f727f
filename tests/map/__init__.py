"""DataParallel.map: scheduling, items, checkpoints, retries, timeouts and out-of-memory splits."""
