"""The status: the status file and lock, the snapshot, /livez and /readyz, `status`'s view."""
