"""Writing a checkpoint: the trainer-side engine and handoff, the writer process, puts, commit, lease, local tier, merge."""
