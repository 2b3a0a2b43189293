"""Front ends that turn models of other frameworks into tunedb plans (imported on demand)."""
