"""Operator insight: the VRAM budget (:mod:`.budget`), the bandwidth ceiling (:mod:`.ceiling`) and the
bench runner (:mod:`.bench`). Read-only: nothing here changes the GPU or the server."""
