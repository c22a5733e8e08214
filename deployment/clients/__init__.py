"""Client tools the server never runs: a Python client of the statistics and streams, a traffic generator."""
