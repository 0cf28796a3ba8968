"""tokenos' test suite: one folder per source package (tests/core tests tokenos/core, ...); the shared
machinery lives in tests.fixtures, and no test module imports another test module or a conftest."""
