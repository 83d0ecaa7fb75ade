"""``llama-guard tune``: the search for the fastest llama-server flags that fit the GPU
(space, price, trial, search, report, apply, command)."""
