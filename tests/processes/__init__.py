"""Worker processes: workers="processes" for maps and calls."""
