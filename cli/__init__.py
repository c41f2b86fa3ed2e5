"""The `specdec` command line; it imports the services, none of them imports it."""
