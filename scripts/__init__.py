"""Command-line tools beside the entry scripts; a package so that ``scripts.bench`` can be imported by tests."""
