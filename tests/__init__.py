"""The tests, arranged as service/ is: tests/<package>/ holds the unit tests of service/<package>/.

Beside those rooms: parity/ (the whole service in process against the independent references),
e2e/ (the product run from outside: a server process, real clients, the soak), deploy/ (the chart,
the Dockerfile, the image), docs/ (the documentation cannot drift), benchmarks/ (CPU smoke tests of
benchmarks/). support/ holds what they share and is no test. docs/development.md, "The tests", says
more, and how the markers (gpu, hopper, quack, liger, two_gpus, parity) select and skip.
"""
