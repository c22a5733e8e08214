"""What runs in an ingress replica's process: its Serve class (serve.py), the engine client with
re-send (engine_client.py, resend.py, resume.py), the Serve-free FastAPI app (api/) and the stats view (stats/)."""
