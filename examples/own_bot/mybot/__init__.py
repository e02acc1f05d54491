"""A bot of your own for the dialog-worker image (examples/own_bot/Dockerfile)."""
