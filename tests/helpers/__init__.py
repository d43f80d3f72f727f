"""What the tests share: tiny real models, their builders and the terms of their tolerances.

Module-level, so spawned worker processes and Ray's workers import them by name."""
