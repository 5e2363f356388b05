"""The documentation cannot drift: the generated pages, the built site, every example of README.md."""
