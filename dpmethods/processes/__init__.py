"""Worker processes for ``workers="processes"``: one per device entry, each behind a
``concurrent.futures`` executor, running the calls and map batches that the threads
would run in the caller.

- :mod:`~dpmethods.processes.executor`: a worker's ``concurrent.futures`` executor (one
  process, one pipe; the replies read by the caller's thread that waits for them);
- :mod:`~dpmethods.processes.pool`: the workers' lifecycle (start, model updates, death,
  ``close()``), a batch's or share's way out and its reply read back;
- :mod:`~dpmethods.processes.worker`: what runs inside a worker;
- :mod:`~dpmethods.processes.messages`: the records that cross (a request, a reply, a warning);
- :mod:`~dpmethods.processes.pickling`: how what crosses the process boundary is pickled;
- :mod:`~dpmethods.processes.state`: what of a module's state crosses, and how its
  changes are seen;
- :mod:`~dpmethods.processes.calls`: a call's shares on the workers, and a job's output
  in the caller.

A map's batches go through :mod:`dpmethods.streaming.processes`, the process backend of
the map's scheduler.
"""
