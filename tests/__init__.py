"""The test suite, grouped by subject; shared models and builders are in tests.helpers."""
