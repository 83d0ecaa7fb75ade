"""The host, importing nothing of ours: paths, files another user can write, who holds a port,
what a llama-server build is."""
