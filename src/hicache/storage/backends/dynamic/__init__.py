"""The "dynamic" backend: an L3 store class of the operator's own, named in the extra config."""
