"""Cross-cutting helpers every program may use: logging, errors and their gRPC codes, security,
HTTP endpoints, gRPC serving, OpenTelemetry (docs/architecture.md, the code map)."""
