"""The ``paratrain`` command line: one module per subcommand."""
