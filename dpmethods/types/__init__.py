"""The type system: how structures come apart and are joined."""
