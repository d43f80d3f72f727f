"""The docs, README, examples and package layout say what the code does."""
