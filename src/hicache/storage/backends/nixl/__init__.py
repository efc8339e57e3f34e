"""The "nixl" backend: page files moved by NVIDIA NIXL's POSIX (or GDS) storage plugin."""
