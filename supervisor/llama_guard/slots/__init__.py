"""Each slot's KV cache carried across restarts: the fingerprint a file must match (:mod:`.fingerprint`),
the files and their manifests (:mod:`.store`), llama-server's slot calls (:mod:`.client`) and the
watcher that saves and restores (:mod:`.watcher`). See docs/slots.md."""
