"""Streaming inference over many batches: ``DataParallel.map``, on replica threads or on
the worker processes of :mod:`dpmethods.processes`, and resumable maps."""
