"""Pure-Python references of PegaFlow's C paths (pegaflow/native/): the tests hold the C code
equal to them. PegaFlow itself never runs them (docs/architecture.md, "One source of truth")."""
