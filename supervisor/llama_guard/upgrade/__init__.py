"""New llama-server builds: what a build is (build.py), its preflight (preflight.py), the last good
builds kept (kept.py), and the watcher that preflights, puts on probation and rolls back (watcher.py)."""
