"""ml_collections run configurations (`--config=configs/<name>.py`)."""
