"""The HTTP API as a FastAPI app over an engine and a stats view, Serve-free (tested over a fake engine)."""
