"""Real InferScale processes and the servers they need, started on loopback for the demo, the benchmarks and the
tests: the memory service, an inference node, PostgreSQL and SeaweedFS, and the tiny models the tests build. Not
part of the product (the package is not installed with it)."""
