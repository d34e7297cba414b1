"""Structured outputs in the router: the request surfaces (`surface`), their canonical, validated
`StructuredSpec` (`validate`), the spec and output reading of a whole request (`plan`), and the
flags (`flags`). The pods enforce the spec; the router only builds and checks it."""
