"""The ground floor: the words every layer shares — event names and their catalogue, exit codes,
the policy's phases, the reset triggers, the check verdicts. Imports nothing of llama-guard's own."""
