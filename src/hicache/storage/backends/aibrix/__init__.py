"""The "aibrix" backend: AIBrix KVCache's host cache over a RocksDB store in a local directory."""
