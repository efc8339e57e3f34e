"""The "file" backend: one file per page in a local directory."""
