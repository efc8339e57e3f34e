"""The built-in L3 storage backends, one package each, created by name (``storage.registry``)."""
