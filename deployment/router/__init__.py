"""What runs in a deployment handle's process: Serve's request router of the engine deployment
(request_router.py) and the fleet view it decides with, fed by the follower (fleet_view.py)."""
