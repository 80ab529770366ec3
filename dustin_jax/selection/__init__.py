"""Which KV rows the target attends to when it verifies: signals and policies."""
