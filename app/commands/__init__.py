"""The command line: `ulysses-studio generate|serve|batch|build|bench|launch`, its arguments and the launcher."""
