"""The front door: a reverse proxy before llama-server that holds requests while it is not ready."""
