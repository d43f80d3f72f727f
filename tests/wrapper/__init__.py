"""The DataParallel wrapper: calls, options, registrations, drop-in use and errors."""
