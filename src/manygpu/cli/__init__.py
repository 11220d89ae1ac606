"""The ``manygpu`` command line: one small module per subcommand."""
