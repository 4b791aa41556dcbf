"""pdserve: the command-line entry point and, later, the local-cluster launcher."""
