"""The "mooncake" backend: pages in a Mooncake Store, through one shared, watched client."""
