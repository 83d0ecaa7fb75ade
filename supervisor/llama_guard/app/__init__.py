"""The verbs and the assembly of the daemon."""
