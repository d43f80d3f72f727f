"""Third-party libraries through DataParallel with no configuration: one file per library."""
